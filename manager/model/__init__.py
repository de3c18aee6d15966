"""The cluster model: the map of nodes × GPUs × grants and every record's life, under one lock.

Holds the ledger (nodes, GPUs, grants, the invariant), records, the lifecycle (the one transition table),
the wait queue and its journal, dispatch and preemption, quotas, resizing, reconciliation from the nodes'
reports, replies to commands, intents, a term of leadership (:mod:`.terms`), the reads the API shows
(:mod:`.views`) and :class:`~gpumgr.manager.model.cluster.Cluster`, which composes them.

May import: :mod:`gpumgr.manager.placing`, the manager's shared modules (clock, events, tenants) and
:mod:`gpumgr.wire`. Never the API, the control plane or the link (import-linter holds it).
"""
