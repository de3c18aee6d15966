"""Opening the GPU source a ``--gpus`` spec names: NVML, the simulation, or NVML when a driver answers.

Kept apart from :mod:`.source` (what both sources share), so neither source imports the module that
chooses between them: no import circle.
"""

from __future__ import annotations

from gpumgr.agent.gpus.source import SIM_PREFIX, GpuSource, NvmlUnavailable
from gpumgr.wire import defaults


def open_source(gpus: str, seed: str) -> GpuSource:
    """Open the source named by ``--gpus``: ``"auto"``, ``"nvml"`` or ``"sim:SPEC"``.

    ``auto`` prefers NVML and falls back to ``wire.defaults.SIM_SPEC`` when no driver answers or it
    reports no GPU. ``seed`` (the node name) makes simulated uuids unique per agent. Raises
    ``ValueError`` for anything else or a bad spec, and ``NvmlUnavailable`` for ``nvml`` without a
    driver.
    """
    choice = gpus.strip()
    if choice.lower() == "auto":
        try:
            return _nvml()
        except NvmlUnavailable:
            return open_source(defaults.SIM_SPEC, seed)
    if choice.lower() == "nvml":
        return _nvml()
    if choice.lower().startswith(SIM_PREFIX):
        return _simulated(choice, seed)
    raise ValueError(f"--gpus must be 'auto', 'nvml' or 'sim:SPEC' such as 'sim:2x24GiB', not {gpus!r}")



def _nvml() -> GpuSource:
    from gpumgr.agent.gpus.nvml import NvmlSource

    return NvmlSource()


def _simulated(spec: str, seed: str) -> GpuSource:
    from gpumgr.agent.gpus.simgpu import SimSource, parse_sim_spec, sim_health_path

    return SimSource(parse_sim_spec(spec, seed), health_file=sim_health_path(spec))
