"""Simulated GPUs that look like NVML to the rest of the agent.

Simulated usage is a user-facing contract: a process whose environment holds
``GPUMGR_SIM_USAGE_FILE=<path>`` uses as many bytes as the integer written in that file, read inside
the process's own filesystem (``/proc/<pid>/root/<path>``, so it works in containers). It uses the
first GPU it can see (``NVIDIA_VISIBLE_DEVICES``, else ``CUDA_VISIBLE_DEVICES``, else index 0); a
comma list of numbers charges each visible GPU in order. Processes sharing one file count once.
As on NVML, a process that has ended uses nothing from that moment (its file may still be there),
where the agent sees processes in its own PID namespace (else from the next process snapshot).
"""

from __future__ import annotations

import os
import re
import select
import stat
import threading
import time
import uuid as uuidlib
from dataclasses import dataclass, replace

from gpumgr.agent import procmap
from gpumgr.agent.gpus.source import SIM_PREFIX, Device, GpuProcess
from gpumgr.wire import defaults
from gpumgr.wire.constraints import version
from gpumgr.wire.names import Env
from gpumgr.wire.units import parse_bytes

SIM_DEFAULT_NAME = "Simulated GPU"
#: Fixed forever: changing it would change every simulated uuid and orphan running containers.
SIM_UUID_NAMESPACE = uuidlib.UUID("24337672-0429-437a-999e-b20b898986ec")
#: A guard against typos such as ``100000x8GiB``, not a limit of the simulator.
SIM_ITEM = re.compile(r"(\d+)\s*[xX]\s*(.+)")

#: Topology options of a spec, best link first: ``(link, option)``.
SIM_LINK_OPTIONS = (("nvlink", "nvlink"), ("pcie_switch", "switch"), ("socket", "socket"))
SIM_OPTIONS = frozenset({"nvlink", "switch", "socket", "health"})
#: Why a GPU listed in the health file without a reason is unhealthy.
SIM_HEALTH_REASON = "marked unhealthy in the simulation's health file"

SIM_USAGE_ENV = Env.SIM_USAGE_FILE
NVIDIA_VISIBLE_ENV = Env.NVIDIA_VISIBLE_DEVICES
CUDA_VISIBLE_ENV = Env.CUDA_VISIBLE_DEVICES
SIM_ENV_NAMES = frozenset({SIM_USAGE_ENV, NVIDIA_VISIBLE_ENV, CUDA_VISIBLE_ENV})
#: What a process sees when neither variable is set, as CUDA does.
DEFAULT_VISIBLE = "0"
VISIBLE_ALL = "all"
#: ``NVIDIA_VISIBLE_DEVICES`` values with which the NVIDIA runtime exposes no GPU.
VISIBLE_NONE = frozenset({"none", "void"})
#: For this long after a process is first seen, every sample re-reads its environment: runc (and
#: shells) exec the real program right after starting, which changes its environment under the same PID.
SETTLE_SECONDS = defaults.SIM_SETTLE
#: Every this many seconds a process snapshot re-identifies every host PID, not only new, young and
#: simulated ones, so that a long-running process that execs into a simulated one is noticed.
REIDENTIFY_SECONDS = defaults.SIM_REIDENTIFY


