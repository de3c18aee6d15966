"""The guard: the engine's authorization plugin (its server, the decisions, what it learns of the
engine itself) and the client the agent uses to hand it tickets.

May import :mod:`gpumgr.wire`; nothing else of the agent but its shared modules.
"""
