"""The engine behind each of the guard's plugin connections: its default runtime and data root, from its own files.

The guard starts before dockerd (its unit is ordered so), so it cannot read the engine's settings when
it starts, and it may not ask the engine from inside an authorization request (that call would come
back through the plugin). Instead, the kernel names the process at the other end of each plugin
connection (``SO_PEERCRED``): that is dockerd. Its command line (``/proc/PID/cmdline``: ``--config-file``,
``--default-runtime``, ``--add-runtime``, ``--data-root``) is read once per engine process, its
``daemon.json`` (read through ``/proc/PID/root``, relative paths from its working directory) again
whenever the file's size, time or inode changes: one ``stat`` per create.

dockerd takes a changed ``daemon.json`` only when it reloads, which the guard cannot see. So every
default runtime the guard has read for one engine process counts as possibly in force until that
process ends (or the guard restarts): a default that hands out GPUs by environment keeps creates
that hold no grant denied until then. What cannot be read (no peer, a process gone, a file that is
not JSON) is a problem too, and the guard denies what it would decide.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpumgr.wire.engine import engine_runtime
from gpumgr.wire.engine.engine_runtime import EngineSettings
from gpumgr.wire.engine.gpudev import DefaultRuntime

#: Engine processes remembered at most (one a dockerd start; the oldest are forgotten first).
MAX_ENGINES = 64
MAX_CONFIG_BYTES = 1024 * 1024


class EngineUnknown(Exception):
    """The guard cannot tell how the engine is set up; the message says what it could not read."""


def peer_pid(sock: socket.socket) -> int | None:
    """The pid of the process at the other end of the Unix socket ``sock`` (None if the kernel does not say)."""
    try:
        pid, _, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    except OSError:
        return None
    return pid if pid > 0 else None


@dataclass
class _Engine:
    """One engine process as last read: its flags, where its daemon.json is, and each default seen."""

    start: str
    flags: dict[str, list[str]]
    config: str
    search_path: tuple[str, ...]
    signature: tuple[int, ...] | None = None
    settings: EngineSettings | None = None
    error: str | None = None
    #: every default runtime read for this process → why it may not be used without a grant (None: fine)
    seen: dict[str, str | None] = field(default_factory=dict)
    #: what :meth:`EngineWatch.default` answers, made again only when ``seen`` grows
    view: DefaultRuntime | None = None


class EngineWatch:
    """What the guard knows of each engine process that connects to it, under ``proc`` (``/proc``)."""

    def __init__(self, proc: str = "/proc") -> None:
        self.proc = proc
        self._engines: dict[int, _Engine] = {}
        self._lock = threading.Lock()

    def default(self, pid: int | None) -> DefaultRuntime:
        """The default runtime(s) engine ``pid`` may be using, and why a container with no grant may not."""
        try:
            engine = self._current(pid)
        except EngineUnknown as exc:
            return DefaultRuntime(frozenset(), f"the guard cannot tell the engine's default runtime ({exc})")
        if engine.view is None:
            problems = sorted({problem for problem in engine.seen.values() if problem})
            if len(engine.seen) > 1 and problems:
                problems.append("daemon.json changed while this engine ran, and the guard cannot see whether it "
                                "reloaded (restart dockerd, or gpumgr-guard once dockerd has reloaded)")
            engine.view = DefaultRuntime(frozenset(engine.seen), "; ".join(problems) or None)
        return engine.view

    def connected(self, pid: int | None) -> None:
        """A new connection from ``pid``: forget what was read of an earlier process that had the same pid."""
        if pid is None:
            return
        start = self._start_time(pid)
        with self._lock:
            engine = self._engines.get(pid)
            if engine is not None and engine.start != start:
                del self._engines[pid]

    def settings(self, pid: int | None) -> EngineSettings:
        """Engine ``pid``'s settings as its files say now (its data root for stored records); EngineUnknown if not."""
        engine = self._current(pid)
        if engine.settings is None:
            raise EngineUnknown(engine.error or "its settings could not be read")
        return engine.settings

    def _current(self, pid: int | None) -> _Engine:
        if pid is None:
            raise EngineUnknown("the kernel did not name the process asking")
        with self._lock:
            engine = self._engines.get(pid)
            if engine is None:
                engine = self._engines[pid] = self._first_look(pid)
                while len(self._engines) > MAX_ENGINES:
                    del self._engines[next(iter(self._engines))]
            self._refresh(pid, engine)
        if engine.error is not None:
            raise EngineUnknown(engine.error)
        return engine

    def _first_look(self, pid: int) -> _Engine:
        base = f"{self.proc}/{pid}"
        try:
            argv = [arg.decode(errors="replace") for arg in Path(f"{base}/cmdline").read_bytes().split(b"\0") if arg]
            cwd = os.readlink(f"{base}/cwd")
            environ = Path(f"{base}/environ").read_bytes().split(b"\0")
        except OSError as exc:
            raise EngineUnknown(f"process {pid} cannot be read: {exc.strerror}") from None
        if not argv or "dockerd" not in os.path.basename(argv[0]):
            raise EngineUnknown(f"process {pid} is not dockerd ({argv[0] if argv else 'no command line'})")
        flags = engine_runtime.parse_flags(argv)
        config = os.path.join(cwd, engine_runtime.config_file(flags))
        path = next((entry[5:].decode(errors="replace") for entry in environ if entry.startswith(b"PATH=")), "")
        search = tuple(part for part in path.split(os.pathsep) if part.startswith("/")) or engine_runtime.SEARCH_PATH
        return _Engine(self._start_time(pid), flags, config, search)

    def _start_time(self, pid: int) -> str:
        try:
            return Path(f"{self.proc}/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
        except (OSError, IndexError):
            return ""

    def _refresh(self, pid: int, engine: _Engine) -> None:
        """Read the engine's daemon.json again if it changed since last time."""
        path = f"{self.proc}/{pid}/root{engine.config}"
        try:
            info = os.stat(path)
            signature: tuple[int, ...] | None = (info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)
        except FileNotFoundError:
            signature = None
        except OSError as exc:
            engine.error = f"{engine.config} cannot be read: {exc.strerror}"
            return
        if signature == engine.signature and (engine.settings is not None or engine.error is not None):
            return
        engine.signature = signature
        try:
            engine.settings = engine_runtime.engine_settings(engine.flags, _read_config(path, signature is not None,
                                                                                       engine.config))
        except EngineUnknown as exc:
            engine.settings, engine.error = None, str(exc)
            return
        except ValueError as exc:
            engine.settings, engine.error = None, f"{engine.config}: {exc}"
            return
        engine.error = None
        name = engine.settings.default_runtime
        engine.seen[name] = engine_runtime.gpu_by_env(name, engine.settings.runtimes, engine.search_path)
        engine.view = None


def _read_config(path: str, exists: bool, shown: str) -> dict[str, Any]:
    if not exists:
        return {}  # dockerd starts without its default file, and with none named by flag it ran
    try:
        with open(path, "rb") as handle:
            data = json.loads(handle.read(MAX_CONFIG_BYTES + 1) or b"{}")
    except (OSError, ValueError) as exc:
        raise EngineUnknown(f"{shown} cannot be read as JSON ({exc})") from None
    if not isinstance(data, dict):
        raise EngineUnknown(f"{shown} is not a JSON object")
    return data
