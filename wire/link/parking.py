"""Frames that could not leave, kept per proven key until that key speaks again on a new connection.

A ROUTER refuses a frame to a routing id that is gone (``ROUTER_MANDATORY``: a blip made the agent
reconnect under a new one) or whose pipe is full. Such a frame never left, so it is safe to send
again, once: it waits here, under its sender's key, until any frame from that key shows the node's
current connection (:meth:`Parking.take`), or until its deadline (:meth:`Parking.expired`). Only the
link's owner thread uses this, so it takes no lock. What waits for one key is bounded; beyond it the
oldest frame gives way.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from gpumgr.wire import defaults


@dataclass
class Parked:
    """One frame that never left: for whom, what, the request waiting on it (if any), and until when."""

    key: str
    frame: bytes
    msg_id: str | None
    deadline: float


class Parking:
    """Parked frames by key, and each key's newest routing id; see the module docstring."""

    def __init__(self, per_key: int = defaults.LINK_PARKED_MAX, routes: int = defaults.LINK_ROUTES_MAX) -> None:
        self.per_key = per_key
        self._max_routes = routes
        self._frames: dict[str, deque[Parked]] = {}
        self._routes: OrderedDict[str, bytes] = OrderedDict()

    def __contains__(self, key: str) -> bool:
        return key in self._frames

    def __len__(self) -> int:
        return sum(len(frames) for frames in self._frames.values())

    def route(self, key: str, fallback: bytes) -> bytes:
        """The routing id ``key`` last spoke from, else ``fallback`` (the caller's idea of it)."""
        return self._routes.get(key, fallback) if key else fallback

    def heard(self, key: str, routing_id: bytes) -> bytes | None:
        """``key`` spoke on ``routing_id``: the routing id it spoke on before, if this is a new one (a reconnect)."""
        routes = self._routes
        before = routes.get(key)
        if before == routing_id:
            return None
        routes[key] = routing_id
        routes.move_to_end(key)
        if len(routes) > self._max_routes:
            routes.popitem(last=False)
        return before

    def forget(self, key: str) -> None:
        """``key``'s connection is gone for good (its process restarted): drop the route, keep nothing."""
        self._routes.pop(key, None)

    def park(self, item: Parked) -> Parked | None:
        """Keep ``item``; returns the oldest frame it pushed out (its key already had ``per_key``), if any."""
        frames = self._frames.setdefault(item.key, deque())
        frames.append(item)
        return frames.popleft() if len(frames) > self.per_key else None

    def take(self, key: str) -> list[Parked]:
        """Every frame waiting for ``key``, oldest first (they leave the parking)."""
        return list(self._frames.pop(key, ()))

    def expired(self, now: float) -> list[Parked]:
        """Every frame whose deadline has passed (they leave the parking)."""
        late: list[Parked] = []
        for key in list(self._frames):
            frames = self._frames[key]
            kept = [p for p in frames if p.deadline > now]
            late += [p for p in frames if p.deadline <= now]
            if kept:
                self._frames[key] = deque(kept)
            else:
                del self._frames[key]
        return late
