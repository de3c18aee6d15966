"""What a node's answer to a command (create, remove, resize) does to its record; called under the ledger's lock.

Only the reply for the operation in flight counts (an older one's is ignored). A create answered
with a report runs; one refused, or never delivered, failed and made nothing; one unanswered may
have made a container, so the record keeps its grant until its node reports it (then it runs: its
caller was told ``outcome_unknown``, not that it failed) or a deadline ends it. A remove answered
(or ``not_found``) ended it; a refused one leaves it running (or lets a preemption try again,
later); one unanswered or never delivered keeps its desired state, which the node's next report
carries out. Nothing is planned again at once after a
failure: only an operation that succeeded is followed up here, the rest by the node's next report.
A node's refusal reaches the REST caller as the engine's words, a 4xx where the caller was at
fault (:func:`agent_error`).
"""

from __future__ import annotations

from gpumgr.manager.model.lifecycle import Lifecycle
from gpumgr.manager.model.reconcile import Reconciler
from gpumgr.manager.model.records import Command, Container, Op, OpKind
from gpumgr.manager.model.resize import Resizer
from gpumgr.manager.model.walk.dispatch import Dispatch
from gpumgr.wire import defaults, protocol
from gpumgr.wire.errors import AgentFailed, Conflict, GpumgrError, InvalidRequest, NoAgents, PolicyDenied
from gpumgr.wire.names import LIVE, EventType, State
from gpumgr.wire.protocol import ContainerReport

#: Agent error codes that are the caller's mistake (a bad image reference, an unknown image, a bad command).
CALLER_ERRORS: dict[str, type[GpumgrError]] = {"invalid_request": InvalidRequest, "image_not_found": InvalidRequest,
                                               "bad_command": InvalidRequest, "conflict": Conflict}


def agent_error(node: str, error: protocol.ErrorBody | None, what: str) -> GpumgrError:
    """The error a REST caller gets for a node's refusal: the engine's words, 4xx where it was the caller's fault."""
    message = error.message if error is not None else "unknown error"
    if error is not None and error.code == PolicyDenied.code:  # the node's own policy: 403 with its rule
        return PolicyDenied.from_wire(f"node {node} refused: {message}")
    kind = CALLER_ERRORS.get(error.code if error is not None else "")
    if kind is not None:
        return kind(f"node {node} {what}: {message}", code=error.code if error is not None else None)
    return AgentFailed(f"node {node} {what}: {message}")


class Replies:
    """Settles nodes' replies to commands; see the module docstring."""

    def __init__(self, life: Lifecycle, dispatcher: Dispatch, resizer: Resizer, reconciler: Reconciler) -> None:
        self.life, self.dispatcher, self.resizer, self.reconciler = life, dispatcher, resizer, reconciler

    def answer(self, command: Command, reply: protocol.Reply | None, error: Exception | None, *,
               sent: bool = True) -> list[Command]:
        """:meth:`settle` under the model's lock (``Cluster.settle`` is this: a reply's path stays in this file)."""
        with self.life.ledger.lock:
            return self.settle(command, reply, error, sent=sent)

    def settle(self, command: Command, reply: protocol.Reply | None, error: Exception | None, *,
               sent: bool = True) -> list[Command]:
        """A node answered ``command`` (``reply``), or did not (``error``); return the follow-up commands."""
        record, op = command.record, command.op
        if record.op is not op:  # (Lifecycle.current, read here: the reply's path stays in this file)
            return []  # a reply for an older operation: ignored
        lost = error if isinstance(error, GpumgrError) else AgentFailed(f"node {record.node}: {error}")
        ok = reply is not None and reply.ok
        # a frame that never left changed nothing on the node, whatever failed it
        sent = sent and not (reply is None and isinstance(lost, NoAgents))
        if command.kind is OpKind.CREATE:
            self._create(record, op, reply, lost, sent)
        elif command.kind is OpKind.REMOVE:
            gone = ok or (reply is not None and reply.error is not None and reply.error.code == "not_found")
            if gone:
                record.op = None  # done: the move below must not fail it; its waiter is woken after the move
                self.life.move(record, State.REMOVED)
                self.life.end_op(record, op)
            elif reply is not None:
                refused = agent_error(record.node, reply.error, "could not remove the container")
                ended = record.detail.get("gang_ended")  # a member of an ended gang is asked again, however it ends
                if record.desired is State.PREEMPTED and not ended:
                    self.dispatcher.preemption_failed(record)
                elif not ended:
                    self.life.desire(record, State.RUNNING)
                runs_on = "; it runs on" if record.state in LIVE else ""
                self.life.event(EventType.FAILED, f"removal failed: {refused.message}{runs_on}", record)
                self.life.end_op(record, op, refused)
            else:  # unanswered or never delivered: its desired state stays; the next report carries it out
                self.life.end_op(record, op, lost)
        else:
            said = agent_error(record.node, reply.error, "could not resize the grant") if reply and not ok else None
            self.resizer.settle(record, op, ok, said or (None if ok else lost), reply is not None or not sent)
        follow = self.reconciler.follow_up(record) if ok and record.state in LIVE else None
        return [follow] if follow is not None else []

    def _create(self, record: Container, op: Op, reply: protocol.Reply | None, lost: GpumgrError,
                sent: bool) -> None:
        if reply is not None and reply.ok:
            try:
                report = ContainerReport(**(reply.result or {}))
            except (TypeError, ValueError) as exc:
                reply = protocol.Reply(ok=False, error=protocol.ErrorBody(code="protocol_error", message=str(exc)))
            else:
                record.container_id = report.container_id
                self.life.move(record, State.RUNNING)
                self.life.end_op(record, op)  # after the move: whoever waits on it sees it running
                return
        if reply is not None or not sent:  # refused or never delivered: nothing made
            refused = agent_error(record.node, reply.error if reply else None, "could not start the container") \
                if reply is not None else lost
            self.life.outcome("failed")
            self.life.move(record, State.FAILED, refused.message, error=refused)
            return
        # unanswered: the container may exist, and the caller was told so (502 outcome_unknown): it keeps its grant
        # and its desired state, runs once its node reports it, and ends "never confirmed" at its deadline if not.
        # (It is not removed on sight: a caller that looks, or resends its Idempotency-Key, is told it runs.)
        record.deadline = self.life.clock.monotonic() + 2 * self.reconciler.down_after + defaults.CREATE_MARGIN
        self.life.end_op(record, op, lost)
