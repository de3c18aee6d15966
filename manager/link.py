"""The manager's end of the agent link: a ROUTER socket owned by one thread of the shared link loop.

Incoming requests and reports go to the manager's handler, called on the owner thread, which must
be quick (it only updates the in-memory map). Everything else (the outbox, the wake-up pipe,
replies tied to requests, malformed frames dropped) is :class:`gpumgr.wire.link.Link`'s.
"""

from __future__ import annotations

from collections.abc import Callable

import zmq

from gpumgr.wire import defaults
from gpumgr.wire.link import Handler, Link, LinkHooks


class ManagerLink(Link):
    """Bind ``endpoint`` and route frames to and from agents."""

    def __init__(self, endpoint: str, handler: Handler, *, tick: float = defaults.LINK_TICK,
                 on_tick: Callable[[], None] | None = None) -> None:
        hooks = LinkHooks(on_tick=_every_tick(on_tick)) if on_tick is not None else None
        super().__init__(zmq.ROUTER, endpoint, handler, bind=True, configure=_router_options, tick=tick,
                         hooks=hooks, name="agent-link")


def _router_options(sock: zmq.Socket[bytes]) -> None:
    """Fail a send to an agent that is gone at once instead of queueing it for nobody."""
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)


def _every_tick(work: Callable[[], None]) -> Callable[[], float | None]:
    def tick() -> float | None:
        work()
        return None

    return tick
