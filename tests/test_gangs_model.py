"""Gangs on the cluster map (issue 35): all or none, the rendezvous handed to each member, waiting whole and
holding nothing, and how a gang ends (every member exits 0, or the first failure stops the others)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gpumgr.manager.model.cluster import Cluster
from gpumgr.manager.model.gangs import GangSpec
from gpumgr.manager.model.records import Command, OpKind, PlacementSpec
from gpumgr.manager.tenancy.tenants import OPERATOR
from gpumgr.wire.errors import NoFit
from gpumgr.wire.names import LIVE, State
from gpumgr.wire.protocol import ContainerReport, GpuInfo, Reply
from tests.invariant import model_violations
from tests.lifecycle_model import LogicalClock

G = 8 << 30


def member(memory: int = G, count: int = 1, **kw: object) -> PlacementSpec:
    return PlacementSpec(memory=memory, count=count, placement="spread", image="img", command=["train"], **kw)


class Map:
    """A cluster map of single-GPU nodes that answer every command at once."""

    def __init__(self, nodes: int = 4) -> None:
        self.clock = LogicalClock()
        self.cluster = Cluster(clock=self.clock)
        for n in range(nodes):
            self.cluster.register(f"n{n}", f"n{n}".encode(), "docker",
                                  [GpuInfo(uuid=f"n{n}-g0", index=0, name="Sim", memory_total=G)], [],
                                  advertise_addr=f"10.0.0.{n + 1}")

    def answer(self, commands: list[Command]) -> None:
        for command in commands:
            record = command.record
            if command.kind is OpKind.CREATE:
                report = ContainerReport(grant=record.id, container_id=f"c-{record.id}", gpus=record.gpus,
                                         gpu_memory=record.gpu_memory, state="running")
                self.cluster.settle(command, Reply(ok=True, result=report.model_dump()), None)
            else:
                self.cluster.settle(command, Reply(ok=True), None)

    def gang(self, replicas: int = 4, **kw: object) -> tuple[str, list[Command]]:
        queue = bool(kw.pop("queue", False))
        gang, commands = self.cluster.submit_gang(GangSpec(member(), replicas, **kw), queue=queue)  # type: ignore[arg-type]
        return gang.id, commands

    def view(self, gid: str) -> dict:
        return self.cluster.gang_views(OPERATOR, gid)[0]

    def dispatch(self, seconds: float = 1.0) -> None:
        self.clock.advance(seconds)
        commands, _ = self.cluster.dispatch()
        self.answer(commands)

    def check(self) -> None:
        assert model_violations(SimpleNamespace(cluster=self.cluster)) == []
        for gang in self.cluster.gangs.gangs.values():  # no gang is partly placed
            live = [m for m in gang.members if self.cluster.get(m).state in LIVE]
            assert len(live) in (0, gang.spec.replicas) or gang.state in ("restarting", "failed", "killed",
                                                                          "removed", "exited", "preempted")


def test_a_gang_is_placed_whole_one_member_per_node_with_its_rendezvous() -> None:
    world = Map()
    gid, commands = world.gang(4)
    assert len(commands) == 4
    world.answer(commands)
    world.dispatch()
    view = world.view(gid)
    assert view["state"] == "running" and len(view["members"]) == 4
    records = [world.cluster.get(m) for m in view["members"]]
    assert sorted(r.node for r in records) == ["n0", "n1", "n2", "n3"]
    master = records[0]
    for rank, record in enumerate(records):
        env = record.env
        assert (record.gang, record.rank) == (gid, rank)
        assert env["GPUMGR_GANG"] == gid and env["GPUMGR_GANG_RANK"] == str(rank) and env["GPUMGR_GANG_SIZE"] == "4"
        assert env["PET_NNODES"] == "4" and env["PET_NODE_RANK"] == str(rank) and env["PET_NPROC_PER_NODE"] == "1"
        assert env["PET_MASTER_ADDR"] == f"10.0.0.{int(master.node[1:]) + 1}" and env["PET_MASTER_PORT"] == "29500"
        assert env["PET_RDZV_ID"] == view["rdzv_id"]
        assert record.labels["gpumgr.gang"] == gid and record.labels["gpumgr.gang.rank"] == str(rank)
    world.check()


def test_five_members_on_four_nodes_never_fit_and_a_busy_node_is_no_fit_now() -> None:
    world = Map()
    with pytest.raises(NoFit) as never:
        world.gang(5)
    assert never.value.code == "never_fits"
    _, create = world.cluster.submit(member())
    world.answer(create)
    with pytest.raises(NoFit) as now:
        world.gang(4)
    assert now.value.code == "no_fit"
    assert world.cluster.gang_views(OPERATOR) == []  # nothing was kept
    world.check()


def test_a_waiting_gang_holds_nothing_and_starts_whole_once_room_frees() -> None:
    world = Map()
    busy, create = world.cluster.submit(member())
    world.answer(create)
    gid, commands = world.gang(4, queue=True)
    assert commands == [] and world.view(gid)["state"] == "queued" and world.view(gid)["queue"] == {"position": 1}
    reserved = sum(g.reserved for n in world.cluster.ledger.nodes.values() for g in n.gpus)
    assert reserved == G  # only the busy container's grant: the gang holds nothing
    world.dispatch()
    assert world.view(gid)["state"] == "queued"
    world.cluster.finish(busy.id, State.EXITED, exit_code=0)
    world.dispatch()
    world.dispatch()
    assert world.view(gid)["state"] == "running" and len(world.view(gid)["members"]) == 4
    world.check()


def test_two_gangs_at_once_run_one_after_the_other_never_both_partly() -> None:
    world = Map()
    first, commands = world.gang(3, queue=True)
    world.answer(commands)
    second, commands = world.gang(3, queue=True)
    assert commands == [] and world.view(second)["state"] == "queued"
    world.dispatch()
    world.check()
    for cid in world.view(first)["members"]:
        world.cluster.finish(cid, State.EXITED, exit_code=0)
    assert world.view(first)["state"] == "exited" and world.view(first)["exit_code"] == 0
    world.dispatch()
    world.dispatch()
    assert world.view(second)["state"] == "running"
    world.check()


def test_the_first_failure_ends_the_gang_and_stops_the_others() -> None:
    world = Map()
    gid, commands = world.gang(4)
    world.answer(commands)
    members = world.view(gid)["members"]
    world.cluster.finish(members[2], State.KILLED, reason="killed by a signal", exit_code=137)
    view = world.view(gid)
    assert view["state"] == "killed" and "member 2" in view["reason"]
    world.dispatch()  # the others' removals go out and are answered
    assert [world.cluster.get(m).state for m in members] == [State.REMOVED, State.REMOVED, State.KILLED,
                                                             State.REMOVED]
    assert all(world.cluster.get(m).reason and gid in (world.cluster.get(m).reason or "")
               for m in members if m != members[2])
    world.check()


def test_every_member_exiting_0_within_the_grace_ends_the_gang_exited_and_a_late_one_fails_it() -> None:
    world = Map()
    gid, commands = world.gang(2)
    world.answer(commands)
    for cid in world.view(gid)["members"]:
        world.cluster.finish(cid, State.EXITED, exit_code=0)
    assert world.view(gid)["state"] == "exited"
    late, commands = world.gang(2)
    world.answer(commands)
    world.cluster.finish(world.view(late)["members"][0], State.EXITED, exit_code=0)
    world.dispatch(world.cluster.gangs.exit_grace + 1)
    assert world.view(late)["state"] == "failed" and "gang_exit_grace" in world.view(late)["reason"]
    world.dispatch()
    world.check()


def test_restart_gang_places_it_again_whole_with_the_same_rendezvous_id() -> None:
    world = Map()
    gid, commands = world.gang(2, restart="gang", max_restarts=1)
    world.answer(commands)
    first = world.view(gid)
    world.cluster.finish(first["members"][0], State.EXITED, exit_code=3)
    assert world.view(gid)["state"] == "restarting"
    world.dispatch()  # the other member is stopped
    world.dispatch()  # then the gang is placed again, whole and fresh
    again = world.view(gid)
    assert again["state"] == "running" and again["restart_count"] == 1
    assert again["rdzv_id"] == first["rdzv_id"] and set(again["members"]).isdisjoint(first["members"])
    assert world.cluster.get(again["members"][0]).env["PET_RDZV_ID"] == first["rdzv_id"]
    world.cluster.finish(again["members"][1], State.EXITED, exit_code=1)  # the restarts are spent
    world.dispatch()
    assert world.view(gid)["state"] == "failed"
    world.check()


def test_delete_ends_the_gang_and_withdraws_a_waiting_one() -> None:
    world = Map()
    gid, commands = world.gang(2)
    world.answer(commands)
    gang, removals = world.cluster.remove_gang(gid)
    world.answer(removals)
    assert gang.state == "removed" and all(world.cluster.get(m).state is State.REMOVED for m in gang.members)
    busy = [world.cluster.submit(member())[1] for _ in range(4)]
    for create in busy:
        world.answer(create)
    waiting, _ = world.gang(2, queue=True)
    gang, removals = world.cluster.remove_gang(waiting)
    assert gang.state == "removed" and removals == [] and world.cluster.gangs.waiting == []
    world.check()


def test_after_gang_reserve_after_a_stream_of_small_requests_cannot_starve_a_waiting_gang() -> None:
    world = Map()
    world.cluster.gangs.reserve_after = 30.0
    small = [world.cluster.submit(member(4 << 30))[0] for _ in range(8)]  # every GPU half full, twice over
    world.answer([c for r in small for c in ([Command(OpKind.CREATE, r, r.op)] if r.op else [])])
    gid, _ = world.gang(4, queue=True)

    def churn() -> None:
        """One small container ends and a new one asks for the room at once (a stream of small work)."""
        running = [r for r in world.cluster.containers() if r.state is State.RUNNING and r.gang is None]
        if running:
            world.cluster.finish(running[0].id, State.EXITED, exit_code=0)
        try:
            _, commands = world.cluster.submit(member(4 << 30))
            world.answer(commands)
        except NoFit:
            pass
        world.dispatch(5.0)

    for _ in range(5):  # before the reservation, backfill takes every freed half: the gang waits
        churn()
    assert world.view(gid)["state"] == "queued"
    for _ in range(30):
        churn()
        if world.view(gid)["state"] == "running":
            break
        held = sum(world.cluster.gangs.held_for(f"n{n}-g0") for n in range(4))
        assert held == 0 or world.view(gid)["state"] == "queued"
        world.check()
    assert world.view(gid)["state"] == "running", "the gang starved behind small requests"
    nodes = world.cluster.nodes_view(OPERATOR)
    assert all(g["memory_reserved_for_gang"] == 0 for n in nodes for g in n["gpus"])  # released once placed
    world.check()


def test_a_restarted_manager_rebuilds_a_gang_from_its_members_labels() -> None:
    world = Map()
    gid, commands = world.gang(3, restart="gang", max_restarts=2)
    world.answer(commands)
    before = world.view(gid)
    members = [world.cluster.get(m) for m in before["members"]]
    again = Map(nodes=0)  # a new manager process: its map starts from nothing
    for record in reversed(members):  # the nodes register in any order
        report = ContainerReport(grant=record.id, container_id=f"c-{record.id}", gpus=record.gpus,
                                 gpu_memory=record.gpu_memory, state="running", labels=record.labels,
                                 name=record.name, image="img")
        again.cluster.register(record.node, record.node.encode(), "docker",
                               [GpuInfo(uuid=record.gpus[0], index=0, name="Sim", memory_total=G)], [report],
                               advertise_addr=f"10.0.0.{int(record.node[1:]) + 1}")
    rebuilt = again.view(gid)
    assert rebuilt["state"] == "running" and rebuilt["members"] == before["members"]
    for key in ("rdzv_id", "master_addr", "master_port", "replicas", "restart", "max_restarts"):
        assert rebuilt[key] == before[key], key
    assert [again.cluster.get(m).rank for m in rebuilt["members"]] == [0, 1, 2]
    again.cluster.finish(rebuilt["members"][1], State.EXITED, exit_code=2)  # it still ends as one
    assert again.view(gid)["state"] == "restarting"
    again.dispatch()
    again.check()


def test_a_rebuilt_gang_whose_members_do_not_all_come_back_fails_after_gang_grace() -> None:
    world = Map()
    gid, commands = world.gang(2)
    world.answer(commands)
    record = world.cluster.get(world.view(gid)["members"][0])
    again = Map(nodes=0)
    again.cluster.gangs.node_grace = 10.0
    report = ContainerReport(grant=record.id, container_id=f"c-{record.id}", gpus=record.gpus,
                             gpu_memory=record.gpu_memory, state="running", labels=record.labels, image="img")
    again.cluster.register(record.node, record.node.encode(), "docker",
                           [GpuInfo(uuid=record.gpus[0], index=0, name="Sim", memory_total=G)], [report])
    again.dispatch(5.0)
    assert again.view(gid)["state"] == "creating"
    again.dispatch(6.0)
    assert again.view(gid)["state"] == "failed" and "never came back" in again.view(gid)["reason"]
    again.dispatch()
    assert again.cluster.get(record.id).state is State.REMOVED
    again.check()


def test_delete_of_an_ended_gang_removes_its_members_containers() -> None:
    world = Map()
    gid, commands = world.gang(2)
    world.answer(commands)
    assert world.view(gid)["state"] == "running"
    for cid in world.view(gid)["members"]:
        world.cluster.finish(cid, State.EXITED, exit_code=0)
    gang, removals = world.cluster.remove_gang(gid)
    assert gang.state == "exited" and len(removals) == 2 and {c.kind for c in removals} == {OpKind.REMOVE}
    world.answer(removals)
    assert all(world.cluster.get(m).state is State.REMOVED for m in gang.members)
    world.check()


def test_a_waiting_gang_is_one_journal_entry_and_waits_again_after_a_restart(tmp_path) -> None:
    from gpumgr.manager.model.queue import QueueJournal

    world = Map()
    world.cluster.journal = world.cluster.life.journal = QueueJournal(tmp_path)
    _, create = world.cluster.submit(member())
    world.answer(create)
    gid, _ = world.gang(4, queue=True, restart="gang", max_restarts=1)
    entries = QueueJournal(tmp_path).load()
    assert [e["id"] for e in entries] == [gid] and entries[0]["gang"]["replicas"] == 4
    again = Map()  # a new manager process on the same state directory (its nodes have registered again)
    again.cluster.journal = again.cluster.life.journal = QueueJournal(tmp_path)
    assert again.cluster.restore_queue(again.cluster.journal.load()) == 1
    view = again.view(gid)
    assert view["state"] == "queued" and view["rdzv_id"] == world.view(gid)["rdzv_id"]
    assert view["max_restarts"] == 1 and view["replicas"] == 4
    again.dispatch()
    assert again.view(gid)["state"] == "running"
    assert QueueJournal(tmp_path).load() == []  # placed: its entry is gone
    again.check()


def test_with_accounts_a_gang_waits_and_borrows_as_one_request_of_its_whole_bytes() -> None:
    from gpumgr.manager.tenancy.accounts import AccountConfig, build_accounts
    from gpumgr.manager.tenancy.tenants import Tenant, TenantBook
    from gpumgr.wire.errors import Conflict

    world = Map()
    team = Tenant("team", b"team-token-0123456789", None, None, 5)
    world.cluster.tenants = TenantBook({"team": team}, "operator-token-0000")
    world.cluster.accounts = build_accounts({"a": AccountConfig(quota={"gpu_memory": 2 * G})}, {"team": "a"})
    with pytest.raises(Conflict) as refused:  # 3 × 8 GiB past a's 16 GiB, and not preemptible
        world.cluster.submit_gang(GangSpec(member(), 3), tenant=team)
    assert refused.value.code == "over_quota"
    waiting, _ = world.cluster.submit_gang(GangSpec(member(), 3), tenant=team, queue=True)
    view = {a["name"]: a for a in world.cluster.accounts_view(OPERATOR) or []}
    assert view["a"]["waiting"] == 3 * G and view["a"]["requested"] == 3 * G  # one request, its whole bytes
    world.dispatch()
    assert world.view(waiting.id)["state"] == "queued"
    world.cluster.remove_gang(waiting.id)
    borrowing, commands = world.cluster.submit_gang(GangSpec(member(preemptible=True), 3), tenant=team)
    world.answer(commands)
    members = [world.cluster.get(m) for m in borrowing.members]
    assert world.view(borrowing.id)["state"] == "running" and [m.over_quota for m in members] == [False, False, True]
    world.check()


def test_a_member_on_a_node_that_went_down_is_waited_for_gang_grace_then_the_gang_ends() -> None:
    from gpumgr.wire.protocol import ContainerStatus, GpuSample

    world = Map()
    world.cluster.gangs.node_grace = 20.0
    gid, commands = world.gang(2)
    world.answer(commands)
    members = [world.cluster.get(m) for m in world.view(gid)["members"]]
    lost = members[1].node

    def heartbeat() -> None:  # every node but the lost one
        for n in range(4):
            name = f"n{n}"
            if name != lost:
                statuses = [ContainerStatus(grant=m.id, container_id=f"c-{m.id}", state="running")
                            for m in members if m.node == name]
                world.cluster.heartbeat(name, name.encode(), [GpuSample(uuid=f"{name}-g0", memory_used=0,
                                                                        memory_unmanaged=0)], statuses)

    for _ in range(4):  # its node goes silent and is marked down; one node of four is no partition
        world.clock.advance(world.cluster.down_after / 2 + 0.1)
        heartbeat()
        world.cluster.sweep()
    assert not world.cluster.ledger.nodes[lost].ready and not world.cluster.reconciler.disrupted
    world.dispatch(1.0)
    assert world.view(gid)["state"] == "running"  # waited for, within gang_grace
    for _ in range(5):
        heartbeat()
        world.dispatch(5.0)
    view = world.view(gid)
    assert view["state"] == "failed" and "gang_grace" in view["reason"] and lost in view["reason"]
    world.check()


def test_waiting_gangs_are_tried_by_priority_then_first_come() -> None:
    world = Map()
    busy = [world.cluster.submit(member())[0] for _ in range(4)]
    world.answer([Command(OpKind.CREATE, r, r.op) for r in busy if r.op is not None])
    low, _ = world.cluster.submit_gang(GangSpec(member(priority=0), 2), queue=True)
    high, _ = world.cluster.submit_gang(GangSpec(member(priority=3), 2), queue=True)
    assert world.cluster.gangs.in_order() == [high.id, low.id]
    world.cluster.finish(busy[0].id, State.EXITED, exit_code=0)
    world.cluster.finish(busy[1].id, State.EXITED, exit_code=0)
    world.dispatch()
    assert world.view(high.id)["state"] == "running" and world.view(low.id)["state"] == "queued"
    world.check()


def test_a_waiting_gang_preempts_lower_priority_preemptible_containers_as_one_request_of_its_priority() -> None:
    world = Map()
    low = [world.cluster.submit(member(priority=1, preemptible=True))[0] for _ in range(3)]
    steady, create = world.cluster.submit(member(priority=0))  # not preemptible: never stopped
    world.answer(create + [Command(OpKind.CREATE, r, r.op) for r in low if r.op is not None])
    gid, _ = world.gang(2, queue=True)
    assert world.view(gid)["state"] == "queued"  # member() is priority 0: nothing of priority 1 is its to stop
    world.cluster.remove_gang(gid)
    high, _ = world.cluster.submit_gang(GangSpec(member(priority=5), 3), queue=True)
    world.dispatch()  # the three low containers are chosen (every GPU is busy; the steady one is no candidate)
    world.dispatch()  # their removals go out and are answered
    world.dispatch()  # the gang is placed whole on the room they left
    assert world.view(high.id)["state"] == "running"
    preempted = [r for r in low if world.cluster.get(r.id).state is State.PREEMPTED]
    assert len(preempted) == 3 and all(r.preempted_for == high.id for r in preempted)
    assert world.cluster.get(steady.id).state is State.RUNNING
    world.check()
