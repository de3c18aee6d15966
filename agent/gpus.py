"""Where the agent learns about its GPUs: NVML on a real machine, or a simulator anywhere else.

Both sources answer the same three questions (which GPUs, how full, which processes), so the rest
of the agent cannot tell a real GPU from a simulated one and the whole system runs in CI.

Simulated usage is a user-facing contract: a process whose environment holds
``GPUMGR_SIM_USAGE_FILE=<path>`` uses as many bytes as the integer written in that file, read inside
the process's own filesystem (``/proc/<pid>/root/<path>``, so it works in containers). It uses the
first GPU it can see (``NVIDIA_VISIBLE_DEVICES``, else ``CUDA_VISIBLE_DEVICES``, else index 0); a
comma list of numbers charges each visible GPU in order. Processes sharing one file count once.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import threading
import time
import uuid as uuidlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import pynvml

from gpumgr.agent import procmap
from gpumgr.wire import defaults
from gpumgr.wire.units import parse_bytes

SIM_PREFIX = "sim:"
SIM_DEFAULT_NAME = "Simulated GPU"
#: Fixed forever: changing it would change every simulated uuid and orphan running containers.
SIM_UUID_NAMESPACE = uuidlib.UUID("24337672-0429-437a-999e-b20b898986ec")
#: A guard against typos such as ``100000x8GiB``, not a limit of the simulator.
MAX_SIM_DEVICES = 1024
SIM_ITEM = re.compile(r"(\d+)\s*[xX]\s*(.+)")

SIM_USAGE_ENV = "GPUMGR_SIM_USAGE_FILE"
NVIDIA_VISIBLE_ENV = "NVIDIA_VISIBLE_DEVICES"
CUDA_VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"
SIM_ENV_NAMES = frozenset({SIM_USAGE_ENV, NVIDIA_VISIBLE_ENV, CUDA_VISIBLE_ENV})
#: What a process sees when neither variable is set, as CUDA does.
DEFAULT_VISIBLE = "0"
VISIBLE_ALL = "all"
#: ``NVIDIA_VISIBLE_DEVICES`` values with which the NVIDIA runtime exposes no GPU.
VISIBLE_NONE = frozenset({"none", "void"})
#: A usage file holds a few numbers; reading more would only let a process make us allocate.
MAX_USAGE_FILE_BYTES = 4096
#: For this long after a process is first seen, every sample re-reads its environment: runc (and
#: shells) exec the real program right after starting, which changes its environment under the same PID.
SETTLE_SECONDS = 2.0
#: Every this many seconds a process snapshot re-identifies every host PID, not only new, young and
#: simulated ones, so that a long-running process that execs into a simulated one is noticed.
REIDENTIFY_SECONDS = 5.0

NVML_COMPUTE_QUERIES = ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetComputeRunningProcesses_v2")
NVML_MPS_QUERIES = ("nvmlDeviceGetMPSComputeRunningProcesses", "nvmlDeviceGetMPSComputeRunningProcesses_v2")
#: NVML's "not available" marker for per-process memory (older bindings pass it through raw).
NVML_VALUE_NOT_AVAILABLE = 2**64 - 1


class GpuSourceError(RuntimeError):
    """A GPU source could not answer, e.g. NVML lost a GPU; the caller should retry or report it."""


class NvmlUnavailable(GpuSourceError):
    """NVML was asked for but no NVIDIA driver answers, or it reports no GPU; use ``sim:SPEC`` instead."""


@dataclass(frozen=True)
class Device:
    """One GPU as the agent reports it; ``memory_total`` is in bytes."""

    uuid: str
    index: int
    name: str
    memory_total: int


@dataclass(frozen=True)
class GpuProcess:
    """A host PID and the bytes it uses on one GPU."""

    pid: int
    used: int


class GpuSource(Protocol):
    """What the agent needs from GPUs. ``kind`` is ``"nvml"`` or ``"sim"``.

    ``memory_used`` is cheap and polled often; ``processes`` may be expensive and is polled less.
    Both raise ``KeyError`` for a uuid the source does not have; NVML failures raise
    ``GpuSourceError``.
    """

    kind: str

    def devices(self) -> list[Device]:
        """The GPUs of this source, fixed when it was opened, in index order."""
        ...

    def memory_used(self, uuid: str) -> int:
        """Bytes in use on GPU ``uuid`` right now."""
        ...

    def processes(self, uuid: str) -> list[GpuProcess]:
        """Processes using GPU ``uuid`` right now, by host PID."""
        ...

    def memory_snapshot(self) -> dict[str, int]:
        """``memory_used`` of every GPU in one go, exact as of now."""
        ...

    def memory_poll(self) -> dict[str, int]:
        """Like ``memory_snapshot`` but as cheap as the source can make it: the enforcer's frequent poll.

        It may miss processes that started since the last ``process_snapshot`` and count ones that
        ended since; the enforcer only uses it to decide when to take the next full sample.
        """
        ...

    def process_snapshot(self) -> dict[str, list[GpuProcess]]:
        """``processes`` of every GPU in one go: the full sample."""
        ...

    def close(self) -> None:
        """Release what the source holds; it must not be used afterwards."""
        ...


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
            return NvmlSource()
        except NvmlUnavailable:
            return open_source(defaults.SIM_SPEC, seed)
    if choice.lower() == "nvml":
        return NvmlSource()
    if choice.lower().startswith(SIM_PREFIX):
        return SimSource(parse_sim_spec(choice, seed))
    raise ValueError(f"--gpus must be 'auto', 'nvml' or 'sim:SPEC' such as 'sim:2x24GiB', not {gpus!r}")


def parse_sim_spec(spec: str, seed: str) -> list[Device]:
    """Return the simulated GPUs described by ``spec``, e.g. ``2x24GiB`` or ``1x8GiB,4x80GiB:H100``.

    Items are ``COUNTxSIZE[:NAME]`` separated by commas (a leading ``sim:`` is allowed); indexes
    count up from 0 across items. Uuids depend only on ``seed`` and the index, so an agent keeps
    them across restarts and agents with different seeds never share one. Raises ``ValueError``.
    """
    body = spec.strip()
    if body.lower().startswith(SIM_PREFIX):
        body = body[len(SIM_PREFIX):]
    if not body.strip():
        raise ValueError("the simulated GPU spec is empty; write e.g. 'sim:2x24GiB'")
    devices: list[Device] = []
    for item in body.split(","):
        count, size, name = _parse_sim_item(item)
        if len(devices) + count > MAX_SIM_DEVICES:
            raise ValueError(f"a simulated GPU spec may name at most {MAX_SIM_DEVICES} GPUs, {spec!r} names more")
        devices.extend(Device(sim_uuid(seed, i), i, name, size) for i in range(len(devices), len(devices) + count))
    return devices


def sim_uuid(seed: str, index: int) -> str:
    """The stable uuid of simulated GPU ``index`` of the agent seeded with ``seed``."""
    return "GPU-" + str(uuidlib.uuid5(SIM_UUID_NAMESPACE, f"{seed}/{index}"))


def _parse_sim_item(item: str) -> tuple[int, int, str]:
    head, colon, name = item.partition(":")
    name = name.strip() if colon else SIM_DEFAULT_NAME
    match = SIM_ITEM.fullmatch(head.strip())
    if match is None or not name:
        raise ValueError(f"cannot read {item.strip()!r} in a GPU spec; write COUNTxSIZE[:NAME], e.g. '4x80GiB:H100'")
    count = int(match[1])
    if count < 1:
        raise ValueError(f"{item.strip()!r} asks for no GPU; the count must be at least 1")
    try:
        return count, parse_bytes(match[2].strip()), name
    except ValueError as exc:
        raise ValueError(f"bad GPU size in {item.strip()!r}: {exc}") from exc


class NvmlSource:
    """Real GPUs through NVML. Raises ``NvmlUnavailable`` when no driver answers or it sees no GPU.

    ``nvml`` is the binding module (``pynvml``); it is a parameter so the logic can be tested
    without a GPU.
    """

    kind = "nvml"

    def __init__(self, nvml: Any = None) -> None:
        self._nvml = pynvml if nvml is None else nvml
        try:
            self._nvml.nvmlInit()
        except self._nvml.NVMLError as exc:
            raise NvmlUnavailable(f"no NVIDIA driver answers through NVML ({exc}); use --gpus sim:SPEC") from exc
        self._open = True
        try:
            self._handles, self._devices = self._discover()
        except BaseException:
            self.close()
            raise

    def devices(self) -> list[Device]:
        """The GPUs NVML reported when the source was opened."""
        return list(self._devices)

    def memory_used(self, uuid: str) -> int:
        """Device-level used bytes, including memory no listed process accounts for."""
        handle = self._handles[uuid]
        with self._guard(f"a query of GPU {uuid}"):
            return int(self._nvml.nvmlDeviceGetMemoryInfo(handle).used)

    def processes(self, uuid: str) -> list[GpuProcess]:
        """Compute processes and MPS clients on ``uuid``, merged by PID keeping the larger figure.

        A PID NVML lists twice (e.g. in both lists) is counted once; memory NVML cannot attribute
        (``None``) counts as 0.
        """
        handle = self._handles[uuid]
        merged: dict[int, int] = {}
        for entry in self._query(NVML_COMPUTE_QUERIES, handle, uuid) + self._query_mps(handle, uuid):
            merged[entry.pid] = max(merged.get(entry.pid, 0), _nvml_bytes(entry.usedGpuMemory))
        return [GpuProcess(pid, used) for pid, used in sorted(merged.items())]

    def memory_snapshot(self) -> dict[str, int]:
        """Used bytes of every GPU (one cheap memory query each)."""
        return {d.uuid: self.memory_used(d.uuid) for d in self._devices}

    def memory_poll(self) -> dict[str, int]:
        """The same as ``memory_snapshot``: NVML's memory query already is the cheap one."""
        return self.memory_snapshot()

    def process_snapshot(self) -> dict[str, list[GpuProcess]]:
        """Processes of every GPU (the expensive per-process queries)."""
        return {d.uuid: self.processes(d.uuid) for d in self._devices}

    def close(self) -> None:
        """Shut NVML down once; later calls do nothing."""
        if self._open:
            self._open = False
            with contextlib.suppress(self._nvml.NVMLError):
                self._nvml.nvmlShutdown()

    def _discover(self) -> tuple[dict[str, Any], list[Device]]:
        with self._guard("device discovery"):
            count = self._nvml.nvmlDeviceGetCount()
            if count == 0:
                raise NvmlUnavailable("the NVIDIA driver answers but reports no GPU; use --gpus sim:SPEC")
            handles = [self._nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            devices = [self._describe(i, handle) for i, handle in enumerate(handles)]
        return {d.uuid: h for d, h in zip(devices, handles, strict=True)}, devices

    def _describe(self, index: int, handle: Any) -> Device:
        uuid = _text(self._nvml.nvmlDeviceGetUUID(handle))
        name = _text(self._nvml.nvmlDeviceGetName(handle))
        return Device(uuid, index, name, int(self._nvml.nvmlDeviceGetMemoryInfo(handle).total))

    def _query(self, names: tuple[str, ...], handle: Any, uuid: str) -> list[Any]:
        """Call the newest of ``names`` this driver has; older drivers lack the newer entry points."""
        missing = _missing_function_errors(self._nvml)
        for name in names:
            call: Callable[[Any], list[Any]] | None = getattr(self._nvml, name, None)
            if call is None:
                continue
            with self._guard(f"a query of GPU {uuid}"):
                try:
                    return list(call(handle))
                except missing:
                    continue
        return []

    def _query_mps(self, handle: Any, uuid: str) -> list[Any]:
        # Many GPUs and drivers answer "not supported" for MPS; that only means there are no clients.
        try:
            return self._query(NVML_MPS_QUERIES, handle, uuid)
        except GpuSourceError:
            return []

    @contextlib.contextmanager
    def _guard(self, what: str) -> Iterator[None]:
        try:
            yield
        except self._nvml.NVMLError as exc:
            raise GpuSourceError(f"NVML failed during {what}: {exc}") from exc


def _missing_function_errors(nvml: Any) -> tuple[type[BaseException], ...]:
    names = ("NVMLError_FunctionNotFound", "NVMLLibraryMismatchError")
    return tuple(error for name in names if isinstance(error := getattr(nvml, name, None), type))


def _nvml_bytes(value: int | None) -> int:
    return 0 if value is None or value >= NVML_VALUE_NOT_AVAILABLE else int(value)


def _text(value: str | bytes) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


@dataclass(frozen=True)
class _SimProcess:
    """What one process's environment says, parsed once per process identity."""

    identity: tuple[int, str, int]
    usage_path: str | None
    visible: tuple[str, ...]
    seen_at: float = 0.0

    def trusted(self, now: float) -> bool:
        """Whether a snapshot may keep this entry without re-reading the process's ``stat``.

        Simulated processes are always re-identified (their PID being reused by another process
        must never charge the newcomer); others once they are past the age at which they exec.
        """
        return self.usage_path is None and now - self.seen_at > SETTLE_SECONDS


@dataclass
class _UsageFile:
    """A simulated process's usage file, held open so a poll is one ``fstat`` and one ``pread``."""

    fd: int
    key: tuple[int, int]


class SimSource:
    """Simulated GPUs whose usage is whatever simulated processes declare (see the module docstring).

    A process snapshot lists ``proc`` and re-reads the ``stat`` of new, young and simulated
    processes (of every process every ``REIDENTIFY_SECONDS``), parsing the environment only of those
    it has not seen in that identity. Usage files are opened once and re-read with ``pread``; a
    snapshot opens again one that was replaced by rename (its link count dropped to 0).
    ``memory_poll`` only re-reads the files the last snapshot held, without listing ``proc`` or
    checking for replacement: that is the enforcer's frequent poll, and what makes it cheap.
    Thread-safe. ``proc`` is a parameter so tests can show it a chosen view.
    """

    kind = "sim"

    def __init__(self, devices: list[Device], proc: str | None = None) -> None:
        self._devices = sorted(devices, key=lambda d: d.index)
        self._uuids = frozenset(d.uuid for d in devices)
        self._by_name = {d.uuid: d.uuid for d in devices} | {str(d.index): d.uuid for d in devices}
        self._proc = proc or procmap.root()
        self._lock = threading.Lock()
        self._known: dict[int, _SimProcess] = {}
        #: simulated PIDs in ascending order: the lowest of several sharing one file is charged
        self._simulated: list[int] = []
        self._files: dict[int, _UsageFile] = {}
        self._identified_all_at = -REIDENTIFY_SECONDS

    def devices(self) -> list[Device]:
        """The simulated GPUs, in index order."""
        return list(self._devices)

    def memory_used(self, uuid: str) -> int:
        """Sum of what the simulated processes on ``uuid`` declare."""
        self._check(uuid)
        return self.memory_snapshot()[uuid]

    def processes(self, uuid: str) -> list[GpuProcess]:
        """Simulated processes with a non-zero share of ``uuid``; sharers of one file appear once."""
        self._check(uuid)
        return self.process_snapshot()[uuid]

    def memory_snapshot(self) -> dict[str, int]:
        """Used bytes per GPU, processes started since the last call included."""
        with self._lock:
            self._refresh()
            usage = self._read_usage()
        return self._totals(usage)

    def memory_poll(self) -> dict[str, int]:
        """Used bytes per GPU by the processes the last snapshot found, from the files it found."""
        with self._lock:
            usage = self._read_usage(fresh=False)
        return self._totals(usage)

    def process_snapshot(self) -> dict[str, list[GpuProcess]]:
        """Simulated processes per GPU; PID reuse and exec are noticed here."""
        with self._lock:
            self._refresh()
            usage = self._read_usage()
        return {d.uuid: [GpuProcess(pid, shares[d.uuid]) for pid, shares in usage.items() if shares.get(d.uuid)]
                for d in self._devices}

    def _check(self, uuid: str) -> None:
        if uuid not in self._uuids:
            raise KeyError(f"no GPU {uuid} in this source")

    def _totals(self, usage: dict[int, dict[str, int]]) -> dict[str, int]:
        totals = dict.fromkeys(self._uuids, 0)
        for shares in usage.values():
            for uuid, used in shares.items():
                totals[uuid] += used
        return totals

    def close(self) -> None:
        """Forget the process cache and close the usage files held open."""
        with self._lock:
            self._known, self._simulated = {}, []
            for pid in list(self._files):
                self._forget_file(pid)

    def _refresh(self) -> None:
        now = time.monotonic()
        everyone = now - self._identified_all_at >= REIDENTIFY_SECONDS
        if everyone:
            self._identified_all_at = now
        known: dict[int, _SimProcess] = {}
        for pid in self._pids():
            cached = self._known.get(pid)
            if not everyone and cached is not None and cached.trusted(now):
                known[pid] = cached
                continue
            identity = procmap.identity_of(pid, self._proc)
            if identity is None:
                continue
            if cached is not None and cached.identity == identity:
                known[pid] = cached
            else:
                known[pid] = self._parse(pid, identity)
                self._forget_file(pid)
        for pid in set(self._files) - known.keys():
            self._forget_file(pid)
        self._known = known
        self._simulated = [pid for pid, p in sorted(known.items()) if p.usage_path is not None and p.visible]

    def _pids(self) -> list[int]:
        with os.scandir(self._proc) as entries:
            return [int(entry.name) for entry in entries if entry.name.isdigit()]

    def _parse(self, pid: int, identity: tuple[int, str, int]) -> _SimProcess:
        env = _sim_environ(os.path.join(self._proc, str(pid), "environ"))
        path = env.get(SIM_USAGE_ENV) or None
        return _SimProcess(identity, path, self._visible(env) if path else (), time.monotonic())

    def _visible(self, env: dict[str, str]) -> tuple[str, ...]:
        """The uuids of this source's GPUs the process sees, in its order; foreign entries dropped."""
        nvidia = env.get(NVIDIA_VISIBLE_ENV, "").strip()
        chosen = nvidia or env.get(CUDA_VISIBLE_ENV, DEFAULT_VISIBLE).strip()
        if chosen.lower() in VISIBLE_NONE:
            return ()
        if chosen.lower() == VISIBLE_ALL:
            return tuple(d.uuid for d in self._devices)
        uuids = (self._by_name.get(entry.strip()) for entry in chosen.split(","))
        return tuple(dict.fromkeys(u for u in uuids if u is not None))

    def _read_usage(self, fresh: bool = True) -> dict[int, dict[str, int]]:
        """Usage per PID and uuid; the lowest PID of several sharing one file is charged once."""
        usage: dict[int, dict[str, int]] = {}
        files_seen: set[tuple[int, int]] = set()
        for pid in self._simulated:
            process = self._known[pid]
            amounts = self._read_file(pid, process, files_seen, fresh)
            if amounts:
                # Numbers beyond the visible GPUs are ignored; GPUs beyond the numbers use nothing.
                usage[pid] = dict(zip(process.visible, amounts, strict=False))
        return usage

    def _resolve(self, pid: int, path: str) -> str:
        if os.path.isabs(path):
            return os.path.join(self._proc, str(pid), "root", path.lstrip("/"))
        return os.path.join(self._proc, str(pid), "cwd", path)

    def _read_file(self, pid: int, process: _SimProcess, files_seen: set[tuple[int, int]], fresh: bool) -> list[int]:
        """The numbers in ``pid``'s usage file, or ``[]`` if it is missing, unreadable, garbage or seen before.

        With ``fresh`` (snapshots), a held file that was replaced or deleted is dropped and the path
        opened again; polls skip that ``fstat``, which costs as much as the read on overlay files.
        """
        held = self._files.get(pid)
        try:
            if fresh and held is not None and os.fstat(held.fd).st_nlink == 0:  # replaced or deleted since
                self._forget_file(pid)
                held = None
            if held is None:
                held = self._open_file(pid, process)
                if held is None:
                    return []
            if held.key in files_seen:
                return []
            files_seen.add(held.key)
            data = os.pread(held.fd, MAX_USAGE_FILE_BYTES + 1, 0)
        except OSError:
            self._forget_file(pid)
            return []
        return parse_usage(data) if len(data) <= MAX_USAGE_FILE_BYTES else []

    def _open_file(self, pid: int, process: _SimProcess) -> _UsageFile | None:
        assert process.usage_path is not None
        try:
            # Non-blocking with a regular-file check, so a FIFO or device planted there cannot hang us.
            fd = os.open(self._resolve(pid, process.usage_path), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            info = os.fstat(fd)
        except OSError:
            os.close(fd)
            return None
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            return None
        held = self._files[pid] = _UsageFile(fd, (info.st_dev, info.st_ino))
        return held

    def _forget_file(self, pid: int) -> None:
        held = self._files.pop(pid, None)
        if held is not None:
            os.close(held.fd)


def parse_usage(data: bytes) -> list[int]:
    """The comma-separated byte counts in a usage file; ``[]`` unless every entry is a whole number."""
    if data.strip().isdigit():  # the common case: one number
        return [int(data)]
    parts = [part.strip() for part in data.split(b",")]
    if not all(part.isdigit() for part in parts):
        return []
    return [int(part) for part in parts]


def _sim_environ(path: str) -> dict[str, str]:
    """The variables of a process's environment the simulator reads; ``{}`` for non-simulated ones."""
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except OSError:  # gone, or not ours to read: both mean "nothing to learn here"
        return {}
    if SIM_USAGE_ENV.encode() + b"=" not in data:
        return {}
    env: dict[str, str] = {}
    for key, _, value in (os.fsdecode(entry).partition("=") for entry in data.split(b"\0")):
        if key in SIM_ENV_NAMES:
            env.setdefault(key, value)  # the first definition wins, as getenv() reads it
    return env
