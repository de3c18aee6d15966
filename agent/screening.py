"""What the agent's link thread does with every frame before the agent acts on it: the epoch fence.

A frame stamped with an epoch lower than the highest this agent accepted comes from a deposed leader
(or from a leader of an etcd restored from a snapshot, whose revisions went back). It is dropped, and
whatever its kind (a command, ``Registered``, ``Reregister``, a reply) the sender is told
``stale_epoch`` with the agent's own epoch in the reply's ``result`` (``{"epoch": [generation,
revision]}``): a leader that is truly older steps down, and a leader of a store whose epochs went back
writes a higher generation and stands again, so every agent accepts it without losing its fence.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from gpumgr.agent.fence import Fence, StaleEpoch
from gpumgr.agent.managers import NO_LEADER, NOT_LEADER
from gpumgr.wire import protocol
from gpumgr.wire.epoch import Epoch
from gpumgr.wire.link.link import Peer

log = logging.getLogger(__name__)

#: ``send(routing_id, message, reply_to=...)``: the link's send, which queues a frame and never blocks
Send = Callable[..., None]


def not_leader(message: protocol.Message) -> bool:
    """Whether ``message`` is a manager's answer that it does not lead (a refused registration or request)."""
    if isinstance(message, protocol.Refused):
        return message.code in (NOT_LEADER, NO_LEADER)
    return isinstance(message, protocol.Reply) and message.error is not None and \
        message.error.code in (NOT_LEADER, NO_LEADER)


def stale_reply(exc: StaleEpoch, highest: Epoch | None) -> protocol.Reply:
    """The answer to a frame of an older epoch: ``stale_epoch``, and the epoch this agent follows."""
    result = {} if highest is None else {"epoch": highest.to_wire()}
    return protocol.Reply(ok=False, result=result, error=protocol.ErrorBody(code=exc.code, message=exc.message))


def _unsent(*_: object, **__: object) -> None:
    log.warning("a stale_epoch answer was not sent: the screen has no link yet")


class Screen:
    """The link's screen: admits a frame's epoch into ``fence`` or refuses the frame and tells its sender why."""

    def __init__(self, fence: Fence, send: Send | None = None) -> None:
        self.fence = fence
        #: set once the link exists (the link is made with this screen)
        self.send: Send = send or _unsent

    def __call__(self, peer: Peer, envelope: protocol.Envelope, message: protocol.Message) -> Exception | None:
        """None to let the frame through; the refusal (the frame is dropped) otherwise.

        A ``not_leader`` answer passes: a manager that does not lead stamps no epoch, and its answer changes
        nothing here but which manager the agent talks to next.
        """
        if not_leader(message):
            return None
        try:
            self.fence.admit(None if envelope.epoch is None else Epoch(*envelope.epoch))
            return None
        except StaleEpoch as exc:
            log.warning("%s (a %s message dropped)", exc.message, envelope.type)
            self.send(peer.routing_id, stale_reply(exc, self.fence.highest), reply_to=envelope.id)
            return exc
