"""GPU sources behind one interface (:mod:`.source`): NVML (:mod:`.nvml`, with :mod:`.nvml_facts`) and
the simulation (:mod:`.simgpu`); :mod:`.select` opens the one a ``--gpus`` spec names.

May import :mod:`gpumgr.wire` and the agent's process map; nothing else of the agent.
"""