def parse_sim_spec(spec: str, seed: str) -> list[Device]:
    """Return the simulated GPUs described by ``spec``, e.g. ``2x24GiB`` or ``1x8GiB,4x80GiB:H100@9.0;nvlink=4``.

    Items are ``COUNTxSIZE[:NAME][@CC]`` separated by commas (a leading ``sim:`` is allowed); indexes
    count up from 0 across items. Options follow, each after a ``;``: ``nvlink=N``, ``switch=N`` and
    ``socket=N`` join consecutive blocks of ``N`` GPUs by NVLink, under one PCIe switch, on one CPU
    socket (any of them gives the node a topology: GPUs in no common block are joined across sockets);
    ``health=PATH`` names the health file (see :meth:`SimSource.health`). Uuids depend only on
    ``seed`` and the index, so an agent keeps them across restarts and agents with different seeds
    never share one. Raises ``ValueError``.
    """
    body, options = _split_options(spec)
    if not body.strip():
        raise ValueError("the simulated GPU spec is empty; write e.g. 'sim:2x24GiB'")
    devices: list[Device] = []
    for item in body.split(","):
        count, size, name, capability = _parse_sim_item(item)
        if len(devices) + count > defaults.MAX_SIM_DEVICES:
            limit = defaults.MAX_SIM_DEVICES
            raise ValueError(f"a simulated GPU spec may name at most {limit} GPUs, {spec!r} names more")
        devices.extend(Device(sim_uuid(seed, i), i, name, size, capability)
                       for i in range(len(devices), len(devices) + count))
    blocks = {link: int(options[key]) for link, key in SIM_LINK_OPTIONS if key in options}
    if blocks:
        if len(devices) > defaults.MAX_TOPOLOGY_GPUS:
            raise ValueError(f"a simulated topology may join at most {defaults.MAX_TOPOLOGY_GPUS} GPUs")
        devices = [replace(d, links=tuple((o.uuid, _sim_link(d.index, o.index, blocks)) for o in devices if o is not d))
                   for d in devices]
    return devices


def sim_health_path(spec: str) -> str | None:
    """The health file a simulated spec names (``;health=PATH``), if any."""
    return _split_options(spec)[1].get("health")


def _split_options(spec: str) -> tuple[str, dict[str, str]]:
    body = spec.strip()
    if body.lower().startswith(SIM_PREFIX):
        body = body[len(SIM_PREFIX):]
    body, *rest = body.split(";")
    options: dict[str, str] = {}
    for option in rest:
        key, eq, value = option.partition("=")
        key, value = key.strip().lower(), value.strip()
        if not eq or key not in SIM_OPTIONS or not value:
            raise ValueError(f"cannot read option {option.strip()!r} of a GPU spec; options are "
                             "nvlink=N, switch=N, socket=N and health=PATH")
        if key != "health" and not (value.isascii() and value.isdigit() and int(value) >= 1):
            raise ValueError(f"option {key} of a GPU spec takes a number of GPUs of at least 1, not {value!r}")
        options[key] = value
    return body, options


def _sim_link(first: int, second: int, blocks: dict[str, int]) -> str:
    """The best link whose block holds both indexes; ``system`` when none does."""
    for link, size in blocks.items():
        if first // size == second // size:
            return link
    return "system"


def sim_uuid(seed: str, index: int) -> str:
    """The stable uuid of simulated GPU ``index`` of the agent seeded with ``seed``."""
    return "GPU-" + str(uuidlib.uuid5(SIM_UUID_NAMESPACE, f"{seed}/{index}"))


