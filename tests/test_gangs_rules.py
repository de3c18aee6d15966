"""Gangs' rules on the cluster map (issue 35), beside ``test_gangs_model.py``: the zone rule pausing
``gang_grace``, master ports taken per host and released, a gang's ``queue_timeout``, and where the master is
(rank 0's node with host networking and ``NCCL_SOCKET_IFNAME``; rank 0's container name on a named network),
and the address an agent advertises by default."""

from __future__ import annotations

import pytest

from gpumgr.manager.model.gangs import GangSpec
from gpumgr.wire.errors import NoFit
from gpumgr.wire.names import State
from gpumgr.wire.protocol import ContainerReport, ContainerStatus, GpuInfo, GpuSample
from tests.accounts_model import account_tree
from tests.test_gangs_model import G, Map, member


def beat(world: Map, silent: set[str]) -> None:
    """Every node but the ``silent`` ones reports its running containers; a node back from down registers again."""
    for name, node in world.cluster.ledger.nodes.items():
        if name in silent:
            continue
        running = [r for r in world.cluster.ledger.records.values() if r.node == name and r.state is State.RUNNING]
        if node.ready:
            world.cluster.heartbeat(name, name.encode(), [GpuSample(uuid=f"{name}-g0", memory_used=0,
                                                                    memory_unmanaged=0)],
                                    [ContainerStatus(grant=r.id, container_id=f"c-{r.id}", state="running")
                                     for r in running])
        else:  # its registration carries what runs there
            reports = [ContainerReport(grant=r.id, container_id=f"c-{r.id}", gpus=r.gpus, gpu_memory=r.gpu_memory,
                                       state="running", labels=r.labels, image="img") for r in running]
            world.cluster.register(name, name.encode(), "docker",
                                   [GpuInfo(uuid=f"{name}-g0", index=0, name="Sim", memory_total=G)], reports,
                                   advertise_addr=node.advertise_addr)


def pass_time(world: Map, seconds: int, silent: set[str]) -> None:
    """``seconds`` go by, one heartbeat round a second, each followed by a sweep and a dispatch."""
    for _ in range(seconds):
        world.clock.advance(1.0)
        beat(world, silent)
        world.cluster.sweep()
        world.answer(world.cluster.dispatch()[0])


def test_the_zone_rule_pauses_gang_grace_and_the_wait_resumes_where_it_stopped() -> None:
    world = Map()  # nodes are down after 3 s of silence; three of four within that: a partition, not their deaths
    grace = world.cluster.gangs.node_grace = 20.0
    gid, commands = world.gang(2)
    world.answer(commands)
    first, second = (world.cluster.get(m) for m in world.view(gid)["members"])
    partition = {n for n in world.cluster.ledger.nodes if n != first.node}
    ready = world.cluster.ledger.nodes[second.node]
    pass_time(world, 2, {second.node})  # member 1's node goes silent first...
    pass_time(world, 2, partition)  # ...two others a little later
    assert not ready.ready and not world.cluster.reconciler.disrupted  # its wait began: one node down is no partition
    pass_time(world, 2, partition)
    assert world.cluster.reconciler.disrupted  # then the zone rule holds
    pass_time(world, 3 * int(grace), partition)  # far past gang_grace
    assert world.view(gid)["state"] == "running"
    pass_time(world, 1, {second.node})  # the others return: the rule no longer holds, member 1's node is still down
    assert not world.cluster.reconciler.disrupted and not world.cluster.ledger.nodes[second.node].ready
    assert world.view(gid)["state"] == "running"  # the wait resumed where it stopped: the partition's time not counted
    pass_time(world, int(grace), {second.node})
    view = world.view(gid)
    assert view["state"] == "failed" and "gang_grace" in view["reason"] and second.node in view["reason"]
    world.check()


