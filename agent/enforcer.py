"""Holding every container to its grant: measure per container, decide, act, report.

The loop reads each GPU's used memory often (cheap: one NVML memory query per GPU) and takes a
full per-process sample (the expensive NVML call) only when the growth since the last full sample
could have pushed some container past its grant, or when a GPU's use fell (a process that ended or
freed memory can hide another's growth), plus one at the regular interval. A container is *over*
when its usage on a GPU exceeds its limit (a burster's ``gpu_memory_limit``, else its grant) plus
``tolerance`` for ``samples`` consecutive full samples, or when it uses a GPU it was not granted; the
samples that confirm a first over reading are taken ``confirm_interval`` apart, not a poll apart.
Then, per the container's ``on_overrun``: ``kill`` it at once, ``stop`` it (SIGTERM, SIGKILL after a
grace period), or only ``report`` it, on a small pool of threads, so that one container's kill never
waits for another's and the loop goes on sampling; a container is acted on by one thread at a time.
Before acting, every offending PID is checked again to still be the same process in the same
container, because PIDs are reused. Processes in no managed container are never touched.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from gpumgr.agent.bursts import BurstGuard
from gpumgr.agent.gpus.source import Device, GpuSource
from gpumgr.agent.meter import Sample, still_theirs, take_sample
from gpumgr.agent.runtimes.runtime import Managed, Runtime
from gpumgr.wire import defaults
from gpumgr.wire.names import State

log = logging.getLogger(__name__)

REASON_EXCEEDED = "gpu_memory_exceeded"
REASON_NOT_GRANTED = "gpu_not_granted"

OverrunCallback = Callable[[Managed, dict[str, Any]], None]


@dataclass(frozen=True)
class EnforcerSettings:
    """How eagerly to look and how patient to be (see ``configs/agent.yaml``)."""

    poll_interval: float = defaults.POLL_INTERVAL
    sample_interval: float = defaults.SAMPLE_INTERVAL
    tolerance: int = 0
    samples: int = defaults.OVERRUN_SAMPLES
    stop_grace: float = defaults.STOP_GRACE
    confirm_interval: float = defaults.OVERRUN_CONFIRM_INTERVAL


@dataclass
class Verdict:
    """One container's standing after a full sample."""

    grant: str
    reason: str
    gpu: str
    observed: int
    limit: int
    pids: list[tuple[int, int | None]] = field(default_factory=list)


