"""A waiting gang with accounts (issues 34 and 35): an entry of its account's line in the fair walk, owed room
like a single request when its account is below its fair share, and reclaimed for as one request of its whole
bytes, so that it fits whole; never for part of it, never a within-quota container, never while the zone rule
holds, and never in a loop."""

from __future__ import annotations

import pytest

from gpumgr.manager.model.gangs import Gang, GangSpec
from gpumgr.manager.model.records import PlacementSpec
from gpumgr.manager.tenancy.tenants import OPERATOR
from gpumgr.wire.errors import NoFit
from gpumgr.wire.names import State
from tests.accounts_model import Accounts

G = 8 << 30


def gang(sim: Accounts, account: str, replicas: int, count: int = 1, **kw: object) -> Gang:
    """A waiting gang of ``account``: ``replicas`` members of ``count`` whole GPUs each, one per node."""
    member = PlacementSpec(memory=G, count=count, placement="spread", image="img", command=["train"], **kw)  # type: ignore[arg-type]
    waiting, commands = sim.cluster.submit_gang(GangSpec(member, replicas), tenant=sim.tenants[account], queue=True)
    assert commands == [] and waiting.state == "queued"
    return waiting


def members(sim: Accounts, waiting: Gang) -> list:
    return [sim.cluster.get(m) for m in waiting.members]


def state(sim: Accounts, waiting: Gang) -> str:
    """The gang's state as the API shows it (``running`` once every member runs)."""
    return str(sim.cluster.gang_views(OPERATOR, waiting.id)[0]["state"])


def test_reclaim_stops_just_enough_over_quota_containers_for_the_whole_gang_and_then_never_again() -> None:
    accounts = {"a": {"quota": {"gpu_memory": 2 * G}, "reclaim_min_runtime": 5},
                "b": {"quota": {"gpu_memory": 4 * G}, "reclaim_min_runtime": 5}}
    sim = Accounts(accounts, nodes=8, gpus=1, gpu_memory=G)
    borrowed = sim.ask("a", 8)  # the whole cluster: two within a's quota, six borrowed
    assert [r.over_quota for r in borrowed] == [False] * 2 + [True] * 6
    waiting = gang(sim, "b", 4)
    assert sim.view()["b"]["waiting"] == 4 * G and sim.fair_gpus("b") == 4 and sim.fair_gpus("a") == 4
    assert sim.step(1.0) == []  # the borrowers have run 1 s of their reclaim_min_runtime
    stopped = sim.step(5.0, resubmit=True)  # a's stopped jobs ask again at once, as a service's would
    assert len(stopped) == 4, "just enough for the gang's four members, of a's six borrowed containers"
    for victim in stopped:
        assert victim.account == "a" and victim.over_quota and victim.reason == "reclaimed"
        assert victim.detail["reclaimed_for_account"] == "b" and victim.preempted_for == waiting.id
    sim.step()
    assert state(sim, waiting) == "running" and all(m.state is State.RUNNING for m in members(sim, waiting))
    assert len({m.node for m in members(sim, waiting)}) == 4  # whole, one member per node
    assert all(sim.cluster.get(r.id).state is State.RUNNING for r in borrowed[:2])  # within quota: never stopped
    again = [r for r in sim.cluster.containers() if r.account == "a" and r.state is State.QUEUED]
    assert len(again) == 4  # the freed room went to the gang, not to a's requests asking again
    assert (sim.gpus_of("a"), sim.gpus_of("b")) == (4, 4)
    reclaims = sim.cluster.dispatcher.fair.reclaims
    for _ in range(300):  # settled: five minutes of a asking again bring no reclaim either way
        assert sim.step(1.0, resubmit=True) == []
    assert sim.cluster.dispatcher.fair.reclaims == reclaims and state(sim, waiting) == "running"
    assert (sim.gpus_of("a"), sim.gpus_of("b")) == (4, 4)
    sim.check()


def test_a_gang_that_would_fit_only_by_stopping_within_quota_containers_gets_nothing_stopped() -> None:
    """Each node holds one of a's within-quota containers and one borrowed: a member of two GPUs of one node
    fits nowhere without the within-quota one, so nothing is stopped for part of the gang; once two within-quota
    containers end by themselves, exactly the two borrowed containers beside them are reclaimed."""
    accounts = {"a": {"quota": {"gpu_memory": 4 * G}, "reclaim_min_runtime": 1},
                "b": {"quota": {"gpu_memory": 4 * G}, "reclaim_min_runtime": 1}}
    sim = Accounts(accounts, nodes=4, gpus=2, gpu_memory=G)
    steady = []
    for n in range(4):
        spec = PlacementSpec(memory=G, count=1, placement="spread", image="img", command=[], node=f"n{n}")
        record, commands = sim.cluster.submit(spec, tenant=sim.tenants["a"])
        sim.answer(commands)
        steady.append(record)
    borrowed = sim.ask("a", 4)
    assert not any(r.over_quota for r in steady) and all(r.over_quota for r in borrowed)
    assert sorted(r.node for r in borrowed) == ["n0", "n1", "n2", "n3"]
    waiting = gang(sim, "b", 2, count=2)
    for _ in range(20):
        assert sim.step(1.0) == []
    assert state(sim, waiting) == "queued" and all(r.state is State.RUNNING for r in steady + borrowed)
    assert not any(r.desired is State.PREEMPTED for r in sim.cluster.containers())
    for record in steady[:2]:
        sim.cluster.finish(record.id, State.EXITED, exit_code=0)
    stopped = sim.step(1.0)
    assert sorted(r.node for r in stopped) == ["n0", "n1"] and all(r.over_quota for r in stopped)
    sim.step()
    assert state(sim, waiting) == "running" and sorted(m.node for m in members(sim, waiting)) == ["n0", "n1"]
    assert all(r.state is State.RUNNING for r in steady[2:])
    sim.check()