def test_master_ports_are_taken_per_host_and_released_when_the_gang_ends() -> None:
    world = Map(nodes=0)
    for n, host in enumerate(["10.0.0.1", "10.0.0.1", "10.0.0.2"]):  # n0 and n1 share a host
        world.cluster.register(f"n{n}", f"n{n}".encode(), "docker",
                               [GpuInfo(uuid=f"n{n}-g0", index=0, name="Sim", memory_total=G)], [],
                               advertise_addr=host)

    def on(node: str) -> str:  # a gang of two, both members on one node
        gang, commands = world.cluster.submit_gang(GangSpec(member(G // 2, node=node), 2, one_per_node=False))
        world.answer(commands)
        return gang.id

    first, beside, elsewhere = on("n0"), on("n1"), on("n2")
    ports = {g: (world.view(g)["master_addr"], world.view(g)["master_port"]) for g in (first, beside, elsewhere)}
    assert ports == {first: ("10.0.0.1", 29500), beside: ("10.0.0.1", 29501), elsewhere: ("10.0.0.2", 29500)}
    for cid in world.view(first)["members"]:
        world.cluster.finish(cid, State.EXITED, exit_code=0)
    assert world.view(first)["state"] == "exited" and world.cluster.gangs.ports["10.0.0.1"] == {29501}
    again = on("n0")
    assert world.view(again)["master_port"] == 29500  # the ended gang's port, free again on its host
    world.check()


def test_a_waiting_gang_expires_after_its_queue_timeout_and_holds_nothing() -> None:
    world = Map()
    busy = world.cluster.submit(member())[1]
    world.answer(busy)
    gang, commands = world.cluster.submit_gang(GangSpec(member(), 4), queue=True, queue_timeout=10.0)
    assert commands == [] and world.view(gang.id)["state"] == "queued"
    world.dispatch(5.0)
    assert world.view(gang.id)["state"] == "queued"
    world.dispatch(6.0)
    view = world.view(gang.id)
    assert view["state"] == "expired" and view["members"] == [] and "queue_timeout" in view["reason"]
    assert gang.id not in world.cluster.gangs.waiting and world.cluster.gangs.journal_entries() == []
    world.check()


def test_with_host_networking_nccl_leaves_out_docker_and_lo_and_on_a_named_network_the_master_is_rank_0() -> None:
    world = Map()
    host, commands = world.cluster.submit_gang(GangSpec(member(G // 2, run={"network": "host"}), 2))
    world.answer(commands)
    envs = [world.cluster.get(m).env for m in host.members]
    assert [e["NCCL_SOCKET_IFNAME"] for e in envs] == ["^docker,lo"] * 2
    assert envs[0]["PET_MASTER_ADDR"] == world.cluster.ledger.nodes[world.cluster.get(host.members[0]).node] \
        .advertise_addr
    overlay, commands = world.cluster.submit_gang(GangSpec(member(G // 2, run={"network": "train"}, name="job"), 2,
                                                           network="train"))
    world.answer(commands)
    records = [world.cluster.get(m) for m in overlay.members]
    assert [r.name for r in records] == ["job-0", "job-1"]
    assert {r.env["PET_MASTER_ADDR"] for r in records} == {"job-0"}  # rank 0's container name on the network
    assert all("NCCL_SOCKET_IFNAME" not in r.env for r in records)
    world.check()


def test_an_agent_advertises_the_local_address_of_its_own_way_to_the_manager_by_default() -> None:
    import socket

    from gpumgr.agent.managers import local_address

    assert local_address("tcp://127.0.0.1:9401,tcp://10.9.9.9:9401") == "127.0.0.1"  # the first manager's route
    assert local_address("ipc:///run/gpumgr/agents.sock") == local_address("tcp://*:9401") == "127.0.0.1"
    assert local_address("udp://nowhere") == ""  # no manager address: nothing to advertise, never a guess
    outside = local_address("tcp://192.0.2.1:9401")  # a documentation address: the default route's source, if any
    if outside:  # (a host with no route out answers "")
        assert not outside.startswith("127.")
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.bind((outside, 0))  # one of this host's own addresses


@pytest.mark.parametrize("accounts", [False, True], ids=["plain", "accounts"])
def test_a_host_out_of_gang_ports_is_no_room_the_gang_waits_for_or_is_refused(accounts: bool) -> None:
    world = Map(nodes=0)
    if accounts:  # the fair walk places waiting gangs itself: a host out of ports must be no room there too
        world.cluster.accounts = account_tree({"default": {"quota": {"gpu_memory": 2 * G}}}, {})
    for n in range(2):  # two nodes of one host, and one port for gangs
        world.cluster.register(f"n{n}", f"n{n}".encode(), "docker",
                               [GpuInfo(uuid=f"n{n}-g0", index=0, name="Sim", memory_total=G)], [],
                               advertise_addr="10.0.0.1")
    world.cluster.gangs.port_range = (29500, 29500)
    first, commands = world.cluster.submit_gang(GangSpec(member(G // 2, node="n0"), 2, one_per_node=False))
    world.answer(commands)
    with pytest.raises(NoFit) as refused:
        world.cluster.submit_gang(GangSpec(member(G // 2, node="n1"), 2, one_per_node=False))
    assert refused.value.code == "no_fit" and "gang_ports" in refused.value.message
    assert [g.id for g in world.cluster.gangs.gangs.values()] == [first.id]  # nothing recorded for it
    waiting, commands = world.cluster.submit_gang(GangSpec(member(G // 2, node="n1"), 2, one_per_node=False),
                                                  queue=True)
    assert commands == [] and world.view(waiting.id)["state"] == "queued"
    world.dispatch()  # room on n1, but no port: it waits on
    assert world.view(waiting.id)["state"] == "queued" and waiting.id in world.cluster.gangs.waiting
    for cid in first.members:
        world.cluster.finish(cid, State.EXITED, exit_code=0)
    world.dispatch()
    assert world.view(waiting.id)["state"] == "running" and world.view(waiting.id)["master_port"] == 29500
    world.check()
