"""Reclaim before placing: a request that needs bytes bursters hold gets them by stopping bursters first.

When a request does not fit, and would fit were some bursters' bytes free (their grants and the use above
them), those bursters are stopped, whatever their ``on_overrun``: each ends ``preempted`` with reason
``burst_reclaimed``, through the same path as a priority preemption (its desired state, then the reconciler's
removal). Per GPU they are taken the lowest priority first, then the largest burst there, then the youngest,
until the request fits; of the nodes, the one whose victims burst the fewest bytes. A burster is never chosen
within ``burst_min_runtime`` seconds of its creation, nor while its node backs off a refusal to stop it. A
request waits for what is being stopped for it: it asks again only once those have ended. Called under the
ledger's lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from gpumgr.manager.model.bursts.limits import is_burster
from gpumgr.manager.model.ledger import burst_of
from gpumgr.manager.model.lifecycle import Lifecycle
from gpumgr.manager.model.records import Command, Container, Gpu, OpKind
from gpumgr.wire import defaults
from gpumgr.wire.constraints import compiled
from gpumgr.wire.errors import NoFit
from gpumgr.wire.names import BURST_RECLAIMED, LIVE, EventType, State
from gpumgr.wire.units import format_bytes

#: How often a request waiting for reclaimed bytes looks whether it was placed (seconds).
PLACED_POLL = 0.01
#: (victims, the bytes they burst): one way to make room on one GPU or node
Option = tuple[list[Container], int]


class Dispatcher(Protocol):
    """What reclaim shares with the queue's dispatcher: the victims chosen per request, and the backoff."""

    making_room: dict[str, set[str]]

    def may_stop(self, victim: Container, now: float) -> bool: ...


