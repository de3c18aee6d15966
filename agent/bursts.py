"""Protecting granted bytes from bursters, between two of the manager's decisions.

A burstable grant reserves its request on the manager's map and may use up to its limit while the
GPU has room. The manager never grants bytes a burster holds at its last heartbeat; but a burster
still under its limit can grow, after that heartbeat, into bytes just granted to a new container.
So after every full sample the agent adds up, per GPU, what is spoken for: each running container's
``max(use, request)`` plus the memory no managed container explains. Once that passes the GPU's
total minus the manager's headroom (told in ``Registered``), it stops bursters (containers with a limit
above their request, using more than their request there), lowest priority first, then the largest burst,
then the youngest, until it fits again. Each is killed with reason ``burst_reclaimed``, which the manager
records as ``preempted``. A container back under its request is no burster: it is never stopped here; nor is
one without a limit over its grant (the enforcer holds it to its grant, as its ``on_overrun`` says).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from gpumgr.agent.gpus.source import Device
from gpumgr.agent.meter import Sample, still_theirs
from gpumgr.agent.runtimes.runtime import Managed, Runtime
from gpumgr.wire.names import BURST_RECLAIMED

log = logging.getLogger(__name__)


class BurstGuard:
    """Stops bursters when a GPU's spoken-for bytes pass its total minus the headroom; see the module docstring."""

    def __init__(self, runtime: Runtime, devices: list[Device]) -> None:
        self.runtime = runtime
        self.totals = {d.uuid: d.memory_total for d in devices}
        #: bytes per GPU the manager keeps back from grants (its ``Registered`` says; 0 until then)
        self.headroom = 0
        #: grants stopped here, so a container dying slowly is not stopped twice
        self._stopped: set[str] = set()

    def guard(self, sample: Sample, managed: dict[str, Managed], room: dict[str, int]) -> dict[str, int]:
        """Stop what must stop after ``sample``; return ``room`` (each GPU's least growth that needs a full
        sample) tightened to what is left before the GPU's spoken-for bytes pass its total minus the headroom."""
        self._stopped &= set(managed)
        tightened = dict(room)
        for gpu in sample.gpus:
            total = self.totals.get(gpu.uuid)
            if total is None:
                continue
            spoken = self.spoken_for(gpu.uuid, gpu.memory_unmanaged, sample, managed)
            if spoken > total - self.headroom:
                spoken -= self._stop_bursters(gpu.uuid, spoken - (total - self.headroom), sample, managed)
            if gpu.uuid in tightened:  # a GPU with no grant keeps no room: any growth there is looked at
                tightened[gpu.uuid] = min(tightened[gpu.uuid], max(0, total - self.headroom - spoken))
        return tightened

    def spoken_for(self, uuid: str, unmanaged: int, sample: Sample, managed: dict[str, Managed]) -> int:
        """GPU ``uuid``'s bytes spoken for: ``max(use, request)`` of each live container on it, plus ``unmanaged``."""
        return unmanaged + sum(max(sample.usage.get(c.grant, {}).get(uuid, 0), c.gpu_memory)
                               for c in managed.values() if uuid in c.gpus and c.grant not in self._stopped)

    def _stop_bursters(self, uuid: str, excess: int, sample: Sample, managed: dict[str, Managed]) -> int:
        """Stop bursters on ``uuid`` in order until ``excess`` bytes are freed; the bytes their ends free."""
        freed = 0
        for container, used in bursters(uuid, sample, managed, self._stopped):
            if freed >= excess:
                break
            if self._stop(container, uuid, used, excess, sample):
                freed += max(used, container.gpu_memory)
        return freed

    def _stop(self, container: Managed, uuid: str, used: int, excess: int, sample: Sample) -> bool:
        pids = sample.pids.get(container.grant, {}).get(uuid, [])
        if not still_theirs(self.runtime, container.grant, pids):
            return False  # its processes are gone or the PIDs were reused: nothing of it to stop
        detail: dict[str, Any] = {"reason": BURST_RECLAIMED, "gpu": uuid, "observed": used,
                                  "grant_bytes": container.gpu_memory, "limit_bytes": container.limit,
                                  "over_by": excess, "at": time.time()}
        log.warning("container %s (%s) bursts to %d bytes on %s over its request of %d, and the GPU's granted bytes "
                    "need them: stopping it", container.container_id[:12], container.grant, used, uuid,
                    container.gpu_memory)
        try:
            self.runtime.kill(container.grant, BURST_RECLAIMED, detail)
        except Exception as exc:  # the engine refused: the next full sample tries again
            log.warning("could not stop burster %s: %s", container.container_id[:12], exc)
            return False
        self._stopped.add(container.grant)
        return True


def bursters(uuid: str, sample: Sample, managed: dict[str, Managed],
             skip: set[str] | frozenset[str] = frozenset()) -> list[tuple[Managed, int]]:
    """The bursters (a limit above the request) using more than their request on GPU ``uuid``, with their use, in
    the order they are stopped: the lowest priority first, then the largest burst, then the youngest. A container
    without a limit over its grant is no burster: the enforcer holds it to its grant, as its ``on_overrun`` says."""
    found = [(c, used) for c in managed.values() if c.grant not in skip and c.limit > c.gpu_memory
             and (used := sample.usage.get(c.grant, {}).get(uuid, 0)) > c.gpu_memory]
    found.sort(key=lambda cu: (cu[0].priority, -(cu[1] - cu[0].gpu_memory), -cu[0].created_at))
    return found
