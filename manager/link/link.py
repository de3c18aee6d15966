"""The manager's end of the agent link: a CURVE-server ROUTER owned by one thread of the shared link loop.

Incoming requests and reports go to the manager's handler, run on the manager's lanes (each
node's messages in order), never on the owner thread, which only moves frames. Each carries the
sender's proven key; the handler decides what that key may say. Everything else (the outbox, the
wake-up pipe, replies tied to requests, malformed frames dropped, frames that wait for a node's
next connection) is :class:`gpumgr.wire.link.link.Link`'s. The link has a ZeroMQ context of its own,
because a context has one ZAP handler and it must be this manager's. With several managers,
``epoch`` gives the leader's epoch, and every frame sent carries it so agents can refuse a deposed
leader.
"""

from __future__ import annotations

from collections.abc import Callable

import zmq
from zmq.auth.thread import ThreadAuthenticator

from gpumgr.wire import defaults, security
from gpumgr.wire.epoch import Epoch
from gpumgr.wire.link.lanes import Lanes
from gpumgr.wire.link.link import Handler, Link


class ManagerLink(Link):
    """Bind ``endpoint`` as a CURVE server with ``keys`` and route frames to and from agents."""

    def __init__(self, endpoint: str, handler: Handler, keys: security.KeyPair, *,
                 tick: float = defaults.LINK_TICK, epoch: Callable[[], Epoch | None] | None = None,
                 lanes: Lanes | None = None) -> None:
        self._auth: ThreadAuthenticator | None = None
        super().__init__(zmq.ROUTER, endpoint, handler, bind=True, configure=lambda s: _router_options(s, keys),
                         context=zmq.Context(), tick=tick, name="agent-link", epoch=epoch, lanes=lanes)

    def start(self) -> None:
        """Start the ZAP handler, then bind."""
        self._auth = security.start_authenticator(self._ctx)
        try:
            super().start()
        except BaseException:
            self._auth.stop()
            raise

    def stop(self) -> None:
        """Close the socket and the ZAP handler."""
        super().stop()
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


def _router_options(sock: zmq.Socket[bytes], keys: security.KeyPair) -> None:
    """CURVE on every frame; a send to an agent that is gone fails at once instead of queueing for nobody."""
    security.serve_curve(sock, keys)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    # a rack powering on connects all at once: with ZeroMQ's backlog of 100 the kernel drops the
    # SYNs beyond it and those agents retry a second later (the kernel caps this at somaxconn)
    sock.setsockopt(zmq.BACKLOG, defaults.LINK_BACKLOG)
    # agents reconnect under a fresh routing id; a stale one should not hold a send for long
    sock.setsockopt(zmq.SNDTIMEO, 0)
