"""Resizing a grant in place (``PATCH /v1/containers/{id}``), and settling what its node answered.

A grow is held on the map at once (the node still enforces the smaller figure until told); a
shrink is given back only once the node enforces it, so freed bytes are never granted while still
used. A reply that never comes leaves the map holding the larger of the two figures until the
node's heartbeat says which one it enforces (:meth:`Reconciler.enforced`), never rolled back blind.
Called under the ledger's lock.
"""

from __future__ import annotations

from gpumgr.manager.model.bursts.limits import change_limit, restore_limit
from gpumgr.manager.model.lifecycle import Lifecycle
from gpumgr.manager.model.records import Command, Container, Op, OpKind
from gpumgr.manager.model.walk.dispatch import Dispatch
from gpumgr.manager.tenancy.tenants import Tenant
from gpumgr.wire.errors import Conflict, GpumgrError, NoAgents, NoFit
from gpumgr.wire.names import EventType, State
from gpumgr.wire.units import format_bytes


class Resizer:
    """Begins resizes and settles their replies; see the module docstring."""

    def __init__(self, life: Lifecycle, dispatch: Dispatch, timeout: float) -> None:
        self.life, self.dispatch, self.ledger, self.timeout = life, dispatch, life.ledger, timeout
        #: resize operation id → the limit its record had before (put back if its node refuses)
        self.limits_before: dict[int, int] = {}

    def begin(self, record: Container, memory: int, *, force: bool = False, tenant: Tenant | None = None,
              limit: int | None = None) -> Command | None:
        """Check and start a resize of ``record`` to ``memory`` per GPU (and its limit to ``limit``, None: kept);
        the command for its node, if any.

        The limit is checked first (400 below the request), the quota next (403, the request alone), then
        room (409). Shrinking below what the container uses now is refused unless ``force``. None when nothing
        needs telling (a queued request, or a no-op).
        """
        before = change_limit(record, memory, limit)
        try:
            command = self._begin(record, memory, force, tenant, before != record.gpu_memory_limit)
        except GpumgrError:
            restore_limit(record, before)
            raise
        if command is not None:
            self.limits_before[command.op.id] = before
        return command

    def _begin(self, record: Container, memory: int, force: bool, tenant: Tenant | None,
               limit_changed: bool) -> Command | None:
        if record.gang is not None:
            raise Conflict(f"container {record.id} is member {record.rank} of gang {record.gang}: a gang's members "
                           "keep the grant the gang asked for")
        old = record.gpu_memory
        delta = memory - old
        if record.state is State.QUEUED:
            if delta > 0:
                self.life.quotas.check(tenant, delta * record.count, 0)
            self.dispatch.check_could_fit(record.spec, memory)
            self.dispatch.requeue_spec(record, memory)
            return None
        if record.state is not State.RUNNING or record.desired is not State.RUNNING:
            raise Conflict(f"container {record.id} is {record.state}"
                           + ("" if record.desired is State.RUNNING else f", to be {record.desired}")
                           + ": only a running or queued container can be resized")
        if record.op is not None:
            raise Conflict(f"container {record.id} has a {record.op.kind} in flight; try again when that is done")
        holder = self.ledger.nodes.get(record.node)
        if holder is None or not holder.ready:
            raise NoAgents(f"node {record.node} is down; its containers cannot be resized now")
        if delta == 0 and record.enforced in (0, memory) and not limit_changed:
            return None
        if delta > 0:
            self.life.quotas.check(tenant, delta * record.count, 0)
            borrows = self._account_room(record, delta)
            short = self.ledger.room_for(record, max(0, memory - record.held))
            if short is not None:
                raise NoFit(f"GPU {short.uuid} has {format_bytes(short.free)} free; growing the grant from "
                            f"{format_bytes(old)} to {format_bytes(memory)} needs {format_bytes(delta)} more")
        elif delta < 0:
            over = {g: used for g, used in record.usage.items() if used > memory}
            if over and not force:
                uuid, used = next(iter(over.items()))
                raise Conflict(f"container {record.id} uses {format_bytes(used)} on GPU {uuid}, more than the "
                               f"{format_bytes(memory)} asked for; send \"force\": true to shrink it anyway (its "
                               f"node then acts on the overrun: {record.on_overrun})", code="below_usage")
        op = self.life.begin(record, OpKind.RESIZE, self.timeout, old=old, new=memory)
        assert op is not None
        if delta > 0 and borrows:
            self.life.quotas.borrow(record)  # grown past its account's quota: it borrows, and reclaim may stop it
        self.life.quotas.resized(record, delta)
        record.gpu_memory = memory
        self.ledger.rehold(record, max(record.held, memory))  # a grow is held now; a shrink once enforced
        return Command(OpKind.RESIZE, record, op)

    def _account_room(self, record: Container, delta: int) -> bool:
        """With accounts: whether growing ``record`` by ``delta`` per GPU borrows; 409 ``over_quota`` if it may not."""
        quotas = self.life.quotas
        if record.account is None or quotas.accounts is None:
            return False
        verdict = quotas.room(record.account, delta * record.count)
        if verdict == "limit" or (verdict == "over_quota" and not record.preemptible):
            raise Conflict(f"growing it would take account {record.account} past "
                           + ("a limit on its path" if verdict == "limit" else "its quota, and it is not preemptible"),
                           code="over_quota")
        return verdict == "over_quota"

    def settle(self, record: Container, op: Op, ok: bool, error: GpumgrError | None, definitive: bool) -> None:
        """Its node answered ``op`` (``ok``, or a definitive refusal), or never did (not ``definitive``)."""
        limit_before = self.limits_before.pop(op.id, None)
        if definitive and not ok and limit_before is not None:
            restore_limit(record, limit_before)  # its node still kills above the limit it had
        if ok:
            record.enforced = op.new
            if record.gpu_memory == op.new:
                self.ledger.rehold(record, op.new)
            if op.old != op.new:
                self.life.event(EventType.RESIZED, f"grant resized from {format_bytes(op.old)} to "
                                f"{format_bytes(op.new)} per GPU", record, old=op.old, new=op.new)
        elif definitive and record.gpu_memory == op.new:
            # its node still enforces the figure it had: the map goes back to it
            self.life.quotas.resized(record, op.old - op.new)
            record.gpu_memory = op.old
            self.ledger.rehold(record, max(op.old, record.enforced))
        elif not definitive:
            # a lost reply: its node may enforce either figure; the larger stays held (and is assumed enforced)
            # until its next heartbeat says which, and the map's figure is sent again
            record.enforced = max(record.enforced, op.old, op.new)
            self.ledger.rehold(record, max(record.held, record.enforced))
        self.life.end_op(record, op, error)
