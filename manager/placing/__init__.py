"""Placement, pure: which GPUs take a request (the scheduler), the free index it reads, and topology.

No I/O, no lock, no state of its own beyond the index it is handed. May import :mod:`gpumgr.wire` and
the records' shapes only; imported by the model.
"""