def test_nothing_is_reclaimed_for_a_gang_while_the_zone_rule_holds() -> None:
    accounts = {"a": {"quota": {"gpu_memory": G}, "reclaim_min_runtime": 0},
                "b": {"quota": {"gpu_memory": 2 * G}, "reclaim_min_runtime": 0}}
    sim = Accounts(accounts, nodes=10, gpus=1, gpu_memory=G)
    held = sim.ask("a", 10)
    alive, silent = [f"n{i}" for i in range(4)], [f"n{i}" for i in range(4, 10)]
    sim.partition(alive, held)  # six of ten silent at once: a partition, not six deaths
    waiting = gang(sim, "b", 2)
    for _ in range(3):
        assert sim.step(0.5) == []
        sim.heartbeat(alive, held)
    assert state(sim, waiting) == "queued"
    sim.heal(silent, alive, held)
    stopped = sim.step(0.5)
    assert len(stopped) == 2 and all(r.reason == "reclaimed" and r.preempted_for == waiting.id for r in stopped)
    sim.step()
    assert state(sim, waiting) == "running"
    sim.check()


def test_while_a_gang_is_owed_room_other_accounts_do_not_borrow_what_frees() -> None:
    """a borrowed the cluster and asks for more; b, below its fair share, waits with a gang of three. Room that
    frees by itself (none of a's containers has run its reclaim_min_runtime) is not borrowed back by a while
    b is owed, by a queued request, a new one or a new gang: the gang starts whole once the third GPU frees."""
    accounts = {"a": {"quota": {"gpu_memory": 0}, "reclaim_min_runtime": 1000},
                "b": {"quota": {"gpu_memory": 4 * G}, "reclaim_min_runtime": 1000}}
    sim = Accounts(accounts, nodes=4, gpus=1, gpu_memory=G)
    borrowed = sim.ask("a", 4)
    waiting = gang(sim, "b", 3)
    later = sim.ask("a", 2)  # a asks for more: it may only borrow
    assert all(r.state is State.QUEUED for r in later)
    for record in borrowed[:2]:
        sim.cluster.finish(record.id, State.EXITED, exit_code=0)
        sim.step()
        assert all(r.state is State.QUEUED for r in later)  # the free GPUs wait for the gang
    assert state(sim, waiting) == "queued"
    member = PlacementSpec(memory=G, count=1, placement="spread", image="img", command=[], preemptible=True)
    with pytest.raises(NoFit):  # a new gang of a, or a request that will not wait, jumps no line either
        sim.cluster.submit_gang(GangSpec(member, 2), tenant=sim.tenants["a"])
    with pytest.raises(NoFit):
        sim.ask("a", 1, queue=False)
    assert [g.id for g in sim.cluster.gangs.gangs.values()] == [waiting.id]  # nothing of the refused gang stays
    sim.cluster.finish(borrowed[2].id, State.EXITED, exit_code=0)
    sim.step()
    sim.step()
    assert state(sim, waiting) == "running" and all(r.state is State.QUEUED for r in later)
    assert sim.reclaimed == []  # none of a's containers had run reclaim_min_runtime
    sim.check()


def test_a_gang_submitted_while_others_wait_takes_its_turn_and_only_a_waiting_one_is_journaled(tmp_path) -> None:
    from gpumgr.manager.model.queue import QueueJournal

    accounts = {"a": {"quota": {"gpu_memory": 0}}, "b": {"quota": {"gpu_memory": 4 * G}}}
    sim = Accounts(accounts, nodes=4, gpus=1, gpu_memory=G)
    sim.cluster.journal = sim.cluster.life.journal = QueueJournal(tmp_path)
    (held,) = sim.ask("a", 1, preemptible=False)  # past a's quota and not preemptible: it waits in line
    assert held.state is State.QUEUED
    member = PlacementSpec(memory=G, count=1, placement="spread", image="img", command=["train"])
    placed, commands = sim.cluster.submit_gang(GangSpec(member, 2), tenant=sim.tenants["b"])
    assert placed.state == "creating" and len(commands) == 2  # its turn came in the walk, and it fit whole
    sim.answer(commands)
    waiting = gang(sim, "b", 3)  # two GPUs are left: it waits
    assert [e["id"] for e in QueueJournal(tmp_path).load()] == [held.id, waiting.id]
    assert placed.id not in (tmp_path / "queue.jsonl").read_text()  # its try wrote nothing there
    assert sim.cluster.gangs.to_send == [] and sim.cluster.gangs.trying is None
    sim.check()


