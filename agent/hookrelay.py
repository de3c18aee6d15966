"""The runtime hook's relay: Swarm task grants asked for on the hook socket, forwarded to the manager.

The OCI runtime hook (:mod:`gpumgr.plugin.hook`) asks this agent for a grant when Docker creates a
task container that requests GPU memory. The relay fills in this node's name (a hook never names
the node), forwards the request over the agent link, and answers the hook with the grant and the
environment that pins the container to its GPU. It runs on the link's owner thread: the listener's
descriptors sit in the link's poller, and the link times out a request the manager never answers.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import Any

from gpumgr.agent.hooklink import HookConnection, HookListener
from gpumgr.agent.runtime import Runtime, task_env
from gpumgr.wire import defaults, protocol
from gpumgr.wire.errors import AgentTimeout, GpumgrError, ProtocolError
from gpumgr.wire.link import Link

log = logging.getLogger(__name__)
#: On the agent's DEALER every frame goes to the manager.
MANAGER = b""


class HookRelay:
    """Serve ``listener``'s requests through ``link`` for ``node``; answer each hook once."""

    def __init__(self, listener: HookListener, link: Link, runtime: Runtime, node: str,
                 registered: threading.Event) -> None:
        self.listener = listener
        self.link = link
        self.runtime = runtime
        self.node = node
        self.registered = registered

    def descriptors(self) -> set[int]:
        """The descriptors the link's poller watches for the hook."""
        return set(self.listener.descriptors())

    def on_ready(self, fds: set[int]) -> None:
        """Read what the readable descriptors hold and forward each whole request."""
        for conn, frame in self.listener.ready(fds):
            try:
                envelope, message = protocol.decode(frame)
            except ProtocolError as exc:
                log.warning("dropped a malformed message from the runtime hook: %s", exc)
                self.listener.drop(conn)
                continue
            self._forward(conn, envelope, message)

    def expire(self) -> None:
        """Close hook connections that never sent a whole request."""
        self.listener.expire()

    def close(self) -> None:
        """Close every hook connection and the socket."""
        self.listener.close()

    def _forward(self, conn: HookConnection, envelope: protocol.Envelope, message: protocol.Message) -> None:
        if not isinstance(message, protocol.Reserve):
            self._answer(conn, envelope.id, error=("protocol_error", f"unexpected {envelope.type}"))
        elif not self.registered.is_set():
            self._answer(conn, envelope.id, error=("no_agents", "this agent is not registered with a manager"))
        elif not hasattr(self.runtime, "track_task"):
            self._answer(conn, envelope.id, error=("invalid_request", "GPU tasks need the Docker runtime"))
        elif (held := self.runtime.holder_of(message.container_id)) is not None and not held.hook:
            # a REST container (its image may carry GPUMGR_REQUEST_MEMORY): it holds its grant already
            self._answer(conn, envelope.id, result={"grant": held.grant, "gpus": held.gpus,
                                                    "env": task_env(held, self.node, self.runtime.mps)})
        else:
            try:
                request = self.runtime.engine_request(message)  # type: ignore[attr-defined]
            except GpumgrError as exc:
                log.warning("refused a runtime hook request: %s", exc.message)
                self._answer(conn, envelope.id, error=(exc.code, exc.message))
                return
            request.node = self.node
            # a queued request is answered when it is placed (or expires just before the hook gives up)
            wait = defaults.HOOK_QUEUE_WAIT - defaults.HOOK_TIMEOUT if request.queue else defaults.HOOK_TIMEOUT
            future = self.link.request_async(MANAGER, request, wait)
            future.add_done_callback(lambda done: self._reserved(conn, envelope.id, request, done))

    def _reserved(self, conn: HookConnection, hook_msg: str, request: protocol.Reserve,
                  done: Future[protocol.Reply]) -> None:
        if done.exception() is not None:
            reason = "the manager did not answer in time" if isinstance(done.exception(), AgentTimeout) \
                else str(done.exception())
            self._answer(conn, hook_msg, error=("agent_timeout", reason))
            return
        reply = done.result()
        if not reply.ok:
            error = reply.error or protocol.ErrorBody(code="error", message="unknown error")
            self._answer(conn, hook_msg, error=(error.code, error.message))
            return
        managed = self.runtime.track_task(request.container_id, reply.result, request)  # type: ignore[attr-defined]
        self._answer(conn, hook_msg, result={"grant": managed.grant, "gpus": managed.gpus,
                                             "env": task_env(managed, self.node, self.runtime.mps)})

    def _answer(self, conn: HookConnection, msg_id: str, *, result: dict[str, Any] | None = None,
                error: tuple[str, str] | None = None) -> None:
        reply = protocol.Reply(ok=error is None, result=result or {},
                               error=protocol.ErrorBody(code=error[0], message=error[1]) if error else None)
        self.listener.answer(conn, protocol.encode(reply, reply_to=msg_id))


def bind_relay(path: str, link: Link, runtime: Runtime, node: str, registered: threading.Event) -> HookRelay | None:
    """A relay on the root-only socket ``path``; None (and a warning) if it cannot be bound."""
    try:
        listener = HookListener(path, defaults.HOOK_TIMEOUT)
    except OSError as exc:
        log.warning("no Swarm task grants on this node: cannot bind the hook socket %s (%s)", path, exc)
        return None
    log.info("runtime hook socket on %s", path)
    return HookRelay(listener, link, runtime, node, registered)
