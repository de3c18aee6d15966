"""A partition is not a death: when many nodes go silent at once, none is forgotten and no confirm deadline expires.

Kubernetes' node-lifecycle rule for a disrupted zone, on the real model (:class:`Cluster`) and a logical
clock: the nodes that are not silent heartbeat once a second and the manager sweeps after each round.
Before the rule, six of ten nodes silent past ``forget_after`` were forgotten, their grants ended with them.
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from gpumgr.manager.config import ManagerSettings
from gpumgr.manager.model.cluster import Cluster, PlacementSpec
from gpumgr.wire import defaults
from gpumgr.wire.names import EventType, State
from gpumgr.wire.protocol import GpuInfo
from tests.lifecycle_model import LogicalClock

U = 1 << 30
FORGET_AFTER = 60.0
CONFIRM = 10.0  # seconds a grant waits for its node to confirm it
BEAT = 1.0


def spec(memory: int, **kw: Any) -> PlacementSpec:
    return PlacementSpec(memory=memory, count=1, placement="spread", image="img", command=[], **kw)


class Fleet:
    """``size`` one-GPU nodes; those in :attr:`silent` say nothing, the others heartbeat every second."""

    def __init__(self, size: int = 10) -> None:
        self.clock = LogicalClock()
        self.cluster = Cluster(clock=self.clock, forget_after=FORGET_AFTER)
        self.names = [f"n{i}" for i in range(size)]
        self.silent: set[str] = set()
        for name in self.names:
            self.register(name)

    def register(self, name: str) -> None:
        gpus = [GpuInfo(uuid=f"{name}-g0", index=0, name="Sim", memory_total=8 * U)]
        self.cluster.register(name, name.encode(), "docker", gpus, [])

    def creating(self, node: str) -> str:
        """A grant on ``node`` that waits for its node to confirm it (a runtime hook's: a deadline, no operation)."""
        return self.cluster.reserve(spec(U, node=node, hook=True), deadline=CONFIRM).id

    def run_for(self, seconds: float) -> None:
        """Let ``seconds`` pass a heartbeat at a time: the nodes not silent report, then the manager sweeps."""
        for _ in range(round(seconds / BEAT)):
            self.clock.advance(BEAT)
            for name in self.names:
                if name not in self.silent and self.cluster.heartbeat(name, name.encode(), [], []) is None:
                    self.register(name)  # back from down: a node registers again
            self.cluster.sweep()

    def known(self) -> set[str]:
        return set(self.cluster.ledger.nodes)

    def state(self, cid: str) -> State:
        return self.cluster.get(cid).state

    def disruption_events(self) -> list[dict[str, Any]]:
        return [e for e in self.cluster.events.since() if "disrupted" in e]


def test_six_of_ten_silent_at_once_are_not_forgotten_and_their_grants_wait() -> None:
    fleet = Fleet()
    silent = fleet.names[:6]
    grants = [fleet.creating(name) for name in silent]
    beside = fleet.creating("n9")  # on a node that stays up: its deadline passes during the disruption
    fleet.silent.update(silent)
    fleet.run_for(2 * FORGET_AFTER)
    assert fleet.cluster.reconciler.disrupted
    assert fleet.known() == set(fleet.names)
    assert [fleet.state(g) for g in grants] == [State.CREATING] * len(grants)
    assert fleet.state(beside) is State.CREATING
    (began,) = fleet.disruption_events()
    assert began["disrupted"] is True and began["type"] == EventType.NODE_DOWN and began["silent"] == 6


def test_their_return_ends_the_disruption_and_deadlines_run_again() -> None:
    fleet = Fleet()
    silent = fleet.names[:6]
    grants = [fleet.creating(name) for name in silent]
    fleet.silent.update(silent)
    fleet.run_for(2 * FORGET_AFTER)
    fleet.silent.clear()
    fleet.run_for(BEAT)
    assert not fleet.cluster.reconciler.disrupted and fleet.known() == set(fleet.names)
    began, ended = fleet.disruption_events()
    assert began["disrupted"] is True and ended["disrupted"] is False and ended["type"] == EventType.NODE_UP
    assert [fleet.state(g) for g in grants] == [State.CREATING] * len(grants)
    fleet.run_for(CONFIRM + 2 * fleet.cluster.down_after)  # nobody confirms them: they expire as ever
    assert [fleet.state(g) for g in grants] == [State.FAILED] * len(grants)
    assert len(fleet.disruption_events()) == 2


def test_a_partial_return_below_the_threshold_ends_it_and_the_rest_are_forgotten() -> None:
    fleet = Fleet()
    fleet.silent.update(fleet.names[:6])
    fleet.run_for(2 * FORGET_AFTER)
    fleet.silent.difference_update(fleet.names[:4])  # two stay silent: too few for a disruption
    fleet.run_for(BEAT)
    assert not fleet.cluster.reconciler.disrupted
    assert fleet.known() == set(fleet.names) - {"n4", "n5"}


def test_one_silent_node_of_ten_is_forgotten_after_forget_after() -> None:
    fleet = Fleet()
    grant = fleet.creating("n0")
    fleet.silent.add("n0")
    fleet.run_for(FORGET_AFTER - BEAT)
    assert "n0" in fleet.known()
    fleet.run_for(3 * BEAT)
    assert "n0" not in fleet.known() and fleet.state(grant) is State.REMOVED
    assert not fleet.cluster.reconciler.disrupted and fleet.disruption_events() == []


def test_fewer_than_the_least_count_is_no_disruption_whatever_the_fraction() -> None:
    fleet = Fleet(size=defaults.DISRUPTION_MIN_NODES)
    fleet.silent.update(fleet.names[:-1])  # all but one, but fewer than the least count
    fleet.run_for(FORGET_AFTER + 3 * BEAT)
    assert fleet.known() == {fleet.names[-1]} and fleet.disruption_events() == []


def test_nodes_going_silent_one_by_one_are_deaths_not_a_partition() -> None:
    fleet = Fleet()
    for name in fleet.names[:6]:  # one every few down timeouts
        fleet.silent.add(name)
        fleet.run_for(3 * fleet.cluster.down_after)
    assert not fleet.cluster.reconciler.disrupted
    fleet.run_for(FORGET_AFTER)
    assert fleet.known() == set(fleet.names[6:]) and fleet.disruption_events() == []


def test_every_node_silent_at_once_is_the_managers_own_partition() -> None:
    fleet = Fleet()
    fleet.silent.update(fleet.names)
    fleet.run_for(2 * FORGET_AFTER)
    assert fleet.cluster.reconciler.disrupted and fleet.known() == set(fleet.names)


def test_the_threshold_is_a_fraction_of_the_nodes() -> None:
    assert ManagerSettings().disruption_threshold == defaults.DISRUPTION_THRESHOLD == 0.55
    assert ManagerSettings(disruption_threshold=1).disruption_threshold == 1
    for wrong in (0, -0.1, 1.01):
        with pytest.raises(ValidationError):
            ManagerSettings(disruption_threshold=wrong)


def test_a_higher_threshold_takes_six_of_ten_for_deaths() -> None:
    fleet = Fleet()
    fleet.cluster.reconciler.disruption_threshold = 0.7
    fleet.silent.update(fleet.names[:6])
    fleet.run_for(FORGET_AFTER + 3 * BEAT)
    assert fleet.known() == set(fleet.names[6:])