def _parse_sim_item(item: str) -> tuple[int, int, str, str]:
    head, colon, name = item.partition(":")
    name = name.strip() if colon else SIM_DEFAULT_NAME
    name, at, capability = name.rpartition("@") if "@" in name else (name, "", "")
    name = name.strip() or (SIM_DEFAULT_NAME if at else "")
    match = SIM_ITEM.fullmatch(head.strip())
    if match is None or not name:
        raise ValueError(f"cannot read {item.strip()!r} in a GPU spec; write COUNTxSIZE[:NAME][@CC], "
                         "e.g. '4x80GiB:H100@9.0'")
    if at and version(capability) is None:
        raise ValueError(f"bad compute capability in {item.strip()!r}: write it like 8.0 or 9.0")
    count = int(match[1])
    if count < 1:
        raise ValueError(f"{item.strip()!r} asks for no GPU; the count must be at least 1")
    try:
        return count, parse_bytes(match[2].strip()), name, capability.strip()
    except ValueError as exc:
        raise ValueError(f"bad GPU size in {item.strip()!r}: {exc}") from exc


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
    #: a pidfd of the process (readable once it has ended), where the agent shares its PID namespace
    pidfd: int | None = None


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

    def __init__(self, devices: list[Device], proc: str | None = None, health_file: str | None = None) -> None:
        self._health_file = health_file
        self._health_seen: tuple[tuple[int, int], dict[str, str]] | None = None
        self._devices = sorted(devices, key=lambda d: d.index)
        self._uuids = frozenset(d.uuid for d in devices)
        self._by_name = {d.uuid: d.uuid for d in devices} | {str(d.index): d.uuid for d in devices}
        self._proc = proc or procmap.root()
        self._lock = threading.Lock()
        self._known: dict[int, _SimProcess] = {}
        #: simulated PIDs in ascending order: the lowest of several sharing one file is charged
        self._simulated: list[int] = []
        self._files: dict[int, _UsageFile] = {}
        #: the held pidfds, polled at once to learn which simulated processes have ended
        self._exits = select.poll()
        self._pid_of: dict[int, int] = {}
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

    def health(self) -> dict[str, str]:
        """Why each GPU is unhealthy, from the spec's health file: ``INDEX-or-UUID [REASON]`` a line.

        A GPU the file does not list (or no file) is healthy; ``#`` starts a comment. The file is read
        again only when its size or modification time changed.
        """
        healthy = {d.uuid: "" for d in self._devices}
        if self._health_file is None:
            return healthy
        try:
            info = os.stat(self._health_file)
            key = (info.st_mtime_ns, info.st_size)
            if self._health_seen is None or self._health_seen[0] != key:
                with open(self._health_file, encoding="utf-8", errors="replace") as handle:
                    self._health_seen = (key, self._read_health(handle.read(defaults.MAX_USAGE_FILE_BYTES)))
        except OSError:  # no file: every GPU is healthy
            self._health_seen = None
            return healthy
        return healthy | self._health_seen[1]

    def _read_health(self, text: str) -> dict[str, str]:
        marked = {}
        for line in text.splitlines():
            name, _, reason = line.split("#", 1)[0].strip().partition(" ")
            uuid = self._by_name.get(name)
            if uuid is not None:
                marked[uuid] = reason.strip()[:256] or SIM_HEALTH_REASON
        return marked

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
        ended = {self._pid_of[fd] for fd, _ in self._exits.poll(0)} if self._pid_of else set()
        for pid in self._simulated:
            if pid in ended:
                continue
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
            data = os.pread(held.fd, defaults.MAX_USAGE_FILE_BYTES + 1, 0)
        except OSError:
            self._forget_file(pid)
            return []
        return parse_usage(data) if len(data) <= defaults.MAX_USAGE_FILE_BYTES else []

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
        held = self._files[pid] = _UsageFile(fd, (info.st_dev, info.st_ino), self._pidfd(pid))
        return held

    def _pidfd(self, pid: int) -> int | None:
        """A pidfd of ``pid`` to learn when it ends, or None where PIDs are not ours (another ``proc``)."""
        if os.path.realpath(self._proc) != procmap.PROC:
            return None
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:  # gone already, or a kernel without pidfds: counted until the next snapshot
            return None
        self._exits.register(pidfd, select.POLLIN)
        self._pid_of[pidfd] = pid
        return pidfd

    def _forget_file(self, pid: int) -> None:
        held = self._files.pop(pid, None)
        if held is not None:
            os.close(held.fd)
            if held.pidfd is not None:
                self._exits.unregister(held.pidfd)
                del self._pid_of[held.pidfd]
                os.close(held.pidfd)


def parse_usage(data: bytes) -> list[int]:
    """The comma-separated byte counts in a usage file; ``[]`` unless every entry is a whole number."""
    if data.strip().isdigit():  # the common case: one number
        return [min(int(data), defaults.MAX_BYTES)]
    parts = [part.strip() for part in data.split(b",")]
    if not all(part.isdigit() for part in parts):
        return []
    return [min(int(part), defaults.MAX_BYTES) for part in parts]


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
