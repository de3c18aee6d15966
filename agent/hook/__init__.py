"""The runtime hook's relay: the socket and pipe the OCI hook asks through, answered from the runtimes.

May import the runtimes and :mod:`gpumgr.wire`.
"""
