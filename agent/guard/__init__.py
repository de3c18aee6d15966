"""The guard: the engine's authorization plugin (its server, the decisions, what it learns of the
engine itself) and the client the agent uses to hand it tickets.

May import :mod:`gpumgr.wire` and the agent's shared modules; never the runtimes or the hook relay.
"""
