"""Which container or process group a host PID belongs to, read cheaply from ``/proc``.

The enforcer learns GPU usage per host PID (from NVML or the simulator) and must charge it to a
managed container or host process; these helpers answer that with one small file read each.
"""

from __future__ import annotations

import os
import re

PROC = "/proc"
_root = PROC


def set_root(path: str) -> None:
    """Read processes from ``path`` instead of ``/proc``: the host's ``/proc`` mounted into the agent's container.

    Swarm services cannot join the host PID namespace, so a containerised agent sees host PIDs
    (which NVML reports) only through a bind mount of the host's ``/proc``.
    """
    global _root
    _root = path


def root() -> str:
    """Where host processes are read from (``/proc`` unless :func:`set_root` said otherwise)."""
    return _root

#: A full container id as Docker, containerd and CRI-O write it into cgroup paths. The look-arounds
#: keep longer hex runs (and the tail of one) from matching.
CONTAINER_ID = re.compile(r"(?<![0-9a-f])[0-9a-f]{64}(?![0-9a-f])")

#: ``/proc/<pid>/stat`` fields counted from 1, as ``man 5 proc`` numbers them. Fields after the
#: command name start at number 3 (``state``).
STAT_FIRST_FIELD_AFTER_COMM = 3
STAT_START_TIME_FIELD = 22
STAT_START_STACK_FIELD = 28
#: One read takes all of a ``stat`` and most ``cgroup`` files; longer ones take a few.
READ_CHUNK = 4096


def container_ids_of(pid: int, proc: str | None = None) -> list[str]:
    """Return every container id found in ``/proc/<pid>/cgroup``, outermost first, innermost last.

    Works for cgroup v1 (``hierarchy:controllers:path``) and v2 (``0::path``) lines and for the
    cgroupfs and systemd drivers of Docker, containerd and CRI-O, because all of them put the full
    64-hex id somewhere in the path. Nested containers yield several ids; callers try them from the
    end. Returns ``[]`` when the process is gone or is in no container.
    """
    text = _read_text(os.path.join(proc or _root, str(pid), "cgroup"))
    if text is None:
        return []
    ids: dict[str, None] = {}
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        ids.update(dict.fromkeys(CONTAINER_ID.findall(path)))
    return list(ids)


def process_group_of(pid: int) -> int | None:
    """Return the process group id of ``pid``, or ``None`` when the process is gone."""
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return None


def group_members(pgid: int, proc: str | None = None) -> list[int]:
    """Every live process whose process group is ``pgid`` (zombies excluded), read from ``/proc``."""
    folder = proc or _root
    members = []
    for name in os.listdir(folder):
        if not name.isdigit():
            continue
        text = _read_text(os.path.join(folder, name, "stat"))
        if text is None:
            continue
        fields = text.rsplit(")", 1)[-1].split()
        # after the command name: state (field 3), ppid (4), pgrp (5)
        if len(fields) > 2 and fields[0] != "Z" and fields[2] == str(pgid):
            members.append(int(name))
    return members


def start_time_of(pid: int, proc: str | None = None) -> int | None:
    """Return when ``pid`` started, in clock ticks since boot, or ``None`` when it is gone.

    A PID and its start time together name one process for good, so callers use the pair to notice
    that a PID was reused.
    """
    identity = identity_of(pid, proc)
    return None if identity is None else identity[0]


def identity_of(pid: int, proc: str | None = None) -> tuple[int, str, int] | None:
    """Return ``(start time, command name, stack start)`` of ``pid`` from one read of its ``stat``.

    Caches keyed on this triple go stale exactly when they should: the start time changes when the
    PID is reused, and the command name or the (randomised) stack address changes when the process
    execs another program, which may bring a new environment. ``None`` when the process is gone.
    """
    parsed = _stat_of(pid, proc)
    if parsed is None:
        return None
    comm, fields = parsed
    start, stack = _stat_field(fields, STAT_START_TIME_FIELD), _stat_field(fields, STAT_START_STACK_FIELD)
    if start is None:
        return None
    return start, comm, stack or 0


def _stat_of(pid: int, proc: str | None) -> tuple[str, list[str]] | None:
    text = _read_text(os.path.join(proc or _root, str(pid), "stat"))
    if text is None:
        return None
    # The command name may itself hold ")" or spaces; only the last ")" closes it.
    head, sep, tail = text.rpartition(")")
    if not sep:
        return None
    return head.partition("(")[2], tail.split()


def _stat_field(fields: list[str], number: int) -> int | None:
    index = number - STAT_FIRST_FIELD_AFTER_COMM
    if index >= len(fields) or not fields[index].isdigit():
        return None
    return int(fields[index])


def _read_text(path: str) -> str | None:
    """The whole small ``/proc`` file at ``path``; raw ``os`` calls, since this runs hundreds of times a second."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # gone, or not ours to read: both mean "nothing to learn here"
        return None
    try:
        chunks = []
        while chunk := os.read(fd, READ_CHUNK):
            chunks.append(chunk)
    except OSError:  # the process went away between open and read
        return None
    finally:
        os.close(fd)
    return b"".join(chunks).decode("utf-8", "replace")
