"""A refused preemption backs off per victim, with growing delay and jitter, and gives up with an event after a bound.

The real model (:class:`Cluster`) on a logical clock: a preemptible container runs on each GPU, a queued
request of higher priority needs one GPU's room, and the node refuses every Remove the dispatcher sends.
Before the backoff, the dispatcher chose the same victim again on its very next pass, as fast as the node
could refuse, and wrote two events a round.
"""

from __future__ import annotations

from typing import Any

import pytest

from gpumgr.manager.model.cluster import Cluster, PlacementSpec
from gpumgr.manager.model.records import Command, OpKind
from gpumgr.wire import defaults
from gpumgr.wire.names import EventType, State
from gpumgr.wire.protocol import ContainerReport, GpuInfo, Reply
from tests.lifecycle_model import LogicalClock, refusal

U = 1 << 30
MIN, MAX, RETRIES = defaults.PREEMPT_RETRY_MIN, defaults.PREEMPT_RETRY_MAX, defaults.PREEMPT_RETRIES
TICK = defaults.DISPATCH_TICK


def spec(memory: int, **kw: Any) -> PlacementSpec:
    return PlacementSpec(memory=memory, count=1, placement="spread", image="img", command=[], **kw)


class Preempting:
    """One node whose ``gpus`` GPUs each run a preemptible container, and a queued request that needs one's room."""

    def __init__(self, gpus: int = 1) -> None:
        self.clock = LogicalClock()
        self.cluster = Cluster(aging=3600.0, clock=self.clock)
        infos = [GpuInfo(uuid=f"a-g{i}", index=i, name="Sim", memory_total=8 * U) for i in range(gpus)]
        self.cluster.register("a", b"a", "docker", infos, [])
        self.victims = [self.run(spec(6 * U, preemptible=True)) for _ in range(gpus)]
        self.head = self.cluster.submit(spec(6 * U, priority=5), queue=True)[0].id

    def run(self, placement: PlacementSpec) -> str:
        record, (create,) = self.cluster.submit(placement)
        report = ContainerReport(grant=record.id, container_id=f"c-{record.id}", gpus=record.gpus,
                                 gpu_memory=record.gpu_memory, state="running")
        self.cluster.settle(create, Reply(ok=True, result=report.model_dump()), None)
        return record.id

    def removals(self) -> list[Command]:
        """One dispatch pass: the removals it sends."""
        commands, _ = self.cluster.dispatch()
        return [c for c in commands if c.kind is OpKind.REMOVE]

    def refuse(self, command: Command) -> None:
        self.cluster.settle(command, refusal(), None)

    def wait_for_removal(self, limit: float) -> tuple[float, Command | None]:
        """Dispatch once a tick until a removal goes out: ``(seconds waited, it)``, or ``(limit, None)``."""
        waited = 0.0
        while waited < limit:
            sent = self.removals()
            if sent:
                return waited, sent[0]
            self.clock.advance(TICK)
            waited += TICK
        return waited, None

    def events(self) -> list[dict[str, object]]:
        return self.cluster.events.since()


def test_a_refused_preemption_is_not_asked_of_the_same_container_at_once() -> None:
    world = Preempting()
    (first,) = world.removals()
    world.refuse(first)
    for _ in range(100):  # no time passes: the dispatcher must not choose it again
        assert world.removals() == []
    assert world.cluster.get(world.victims[0]).desired is State.RUNNING
    world.clock.advance(0.5 * MIN - TICK)  # short of the least the jitter allows
    assert world.removals() == []
    _, again = world.wait_for_removal(1.5 * MIN + TICK)
    assert again is not None and again.record.id == world.victims[0]


def test_each_refusal_doubles_the_pause_up_to_the_cap() -> None:
    world = Preempting()
    world.cluster.dispatcher.jitter = lambda: 1.0
    (sent,) = world.removals()
    pauses = []
    for _ in range(RETRIES - 1):
        world.refuse(sent)
        pause, again = world.wait_for_removal(2 * MAX)
        assert again is not None
        sent = again
        pauses.append(pause)
    assert pauses == pytest.approx([min(MAX, MIN * 2**n) for n in range(RETRIES - 1)], abs=TICK)
    assert pauses == sorted(pauses) and pauses[0] < pauses[-1]


def test_the_pause_is_jittered_within_half_and_one_and_a_half() -> None:
    factors = [Preempting().cluster.dispatcher.jitter() for _ in range(200)]
    assert all(0.5 <= f < 1.5 for f in factors) and len(set(factors)) > 100
    world = Preempting()
    world.cluster.dispatcher.jitter = lambda: 0.5
    (sent,) = world.removals()
    world.refuse(sent)
    pause, again = world.wait_for_removal(2 * MIN)
    assert again is not None and pause == pytest.approx(0.5 * MIN, abs=TICK)


def test_after_the_bound_one_event_says_so_and_it_is_never_chosen_again() -> None:
    world = Preempting()
    world.cluster.dispatcher.jitter = lambda: 1.0
    (sent,) = world.removals()
    for refused in range(1, RETRIES + 1):
        world.refuse(sent)
        if refused < RETRIES:
            _, again = world.wait_for_removal(2 * MAX)
            assert again is not None
            sent = again
    given_up = [e for e in world.events() if e.get("refusals") == RETRIES]
    assert len(given_up) == 1 and given_up[0]["type"] == EventType.FAILED
    assert given_up[0]["container"] == world.victims[0]
    before = len(world.events())
    _, again = world.wait_for_removal(10 * MAX)
    assert again is None and len(world.events()) == before
    victim, head = world.cluster.get(world.victims[0]), world.cluster.get(world.head)
    assert victim.state is State.RUNNING and victim.desired is State.RUNNING and head.state is State.QUEUED


def test_a_hundred_passes_against_a_refusing_node_write_a_handful_of_events() -> None:
    world = Preempting()
    before = len(world.events())
    for _ in range(100):
        for removal in world.removals():
            world.refuse(removal)
        world.clock.advance(TICK)
    # each refusal is two events (chosen, refused); without the backoff it was 200
    assert len(world.events()) - before <= 2 * RETRIES + 1


def test_another_victim_may_be_chosen_while_the_first_backs_off() -> None:
    world = Preempting(gpus=2)
    (first,) = world.removals()
    world.refuse(first)
    (second,) = world.removals()
    assert second.record.id != first.record.id and second.record.id in world.victims
    second_victim = second.record.id
    world.cluster.settle(second, Reply(ok=True), None)
    assert world.cluster.get(second_victim).state is State.PREEMPTED


def test_a_victim_that_ends_leaves_no_backoff_behind() -> None:
    world = Preempting(gpus=2)
    (first,) = world.removals()
    world.refuse(first)
    assert first.record.id in world.cluster.dispatcher.refused
    world.cluster.finish(first.record.id, State.EXITED, exit_code=0)
    world.removals()  # its room goes to the head, which is placed
    assert world.cluster.get(world.head).state is State.CREATING
    world.cluster.submit(spec(6 * U, priority=5), queue=True)  # another waits: a preemption is planned again
    assert world.cluster.dispatcher.refused == {}
