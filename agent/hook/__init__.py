"""The runtime hook's relay: the socket and pipe the OCI hook asks through, and the node's limits on
what a hook request may ask for.

May import the runtimes and :mod:`gpumgr.wire`.
"""
