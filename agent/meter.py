"""One sample of GPU memory: per GPU, and per managed container from the processes NVML lists."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from gpumgr.agent.gpus.source import Device, GpuSource
from gpumgr.agent.procmap import start_time_of
from gpumgr.agent.runtimes.runtime import Runtime
from gpumgr.wire import defaults
from gpumgr.wire.protocol import GpuSample


@dataclass
class Sample:
    """What one full look at the GPUs found."""

    gpus: list[GpuSample]
    #: grant → GPU uuid → bytes used by that container's processes on that GPU
    usage: dict[str, dict[str, int]] = field(default_factory=dict)
    #: grant → GPU uuid → (host pid, start time) using that GPU, to re-check ownership before acting
    pids: dict[str, dict[str, list[tuple[int, int | None]]]] = field(default_factory=dict)


def take_sample(source: GpuSource, devices: list[Device], runtime: Runtime) -> Sample:
    """Read every GPU's used memory and processes and attribute each process to its container.

    Memory used by anything that is not a managed container (other processes, the driver) is
    ``memory_unmanaged``: the manager subtracts it from what it may grant.
    """
    usage: dict[str, dict[str, int]] = defaultdict(dict)
    pids: dict[str, dict[str, list[tuple[int, int | None]]]] = defaultdict(lambda: defaultdict(list))
    gpus = []
    processes = source.process_snapshot()
    memory = source.memory_poll()  # right after a process snapshot the cheap read is exact
    health = source.health()
    for device in devices:
        used = memory[device.uuid]
        managed_bytes = 0
        for proc in processes[device.uuid]:
            started = start_time_of(proc.pid)
            owner = runtime.owner_of(proc.pid, started)
            if owner is None:
                continue
            used_by = min(usage[owner.grant].get(device.uuid, 0) + proc.used, defaults.MAX_BYTES)
            usage[owner.grant][device.uuid] = used_by
            pids[owner.grant][device.uuid].append((proc.pid, started))
            managed_bytes += proc.used
        used = min(used, defaults.MAX_BYTES)
        gpus.append(GpuSample(uuid=device.uuid, memory_used=used, memory_unmanaged=max(0, used - managed_bytes),
                              health=health.get(device.uuid, "")))
    return Sample(gpus, dict(usage), {g: dict(p) for g, p in pids.items()})


def still_theirs(runtime: Runtime, grant: str, pids: list[tuple[int, int | None]]) -> bool:
    """Whether any of a sample's ``(pid, start time)`` of ``grant`` is still that process in that container.

    PIDs are reused: a container is acted on only once this holds, right before the act.
    """
    for pid, started in pids:
        owner = runtime.owner_of(pid)
        if owner is not None and owner.grant == grant and start_time_of(pid) == started:
            return True
    return False
