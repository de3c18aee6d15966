"""The runtime hook's relay: Swarm task grants asked for on the hook socket or pipe, forwarded to the manager.

The OCI runtime hook (:mod:`gpumgr.plugin.hook`) asks this agent for a grant when Docker creates a
task container that requests GPU memory. The relay fills in this node's name (a hook never names
the node), forwards the request over the agent link, and answers the hook with the grant and the
environment that pins the container to its GPU. It runs on the link's owner thread: the listener's
descriptors sit in the link's poller, and the link times out a request the manager never answers.

Two doors lead here: the socket, where the Python hook sends a ``reserve`` envelope, and the pipe
(:mod:`gpumgr.agent.hook.hookfifo`), where the shell launcher sends a bundle and a container id and this
relay reads and pins the bundle itself. Both go through :meth:`HookRelay._forward`, so both are
granted, refused and tracked alike.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

from gpumgr.agent.hook.hookfifo import FifoRequest, HookFifo
from gpumgr.agent.hook.hooklink import HookConnection, HookListener
from gpumgr.agent.runtimes import mps as mps_caps
from gpumgr.agent.runtimes.runtime import Managed, Runtime, task_env
from gpumgr.wire import defaults, protocol
from gpumgr.wire.engine import hookpipe
from gpumgr.wire.engine.bundle import MPS_PIPE, gpu_in_spec, held_refusal, pin_bundle, read_bundle
from gpumgr.wire.errors import AgentTimeout, GpumgrError, ProtocolError
from gpumgr.wire.link.link import Link
from gpumgr.wire.names import Env

log = logging.getLogger(__name__)
#: On the agent's DEALER every frame goes to the manager.
MANAGER = b""


#: How one request is answered: with a grant's result, or with an error's code and message.
Answer = Callable[[dict[str, Any] | None, tuple[str, str] | None], None]


class HookRelay:
    """Serve ``listener``'s (and ``fifo``'s) requests through ``link`` for ``node``; answer each hook once."""

    def __init__(self, listener: HookListener, link: Link, runtime: Runtime, node: str,
                 registered: threading.Event, fifo: HookFifo | None = None, pool: Executor | None = None) -> None:
        self.listener = listener
        self.link = link
        self.runtime = runtime
        self.node = node
        self.registered = registered
        self.fifo = fifo
        self.pool = pool

    def descriptors(self) -> set[int]:
        """The descriptors the link's poller watches for the hook."""
        fds = set(self.listener.descriptors())
        if self.fifo is not None:
            fds.add(self.fifo.fileno())
        return fds

    def on_ready(self, fds: set[int]) -> None:
        """Read what the readable descriptors hold and forward each whole request."""
        if self.fifo is not None and self.fifo.fileno() in fds:
            for request in self.fifo.ready():
                self._off_the_link(functools.partial(self._serve_bundle, request),
                                   functools.partial(self._refuse, request, None))
        for conn, frame in self.listener.ready(fds):
            try:
                envelope, message = protocol.decode(frame)
            except ProtocolError as exc:
                log.warning("dropped a malformed message from the runtime hook: %s", exc)
                self.listener.drop(conn)
                continue
            answer = functools.partial(self._answer, conn, envelope.id)
            self._off_the_link(functools.partial(self._forward, message, envelope.type, answer), answer)

    def _off_the_link(self, work: Callable[[], None], answer: Answer) -> None:
        """Run ``work()`` on the pool: it reads the bundle and asks the engine, and ten tasks of a
        service are created at once; the link's thread only reads requests and sends frames.

        Whatever goes wrong there is still an answer (a hook waits for one), never a silent end.
        """
        def guarded() -> None:
            try:
                work()
            except Exception as exc:  # an engine that fails, a bundle that vanished: say so to the hook
                log.exception("a runtime hook request failed")
                answer(None, ("agent_error", f"the agent failed to serve the request: {exc}"))

        if self.pool is None:
            guarded()
        else:
            self.pool.submit(guarded)

    def _refuse(self, request: FifoRequest, held: str | None, result: dict[str, Any] | None,
                error: tuple[str, str] | None) -> None:
        """Fail a pipe request's create with ``error``, worded as the Python hook words it (``held``: its GPU)."""
        assert self.fifo is not None
        reason = f"gpumgr: {error[1] if error else 'refused'}"
        self.fifo.refuse(request, held_refusal(held, reason) if held is not None else reason)

    def expire(self) -> None:
        """Close hook connections that never sent a whole request."""
        self.listener.expire()

    def close(self) -> None:
        """Close every hook connection, the socket and the pipe."""
        self.listener.close()
        if self.fifo is not None:
            self.fifo.close()

    def _serve_bundle(self, request: FifoRequest) -> None:
        """Do for the shell launcher what the Python hook does: read the bundle, get the grant, pin it."""
        fifo = self.fifo
        assert fifo is not None
        read = read_bundle(request.bundle)
        if read is None:  # not visible from here (an agent in a container, say): the Python hook reads it
            fifo.answer(request, hookpipe.PYTHON)
            return
        spec_path, spec, env = read
        held = None
        if Env.REQUEST_MEMORY not in env:
            held = gpu_in_spec(spec)
            if held is None:
                fifo.answer(request, hookpipe.PLAIN)
                return

        def answer(result: dict[str, Any] | None, error: tuple[str, str] | None) -> None:
            if result is None:
                self._refuse(request, held, None, error)
                return
            try:
                pin_bundle(spec_path, spec, env, result)
            except OSError as exc:
                fifo.refuse(request, f"gpumgr: cannot write the grant into {spec_path}: {exc}")
                return
            fifo.answer(request, hookpipe.OK)

        # what the Python hook would send: only the id counts (the engine's record gives the rest)
        self._forward(protocol.Reserve(container_id=request.container_id, gpu_memory=1, gpus=1), "reserve", answer)

    def _forward(self, message: protocol.Message, kind: str, answer: Answer) -> None:
        if not isinstance(message, protocol.Reserve):
            answer(None, ("protocol_error", f"unexpected {kind}"))
        elif not self.registered.is_set():
            answer(None, ("no_agents", "this agent is not registered with a manager"))
        elif not hasattr(self.runtime, "track_task"):
            answer(None, ("invalid_request", "GPU tasks need the Docker runtime"))
        elif (held := self.runtime.holder_of(message.container_id)) is not None and not held.hook:
            # a REST container (its image may carry GPUMGR_REQUEST_MEMORY): it holds its grant already
            answer(self._grant(held), None)
        else:
            try:
                request = self.runtime.engine_request(message)  # type: ignore[attr-defined]
            except GpumgrError as exc:
                log.warning("refused a runtime hook request: %s", exc.message)
                answer(None, (exc.code, exc.message))
                return
            request.node = self.node
            # a queued request is answered when it is placed (or expires just before the hook gives up)
            wait = defaults.HOOK_QUEUE_WAIT - defaults.HOOK_TIMEOUT if request.queue else defaults.HOOK_TIMEOUT
            future = self.link.request_async(MANAGER, request, wait)
            future.add_done_callback(lambda done: self._reserved(request, done, answer))

    def _reserved(self, request: protocol.Reserve, done: Future[protocol.Reply], answer: Answer) -> None:
        if done.exception() is not None:
            reason = "the manager did not answer in time" if isinstance(done.exception(), AgentTimeout) \
                else str(done.exception())
            answer(None, ("agent_timeout", reason))
            return
        reply = done.result()
        if not reply.ok:
            error = reply.error or protocol.ErrorBody(code="error", message="unknown error")
            answer(None, (error.code, error.message))
            return
        managed = self.runtime.track_task(request.container_id, reply.result, request)  # type: ignore[attr-defined]
        answer(self._grant(managed), None)

    def _grant(self, managed: Managed) -> dict[str, Any]:
        """What the hook writes into the task's bundle: its pinning and grant, and on an MPS node the daemon's pipe."""
        env = task_env(managed, self.node, self.runtime.mps)
        grant: dict[str, Any] = {"grant": managed.grant, "gpus": managed.gpus, "env": env}
        if self.runtime.mps:
            env.update(mps_caps.pipe_env(self.runtime.mps_pipe_directory))
            grant[MPS_PIPE] = self.runtime.mps_pipe_directory
        return grant

    def _answer(self, conn: HookConnection, msg_id: str, result: dict[str, Any] | None,
                error: tuple[str, str] | None) -> None:
        reply = protocol.Reply(ok=error is None, result=result or {},
                               error=protocol.ErrorBody(code=error[0], message=error[1]) if error else None)
        self.listener.answer(conn, protocol.encode(reply, reply_to=msg_id))


def bind_relay(path: str, link: Link, runtime: Runtime, node: str, registered: threading.Event,
               pool: Executor | None = None) -> HookRelay | None:
    """A relay on the root-only socket ``path`` and its pipe; None (and a warning) if the socket cannot be bound."""
    try:
        listener = HookListener(path, defaults.HOOK_TIMEOUT)
    except OSError as exc:
        log.warning("no Swarm task grants on this node: cannot bind the hook socket %s (%s)", path, exc)
        return None
    try:
        fifo: HookFifo | None = HookFifo(path)
    except OSError as exc:  # the launcher then starts the Python hook, which uses the socket
        log.warning("no pipe for the shell launcher beside %s (%s): GPU tasks' creates start Python", path, exc)
        fifo = None
    log.info("runtime hook socket on %s%s", path, f", pipe {fifo.path}" if fifo is not None else "")
    return HookRelay(listener, link, runtime, node, registered, fifo, pool)
