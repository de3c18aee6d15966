"""Installing gpumgr into a Docker engine: the launchers, ``daemon.json``, the guard's install, the
engine's facts the install reads, and the files it writes.

May import the plugin's shared modules and :mod:`gpumgr.wire`.
"""
