"""The agent's pipe for the shell launcher: a Swarm task's grant asked for without starting Python.

``gpumgr-runtime`` is a ``sh`` script in front of runc. Through the hook socket
(:mod:`gpumgr.agent.hook.hooklink`) every GPU task's ``create`` started a Python, imported the hook and
the envelope, and only then asked this agent; on a node creating ten replicas at once that start-up
was most of what a GPU task cost over a plain one. A shell can reach a named pipe with no program
of its own, so the launcher asks here first, and the agent, already running, does what the Python
hook did: it reads the bundle, gets the grant, pins the bundle and says which runtime to run.

**The exchange.** Next to the hook socket (``agent.sock``) the agent keeps ``agent.fifo`` (mode
0600 in the root-only folder: whoever may create containers may ask) and ``agent.pid``. For one
``create`` the launcher:

1. makes its own reply pipe ``agent.r.PID`` in that folder and opens it read-write (so that opening
   it never waits), and read-only;
2. writes one line, ``REPLY BUNDLE CONTAINER-ID``, to ``agent.fifo`` (a line is under ``PIPE_BUF``,
   so lines of launchers writing at once never mix);
3. reads ``wait`` (the agent opened the reply pipe and removed its name), closes its own write end,
   and reads the answer: ``ok`` (the bundle is pinned: run the GPU runtime), ``plain`` (nothing to
   pin: run the plain runtime), ``python`` (the agent cannot read this bundle: let the Python hook
   try, as before) or ``err JSON`` (the runc log line that says why the create is refused). Once it
   has closed its write end, the agent holds the only one, so an agent that dies mid-request is an
   end of file at once, never a wait.

The launcher falls back to the Python hook when there is no pipe or no live agent behind it.
Whatever the line says, the grant still comes from what the engine recorded for the container
(:meth:`DockerRuntime.engine_request`), never from the line or the bundle.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

from gpumgr.agent import procmap
from gpumgr.wire.engine import hookpipe
from gpumgr.wire.engine.bundle import runc_log_line
from gpumgr.wire.engine.hookpipe import fifo_path, pid_path, reply_prefix

log = logging.getLogger(__name__)

#: A request line is two paths and a container id; one longer than this is not a launcher's.
MAX_LINE = 4096
#: Requests read from the pipe waiting for their answer at once; more are answered ``python`` (the socket).
MAX_PENDING = 256
CONTAINER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
READ_SIZE = 64 * 1024


@dataclass(eq=False)
class FifoRequest:
    """One launcher waiting on its reply pipe for the answer to one ``create``."""

    reply: int
    bundle: str
    container_id: str
    #: Set by the one answer: the descriptor is closed then, and its number may already be another file's.
    answered: bool = False


class HookFifo:
    """The request pipe: reads launchers' lines without blocking and answers each on its reply pipe."""

    def __init__(self, socket_path: str) -> None:
        self.path = fifo_path(socket_path)
        self.pid_file = pid_path(socket_path)
        self.folder = self.path.parent
        prefix = reply_prefix(socket_path).name
        self._reply_name = re.compile(re.escape(prefix) + r"[0-9]{1,10}")
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        for stale in self.folder.glob(prefix + "*"):
            stale.unlink(missing_ok=True)  # left by launchers of an agent that died
        self.path.unlink(missing_ok=True)
        os.mkfifo(self.path, 0o600)
        # read-write: the pipe always has a writer (this one), so a launcher closing it is no end of file
        self.fd = os.open(self.path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        self._buffer = bytearray()
        self.pending: dict[int, FifoRequest] = {}
        self._answering = threading.Lock()  # answers come from the link's thread and the agent's pool
        tmp = self.pid_file.with_name(self.pid_file.name + ".tmp")
        tmp.write_text(f"{host_pid()}\n")
        os.replace(tmp, self.pid_file)

    def fileno(self) -> int:
        """The descriptor the poller watches."""
        return self.fd

    def ready(self) -> list[FifoRequest]:
        """Read every whole line there is; the requests among them, each already told to ``wait``."""
        while True:
            try:
                chunk = os.read(self.fd, READ_SIZE)
            except (BlockingIOError, InterruptedError):
                break
            if not chunk:
                break
            self._buffer += chunk
        *lines, rest = bytes(self._buffer).split(b"\n")
        if len(rest) > MAX_LINE:
            log.warning("dropped %d bytes on the runtime hook's pipe without a line's end", len(rest))
            rest = b""
        self._buffer = bytearray(rest)
        return [request for line in lines if (request := self._accept(line)) is not None]

    def answer(self, request: FifoRequest, line: str) -> None:
        """Send the one-line answer and close; a launcher that gave up is not an error. Only the first counts."""
        with self._answering:
            if request.answered:
                return
            request.answered = True
            self.pending.pop(request.reply, None)
        with contextlib.suppress(OSError):
            os.write(request.reply, line.encode() + b"\n")
        with contextlib.suppress(OSError):
            os.close(request.reply)

    def refuse(self, request: FifoRequest, message: str) -> None:
        """Answer with the runc log line that fails this ``create`` with ``message``."""
        self.answer(request, f"{hookpipe.ERROR} {runc_log_line(message)}")

    def close(self) -> None:
        """Stop serving: unanswered launchers see their pipe end; the pipe and the PID file are removed."""
        with self._answering:
            for request in self.pending.values():
                request.answered = True
                with contextlib.suppress(OSError):
                    os.close(request.reply)
            self.pending.clear()
        with contextlib.suppress(OSError):
            os.close(self.fd)
        with contextlib.suppress(OSError):
            self.path.unlink()
        with contextlib.suppress(OSError, ValueError):
            if int(self.pid_file.read_text()) == host_pid():
                self.pid_file.unlink()

    def _accept(self, raw: bytes) -> FifoRequest | None:
        """The request on one line, its reply pipe opened, or None (and a warning) if it is not one."""
        try:
            reply_path, bundle, container_id = raw.decode("utf-8").split(" ")
        except ValueError:
            log.warning("dropped a malformed line on the runtime hook's pipe (%d bytes)", len(raw))
            return None
        reply = Path(reply_path)
        if reply.parent != self.folder or not self._reply_name.fullmatch(reply.name):
            log.warning("dropped a runtime hook request whose reply pipe %r is not one of this agent's", reply_path)
            return None
        try:
            fd = os.open(reply, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:  # ENXIO: the launcher is gone (nobody reads)
            log.warning("dropped a runtime hook request: its reply pipe cannot be opened (%s)", exc)
            return None
        facts = os.fstat(fd)
        if not stat.S_ISFIFO(facts.st_mode) or facts.st_uid not in (0, os.geteuid()):
            os.close(fd)
            log.warning("dropped a runtime hook request: %s is not a pipe of root's or this agent's", reply_path)
            return None
        with contextlib.suppress(OSError):
            reply.unlink()  # the launcher holds it open; its name is not needed any more
        request = FifoRequest(fd, bundle, container_id)
        self.pending[fd] = request
        if not CONTAINER_ID.fullmatch(container_id) or not bundle.startswith("/"):
            self.refuse(request, f"gpumgr: the runtime hook sent no valid create (bundle {bundle[:200]!r}, "
                                 f"container {container_id[:200]!r})")
            return None
        if len(self.pending) > MAX_PENDING:
            self.answer(request, hookpipe.PYTHON)  # the Python hook's socket has its own bound and says so
            return None
        with contextlib.suppress(OSError):
            os.write(fd, hookpipe.WAIT.encode() + b"\n")
        return request


def host_pid() -> int:
    """This process's PID as the host's launchers see it, for their ``kill -0`` check.

    An agent in a container (a Swarm service cannot share the host's PID namespace) reads the host's
    processes through the host's ``/proc`` (``proc_root``), whose ``self`` names it in the host's
    namespace; its own ``os.getpid()`` would be a number that means another process on the host.
    """
    try:
        return int(os.readlink(os.path.join(procmap.root(), "self")))
    except (OSError, ValueError):
        return os.getpid()