def running_gang(sim: Accounts, account: str, replicas: int) -> Gang:
    """A preemptible gang of ``account`` placed at once, ``replicas`` members of one whole GPU each, running."""
    member = PlacementSpec(memory=G, count=1, placement="spread", image="img", command=["train"], preemptible=True)
    placed, commands = sim.cluster.submit_gang(GangSpec(member, replicas), tenant=sim.tenants[account])
    sim.answer(commands)
    assert state(sim, placed) == "running"
    return placed


def test_a_running_gang_with_a_member_within_quota_is_never_reclaimed() -> None:
    """A running gang is reclaimed as one: stopping its over-quota member would end its within-quota members too
    (and free far more than reclaim weighed), so a gang with any member within quota is never a victim."""
    accounts = {"a": {"quota": {"gpu_memory": 2 * G}, "reclaim_min_runtime": 1},
                "b": {"quota": {"gpu_memory": 2 * G}, "reclaim_min_runtime": 1}}
    sim = Accounts(accounts, nodes=4, gpus=1, gpu_memory=G)
    borrowing = running_gang(sim, "a", 4)
    assert [m.over_quota for m in members(sim, borrowing)] == [False, False, True, True]
    sim.ask("b", 1)
    for _ in range(20):
        assert sim.step(1.0) == []
    assert state(sim, borrowing) == "running" and sim.gpus_of("a") == 4
    sim.check()


def test_a_running_gang_wholly_over_quota_is_reclaimed_whole_counting_all_its_bytes() -> None:
    """Every member of a's gang borrows: reclaim for b's first request takes the whole gang (its two GPUs weighed
    by the rule), which is room for b's second request too, so nothing more is stopped."""
    accounts = {"a": {"quota": {"gpu_memory": 0}, "reclaim_min_runtime": 1},
                "b": {"quota": {"gpu_memory": 2 * G}, "reclaim_min_runtime": 1}}
    sim = Accounts(accounts, nodes=4, gpus=1, gpu_memory=G)
    borrowing = running_gang(sim, "a", 2)
    sim.step(1.0)
    singles = sim.ask("a", 2)  # too young to be reclaimed: the gang is what reclaim may stop
    sim.ask("b", 2)
    stopped = sim.step(1.0)
    assert sorted(r.id for r in stopped) == sorted(borrowing.members)
    for victim in stopped:  # each member ends as reclaim's victim, not as "removed" with its gang
        assert (victim.reason, victim.detail["reclaimed_for_account"]) == ("reclaimed", "b")
    assert state(sim, borrowing) == "preempted"
    for _ in range(20):
        assert sim.step(1.0) == []
    assert (sim.gpus_of("a"), sim.gpus_of("b")) == (2, 2) and all(r.state is State.RUNNING for r in singles)
    sim.check()


def test_a_member_reclaimed_with_its_gang_whose_stop_is_refused_is_asked_again_and_never_runs_on() -> None:
    from gpumgr.manager.model.records import OpKind
    from gpumgr.wire.protocol import ContainerStatus, ErrorBody, GpuSample, Reply

    accounts = {"a": {"quota": {"gpu_memory": 0}, "reclaim_min_runtime": 1},
                "b": {"quota": {"gpu_memory": 2 * G}, "reclaim_min_runtime": 1}}
    sim = Accounts(accounts, nodes=4, gpus=1, gpu_memory=G)
    borrowing = running_gang(sim, "a", 2)
    sim.step(1.0)
    sim.ask("a", 2)  # too young to be reclaimed, as above
    spec = PlacementSpec(memory=G, count=1, placement="spread", image="img", command=[], preemptible=True)
    commands = [c for _ in range(2) for c in sim.cluster.submit(spec, queue=True, tenant=sim.tenants["b"])[1]]
    commands += sim.cluster.dispatch()[0]
    first, second = sorted((c for c in commands if c and c.kind is OpKind.REMOVE), key=lambda c: c.record.rank or 0)
    sim.cluster.settle(first, Reply(ok=True), None)  # the gang ends: the other member was reclaimed with it
    sim.cluster.settle(second, Reply(ok=False, error=ErrorBody(code="engine", message="refused")), None)
    assert second.record.desired is State.PREEMPTED and state(sim, borrowing) == "preempted"
    victim = second.record
    beat = sim.cluster.heartbeat(victim.node, victim.node.encode(), [GpuSample(uuid=victim.gpus[0], memory_used=0,
                                 memory_unmanaged=0)], [ContainerStatus(grant=victim.id, container_id=f"c-{victim.id}",
                                                                        state="running")])
    assert beat is not None
    again = [c for c in beat[1] if c.kind is OpKind.REMOVE]
    assert [c.record.id for c in again] == [victim.id]  # its node's next heartbeat carries the stop out
    sim.answer(again)
    sim.step()
    assert (victim.state, victim.reason) == (State.PREEMPTED, "reclaimed") and sim.gpus_of("b") == 2
    sim.check()
