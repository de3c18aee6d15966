"""Which manager an agent talks to when it was given several: the leader, as far as it can tell.

``--manager tcp://m1:9401,tcp://m2:9401,tcp://m3:9401`` names every manager of one control plane; they
share one CURVE key pair, so the agent's join token and trust cover all of them. The agent keeps one
connection to each of them (:class:`gpumgr.wire.link.link.Link` with ``peers``) and follows one: it joins,
registers and heartbeats only there. It moves to the next address in the ring when that one stops
answering (its join or registration goes unanswered, or frames to it cannot leave for
:data:`SILENT_AFTER` seconds: a killed manager drops the connection at once, and a paused one is found
by ZeroMQ's own heartbeats) or refuses it with ``not_leader``; the connection to the next one is up
already, so moving costs no handshake. Commands are taken from any connection and fenced by epoch
(:mod:`gpumgr.agent.fence`): a deposed leader that still holds its connection is answered
``stale_epoch`` on it, and following a stale address for a moment is harmless.
"""

from __future__ import annotations

import logging
import threading
import time
from urllib.parse import urlsplit

from gpumgr.wire import defaults

log = logging.getLogger(__name__)

#: Frames that cannot reach the manager this long mean it is gone: try the next one. A killed manager's
#: connection drops at once, so frames stop leaving at the next heartbeat; a heartbeat and a half
#: rides out a reconnect without hunting for a new leader (a paused manager is found by ZeroMQ's own
#: heartbeats, after ``NODE_DOWN_AFTER``).
SILENT_AFTER = 1.5 * defaults.HEARTBEAT_INTERVAL
#: A manager left because it went silent is passed over this long while others remain to try: a
#: killed leader's key outlives it by its lease, and asking it again only costs another silence.
PASS_OVER = 2 * defaults.NODE_DOWN_AFTER
#: Seconds between a ``not_leader`` answer and asking the next manager (followers answer at once:
#: without a pause an agent would spin round the ring while an election is under way).
NOT_LEADER_PAUSE = 0.2
#: Registrations sent to one manager without an answer before the next is tried.
UNANSWERED_TRIES = 4
#: The code a manager that does not lead refuses registration with (another manager leads: ask the next).
NOT_LEADER = "not_leader"
#: The code of a manager that knows no leader at all (an election is under way, or etcd lost its quorum).
NO_LEADER = "no_leader"
#: Seconds before asking the next manager after a ``no_leader``: the ring is walked at a calm pace while
#: nobody can take a registration (etcd without quorum can last minutes), instead of five times a second.
NO_LEADER_PAUSE = 1.0


def parse_managers(text: str) -> list[str]:
    """``tcp://host:port[,tcp://host:port...]`` as a list; raises ValueError naming the bad address."""
    endpoints: list[str] = []
    for item in (part.strip() for part in text.split(",")):
        if item.startswith("ipc://") and len(item) > len("ipc://"):  # a socket file on this host
            endpoints.append(item)
            continue
        parts = urlsplit(item)
        try:
            port = parts.port
        except ValueError:
            port = None
        if parts.scheme != "tcp" or not parts.hostname or port is None or parts.path or parts.query:
            raise ValueError(f"manager address {item!r} is not tcp://HOST:PORT or ipc://PATH "
                             "(several: comma-separated)")
        if item not in endpoints:
            endpoints.append(item)
    return endpoints


class ManagerSet:
    """A ring of manager addresses with the current one first; thread-safe."""

    def __init__(self, endpoints: list[str]) -> None:
        if not endpoints:
            raise ValueError("an agent needs at least one manager address")
        self.endpoints = list(endpoints)
        self._index = 0
        self._unanswered = 0
        self._silent: dict[str, float] = {}
        self._lock = threading.Lock()

    @property
    def several(self) -> bool:
        """Whether there is anyone to move to."""
        return len(self.endpoints) > 1

    @property
    def current(self) -> str:
        """The address the agent talks to now."""
        with self._lock:
            return self.endpoints[self._index]

    def advance(self, why: str, *, silent: bool = False) -> str:
        """Move to the next address in the ring (logging ``why``) and return it.

        With ``silent`` the address left went quiet (gone, or paused): it is passed over for
        :data:`PASS_OVER` seconds while another address is left to try.
        """
        now = time.monotonic()
        with self._lock:
            old = self.endpoints[self._index]
            if silent:
                self._silent[old] = now + PASS_OVER
            for _ in range(len(self.endpoints)):
                self._index = (self._index + 1) % len(self.endpoints)
                if self._silent.get(self.endpoints[self._index], 0.0) <= now:
                    break
            self._unanswered = 0
            new = self.endpoints[self._index]
        log.warning("leaving the manager at %s (%s): trying %s", old, why, new)
        return new

    def unanswered(self) -> bool:
        """Count one registration sent without an answer; True when it is time to try the next manager."""
        with self._lock:
            self._unanswered += 1
            return len(self.endpoints) > 1 and self._unanswered >= UNANSWERED_TRIES

    def answered(self) -> None:
        """The current manager answered: it is the one to stay with."""
        with self._lock:
            self._unanswered = 0


def local_address(endpoints: str) -> str:
    """This host's address on the way to the first manager of ``endpoints`` ("" if it cannot be told).

    What a gang's members on other hosts reach this node at, unless the agent's ``advertise_addr`` says. A
    UDP socket's ``connect`` only asks the kernel for a route: no packet is sent.
    """
    import socket

    try:
        first = parse_managers(endpoints)[0]
    except (ValueError, IndexError):
        return ""
    if first.startswith("ipc://"):
        return "127.0.0.1"
    parts = urlsplit(first)
    host = (parts.hostname or "").strip("[]")
    if host in ("", "*", "0.0.0.0"):
        return "127.0.0.1"
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((host, parts.port or 9))
            return str(probe.getsockname()[0])
    except OSError:
        return ""