class BurstReclaim:
    """Chooses and stops the bursters a request needs the bytes of; see the module docstring."""

    def __init__(self, life: Lifecycle) -> None:
        self.life, self.ledger = life, life.ledger
        #: seconds a burster runs before it may be reclaimed (the manager's ``burst_min_runtime``)
        self.min_runtime = defaults.BURST_MIN_RUNTIME
        #: how long a request that did not ask to queue waits for the bytes reclaimed for it (the create timeout)
        self.wait_limit = defaults.CREATE_TIMEOUT

    def holding(self) -> bool:
        """Whether bursters use bytes above their grants anywhere on the map (a request may need them)."""
        return any(g.burst for g in self.ledger.gpus.values())

    def wait_for(self, record: Container, dispatch: Dispatcher) -> bool:
        """A request that asked not to queue and fits only once bursters are reclaimed: stop them, and whether
        it waits for them (queued, for its caller's create timeout, unjournaled: its caller holds the answer)."""
        if not self.reclaim(record, dispatch.making_room, dispatch.may_stop):
            return False
        # a backstop: its caller withdraws it after its own create timeout; a runtime hook's ends here
        record.expires_mono = self.life.clock.monotonic() + self.wait_limit + defaults.CREATE_MARGIN
        self.life.expiries.add((record.expires_mono, record.id))
        self.life.event(EventType.QUEUED, f"waits for {format_bytes(record.gpu_memory)} that bursters use above "
                        "their grants: they are being reclaimed", record, reclaim=True)
        return True

    def await_placed(self, record: Container, timeout: float) -> list[Command]:
        """Wait up to ``timeout`` seconds for :meth:`wait_for`'s ``record`` to be placed: its create, which the
        dispatcher sends. Raises NoFit, withdrawing it, if it is still queued then (or ended meanwhile)."""
        deadline = time.monotonic() + timeout
        while record.state is State.QUEUED and time.monotonic() < deadline:
            time.sleep(PLACED_POLL)
        with self.ledger.lock:
            if record.state is State.QUEUED:
                self.life.forget(record)
            if record.state not in LIVE:
                raise NoFit(f"the bursters reclaimed for it did not free {format_bytes(record.gpu_memory)} within "
                            f"{timeout:g}s; nothing was kept")
            op = record.op
            return [Command(OpKind.CREATE, record, op)] if op is not None and op.kind is OpKind.CREATE else []

    def reclaim(self, head: Container, making_room: dict[str, set[str]],
                may_stop: Callable[[Container, float], bool]) -> bool:
        """Stop the bursters ``head`` needs the bytes of; whether some are being stopped for it now.

        ``making_room`` (the dispatcher's, request → victims) records them, so the dispatcher sends their
        removals; ``may_stop`` says whether a victim's node backs off a refusal to stop it.
        """
        records = self.ledger.records
        if any(records[v].state in LIVE and records[v].desired is State.PREEMPTED
               for v in making_room.get(head.id, ()) if v in records):
            return True
        if not self.holding():
            return False
        now_mono, now = self.life.clock.monotonic(), self.life.clock.time()

        def eligible(victim: Container) -> bool:
            return (is_burster(victim) and victim.state is State.RUNNING and victim.desired is State.RUNNING
                    and victim.op is None and now - victim.created_at >= self.min_runtime
                    and may_stop(victim, now_mono))

        victims = self.victims(head, eligible)
        if not victims:
            return False
        making_room[head.id] = {v.id for v in victims}
        for victim in victims:
            self._stop(victim, head)
        return True

    def _stop(self, victim: Container, head: Container) -> None:
        burst = sum(burst_of(victim, g) for g in victim.gpus)
        self.life.desire(victim, State.PREEMPTED, BURST_RECLAIMED, preempted_for=head.id)
        self.life.event(EventType.PREEMPTED, f"reclaiming burster (priority {victim.priority}, "
                        f"{format_bytes(burst)} above its grant): request {head.id} needs the bytes", victim,
                        preempted_for=head.id, burst=burst, reason=BURST_RECLAIMED)

    def victims(self, head: Container, eligible: Callable[[Container], bool]) -> list[Container]:
        """The bursters whose stopping lets ``head`` fit, at the fewest bytes burst; empty if none would do."""
        spec = head.spec
        nodes = [spec.node] if spec.node is not None else list(self.ledger.index.by_node)
        allowed = compiled(tuple(spec.constraints)).allows if spec.constraints else None
        best: Option | None = None
        for name in nodes:
            options = [option for gpu in self.ledger.node_gpus(name)
                       if gpu in self.ledger.index and (allowed is None or allowed(gpu))
                       and (option := self._on_gpu(gpu, head.gpu_memory, eligible)) is not None]
            if len(options) < spec.count:
                continue
            options.sort(key=lambda o: o[1])
            chosen = list({v.id: v for victims, _ in options[:spec.count] for v in victims}.values())
            cost = sum(cost for _, cost in options[:spec.count])
            if chosen and (best is None or cost < best[1]):
                best = (chosen, cost)
        return [] if best is None else best[0]

    def _on_gpu(self, gpu: Gpu, want: int, eligible: Callable[[Container], bool]) -> Option | None:
        """The bursters of ``gpu`` to stop, in order, until ``want`` bytes are free there; None if they cannot."""
        free = gpu.total - gpu.reserved - gpu.unmanaged - gpu.headroom - gpu.gang_hold - gpu.burst
        if free >= want:
            return [], 0
        records = self.ledger.records
        holders = [r for c in gpu.holders if (r := records[c]) is not None and burst_of(r, gpu.uuid) > 0]
        holders.sort(key=lambda r: (r.priority, -burst_of(r, gpu.uuid), -r.created_at))
        chosen: list[Container] = []
        for victim in holders:
            if free >= want:
                break
            if eligible(victim):
                chosen.append(victim)
                free += victim.held + burst_of(victim, gpu.uuid)
        return (chosen, sum(burst_of(v, gpu.uuid) for v in chosen)) if free >= want else None
