"""Container runtimes behind one interface (:mod:`.runtime`): the Docker engine (create, run, its
event stream, the engine's on-disk records) and host processes; logs and Swarm labels.

May import the agent's shared modules (procmap, ops) and :mod:`gpumgr.wire`.
"""
