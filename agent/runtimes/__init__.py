"""Container runtimes behind one interface (:mod:`.runtime`): the Docker engine (create, run, its
event stream, the engine's on-disk records) and host processes; logs, Swarm labels, and the node's
limits on what a runtime hook's request may ask for (:mod:`.hook_limits`).

May import the agent's shared modules (procmap, ops), the guard's client and :mod:`gpumgr.wire`.
"""