class Enforcer:
    """Runs the measure → decide → act loop on its own thread; ``latest`` is the newest full sample."""

    def __init__(self, source: GpuSource, devices: list[Device], runtime: Runtime, on_overrun: OverrunCallback,
                 settings: EnforcerSettings | None = None) -> None:
        self.source = source
        self.devices = devices
        self.runtime = runtime
        self.settings = settings or EnforcerSettings()
        self._on_overrun = on_overrun
        self._strikes: dict[tuple[str, str], int] = {}
        #: grants acted on (or being acted on by a worker): never twice, until their container is gone
        self._acted: set[str] = set()
        #: guards ``_acted`` and ``_backoff``, which the acting threads change too
        self._acting = threading.Lock()
        self._workers = ThreadPoolExecutor(defaults.ENFORCER_WORKERS, thread_name_prefix="enforce")
        #: the last full sample found an over container it has not yet confirmed
        self.confirming = False
        #: grant → (monotonic time before which no new attempt, the delay after the next failure)
        self._backoff: dict[str, tuple[float, float]] = {}
        self._baseline: dict[str, int] = {}
        self._room: dict[str, int] = {}
        self._stop = threading.Event()
        self.latest: Sample | None = None
        self.latest_at = 0.0
        self.full_samples = 0
        self.bursts = BurstGuard(runtime, devices)  # bursters stopped before they eat into granted bytes

    def stop(self) -> None:
        """End the loop; actions already handed to the workers still finish."""
        self._stop.set()
        self._workers.shutdown(wait=False)

    def run(self) -> None:
        """Poll until stopped; never raises (a failing sample is logged and retried)."""
        next_full = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                if now >= next_full or self._grew_past_room():
                    next_full = time.monotonic() + self.next_interval(self.check())
            except Exception:  # keep enforcing whatever one sample did
                log.exception("GPU memory sample failed")
                next_full = time.monotonic() + self.settings.sample_interval
            self._stop.wait(max(0.0, min(self.settings.poll_interval, next_full - time.monotonic())))

    def next_interval(self, suspicious: bool) -> float:
        """Seconds to the next full sample after one that returned ``suspicious``.

        A first over reading is confirmed ``confirm_interval`` later: a second, independent read of
        every process, so one glitched reading (a PID listed with a stale figure, a usage file read
        mid-write) still kills nothing, without a whole poll interval on every kill's path.
        """
        if self.confirming:
            return self.settings.confirm_interval
        return self.settings.poll_interval if suspicious else self.settings.sample_interval

    def check(self) -> bool:
        """Take a full sample, act on every container over its grant; True while some are over but not yet acted on."""
        sample = take_sample(self.source, self.devices, self.runtime)
        self.latest, self.latest_at = sample, time.monotonic()
        self.full_samples += 1
        self.runtime.note_usage(sample.usage)
        managed = {m.grant: m for m in self.runtime.managed() if m.state == State.RUNNING}
        verdicts = self._judge(sample, managed)
        self._remember_room(sample, managed)
        self._room = self.bursts.guard(sample, managed, self._room)
        pending = confirming = False
        for verdict in verdicts:
            key = (verdict.grant, verdict.gpu)
            self._strikes[key] = self._strikes.get(key, 0) + 1
            if self._strikes[key] >= self.settings.samples and self._claim(verdict.grant):
                self._workers.submit(self._act_logged, managed[verdict.grant], verdict)
            elif verdict.grant not in self._acted:
                pending = True
                confirming = confirming or self._strikes[key] < self.settings.samples
        over = {(v.grant, v.gpu) for v in verdicts}
        self._strikes = {k: n for k, n in self._strikes.items() if k in over}
        self.confirming = confirming
        with self._acting:
            self._acted &= set(managed)
            self._backoff = {g: b for g, b in self._backoff.items() if g in managed}
            return pending or bool(self._backoff)

    def _claim(self, grant: str) -> bool:
        """Mark ``grant`` as being acted on, unless it already is or waits out a failed attempt."""
        with self._acting:
            waiting = self._backoff.get(grant, (0.0, 0.0))[0] > time.monotonic()
            if grant in self._acted or waiting:
                return False
            self._acted.add(grant)
            return True

    # --- decide ------------------------------------------------------------------------------
    def _judge(self, sample: Sample, managed: dict[str, Managed]) -> list[Verdict]:
        verdicts = []
        for grant, per_gpu in sample.usage.items():
            container = managed.get(grant)
            if container is None:
                continue
            for gpu, used in per_gpu.items():
                pids = sample.pids.get(grant, {}).get(gpu, [])
                if gpu not in container.gpus and used > 0:
                    verdicts.append(Verdict(grant, REASON_NOT_GRANTED, gpu, used, 0, pids))
                elif used > container.limit + self.settings.tolerance:
                    verdicts.append(Verdict(grant, REASON_EXCEEDED, gpu, used, container.limit, pids))
        return verdicts

    def _remember_room(self, sample: Sample, managed: dict[str, Managed]) -> None:
        """For each GPU: used bytes now, and the least growth that could push a container over."""
        self._baseline = {g.uuid: g.memory_used for g in sample.gpus}
        room: dict[str, int] = {}
        for container in managed.values():
            for gpu in container.gpus:
                used = sample.usage.get(container.grant, {}).get(gpu, 0)
                left = max(0, container.limit + self.settings.tolerance - used)
                room[gpu] = min(room.get(gpu, left), left)
        self._room = room

    def _grew_past_room(self) -> bool:
        """Cheap check: did any GPU's used memory grow by more than its tightest container's room, or fall?

        A fall triggers a full sample too: the bytes a killed (or shrinking) process gave back would
        otherwise hide a neighbour's growth past its grant from every later poll until the regular
        sample, since the baseline is only reset by a full sample. It costs one full sample per fall.
        """
        memory = self.source.memory_poll()
        for device in self.devices:
            base = self._baseline.get(device.uuid)
            if base is None:
                return True
            grown = memory[device.uuid] - base
            if grown < 0 or (grown > 0 and (grown > self._room.get(device.uuid, 0) or device.uuid not in self._room)):
                return True
        return False

    # --- act ---------------------------------------------------------------------------------
    def _act_logged(self, container: Managed, verdict: Verdict) -> None:
        """``_act`` on a worker, whose exceptions would otherwise vanish into its future."""
        try:
            self._act(container, verdict)
        except Exception:  # the grant stays claimed: as before, no second attempt on a failed report
            log.exception("acting on the overrun of %s failed", container.grant)

    def _act(self, container: Managed, verdict: Verdict) -> None:
        """Re-check, report and act on one container (on a worker thread; the caller claimed its grant)."""
        if not still_theirs(self.runtime, container.grant, verdict.pids):
            log.info("overrun of %s not confirmed: its processes are gone or reused", container.grant)
            with self._acting:
                self._acted.discard(container.grant)
            return
        detail = {"reason": verdict.reason, "gpu": verdict.gpu, "observed": verdict.observed,
                  "grant_bytes": verdict.limit, "action": container.on_overrun, "at": time.time(),
                  "pids": [pid for pid, _ in verdict.pids]}
        log.warning("container %s (%s) uses %d bytes on %s over its %d: %s", container.container_id[:12],
                    container.grant, verdict.observed, verdict.gpu, verdict.limit, container.on_overrun)
        # tell the manager first, so the overrun is on record before the exit is
        self._on_overrun(container, detail)
        try:
            if container.on_overrun == "kill":
                self.runtime.kill(container.grant, verdict.reason, detail)
            elif container.on_overrun == "stop":
                self.runtime.stop(container.grant, verdict.reason, detail, self.settings.stop_grace)
        except Exception as exc:  # the engine refused: say so, and try again after a growing pause
            self._retry_later(container, detail, exc)
        else:
            with self._acting:
                self._backoff.pop(container.grant, None)

    def _retry_later(self, container: Managed, detail: dict[str, Any], exc: Exception) -> None:
        with self._acting:
            self._acted.discard(container.grant)
            delay = self._backoff.get(container.grant, (0.0, defaults.KILL_RETRY_MIN))[1]
            self._backoff[container.grant] = (time.monotonic() + delay, min(delay * 2, defaults.KILL_RETRY_MAX))
        log.warning("could not %s %s (%s); trying again in %gs", container.on_overrun, container.container_id[:12],
                    exc, delay)
        self._on_overrun(container, {**detail, "kill_failed": str(exc), "retry_in": delay})
