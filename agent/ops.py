"""The commands an agent has run, by operation: a command delivered twice is applied once.

A manager whose connection blipped may deliver a command again. Create, Remove and Resize carry the
id of the manager's operation (``op``); the agent keys each by its grant and that id, and by a digest
of the whole command and the epoch that sent it, so an id that a later manager process happens to
reuse is never taken for a repeat. A delivery of a command still running is answered when that run
ends (every delivery's request id, on the connection the newest came on); one of a command already
answered gets the same reply at once, and the engine is not asked again. The newest ``kept`` answers
are remembered. A command without an ``op`` (from a manager older than 0.2.0) is never deduplicated.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from gpumgr.wire import defaults, protocol

#: (grant, op, digest of the command and its epoch)
OpKey = tuple[str, str, str]


@dataclass
class _Running:
    """Who waits for a command's reply: the newest delivery's connection and every delivery's request id."""

    to: bytes
    ids: list[str] = field(default_factory=list)


class Ops:
    """The commands running and the newest ``kept`` answered, by :func:`op_key`."""

    def __init__(self, kept: int = defaults.AGENT_OPS_KEPT) -> None:
        self.kept = kept
        self._lock = threading.Lock()
        self._running: dict[OpKey, _Running] = {}
        self._answered: OrderedDict[OpKey, protocol.Reply] = OrderedDict()

    def arrive(self, key: OpKey, to: bytes, request_id: str) -> tuple[bool, protocol.Reply | None]:
        """A delivery of ``key`` on connection ``to``: whether to run it now, and the reply kept if it was answered.

        ``(False, None)``: its first delivery still runs, and this one is answered with it.
        """
        with self._lock:
            kept = self._answered.get(key)
            if kept is not None:
                return False, kept
            running = self._running.get(key)
            if running is not None:
                running.to = to
                if request_id not in running.ids:
                    running.ids.append(request_id)
                return False, None
            self._running[key] = _Running(to, [request_id])
            return True, None

    def settle(self, key: OpKey, reply: protocol.Reply, *, keep: bool = True) -> tuple[bytes, list[str]]:
        """``key``'s run ended with ``reply`` (kept unless ``keep`` is False); returns whom to answer."""
        with self._lock:
            running = self._running.pop(key)
            if keep:
                self._answered[key] = reply
                while len(self._answered) > self.kept:
                    self._answered.popitem(last=False)
        return running.to, running.ids


def op_key(envelope: protocol.Envelope, message: protocol.Message) -> OpKey | None:
    """The key a Create, Remove or Resize is remembered by; None for any other command or one without an ``op``."""
    if isinstance(message, protocol.Create):
        grant = message.spec.grant
    elif isinstance(message, protocol.Remove | protocol.Resize):
        grant = message.grant
    else:
        return None
    if not message.op:
        return None
    digest = hashlib.blake2b(f"{envelope.type}\0{envelope.epoch}\0".encode(), digest_size=16)
    digest.update(message.model_dump_json().encode())
    return grant, message.op, digest.hexdigest()
