"""Constraints, GPU health and topology in the manager's model, against brute-force references.

The parser is checked on every attribute and operator; the scheduler on random maps, random
constraints and random topologies, against a reference that enumerates every feasible set.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpumgr.manager.model.cluster import Cluster, PlacementSpec
from gpumgr.manager.model.records import Gpu
from gpumgr.manager.placing.scheduler import ACROSS, LINKS, FreeIndex, GpuSlot, Placement, Request, link_of, place
from gpumgr.manager.placing.topology import assign_groups
from gpumgr.wire.constraints import parse, parse_all
from gpumgr.wire.errors import NoFit
from gpumgr.wire.names import EventType
from gpumgr.wire.protocol import GpuInfo, GpuSample

G = 1 << 30
MODELS = ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB", "Tesla T4")
CCS = ("9.0", "8.0", "7.5")
SIZES = (80 * G, 40 * G, 16 * G)


def slot(node: str, index: int, model: int, labels: dict[str, str], free: int | None = None) -> GpuSlot:
    s = GpuSlot(f"GPU-{node}-{index}", node, index, SIZES[model], name=MODELS[model],
                compute_capability=CCS[model], labels=labels)
    if free is not None:
        s.reserved = s.total - free
    return s


# --- parsing ---------------------------------------------------------------------------------
CASES = [
    # (constraint, GPU it is checked on as (node, index, model, labels), expected)
    ("node.name==n1", ("n1", 0, 0, {}), True),
    ("node.name!=n1", ("n1", 0, 0, {}), False),
    ("node.hostname==N1", ("n1", 0, 0, {}), True),
    ("node.labels.zone==a", ("n1", 0, 0, {"zone": "a"}), True),
    ("node.labels.zone==a", ("n1", 0, 0, {"zone": "b"}), False),
    ("node.labels.zone!=a", ("n1", 0, 0, {}), True),  # a missing label matches != only, as in Swarm
    ("node.labels.zone==a", ("n1", 0, 0, {}), False),
    ("gpu.model==*H100*", ("n1", 0, 0, {}), True),
    ("gpu.model==*h100*", ("n1", 0, 1, {}), False),
    ("gpu.model!=Tesla T4", ("n1", 0, 2, {}), False),
    ("gpu.model==tesla t4", ("n1", 0, 2, {}), True),
    ("gpu.uuid==GPU-n1-3", ("n1", 3, 0, {}), True),
    ("gpu.uuid!=GPU-n1-3", ("n1", 3, 0, {}), False),
    ("gpu.index==1", ("n1", 1, 0, {}), True),
    ("gpu.index!=1", ("n1", 1, 0, {}), False),
    ("gpu.index>=2", ("n1", 1, 0, {}), False),
    ("gpu.index<=2", ("n1", 1, 0, {}), True),
    ("gpu.memory>=40GiB", ("n1", 0, 1, {}), True),
    ("gpu.memory>=41GiB", ("n1", 0, 1, {}), False),
    ("gpu.memory<=16GiB", ("n1", 0, 2, {}), True),
    ("gpu.memory==80GiB", ("n1", 0, 0, {}), True),
    ("gpu.memory!=80GiB", ("n1", 0, 0, {}), False),
    ("gpu.compute_capability>=8.0", ("n1", 0, 1, {}), True),
    ("gpu.compute_capability>=8.6", ("n1", 0, 1, {}), False),
    ("gpu.compute_capability<=7.5", ("n1", 0, 2, {}), True),
    ("gpu.compute_capability==9", ("n1", 0, 0, {}), True),
    ("gpu.compute_capability!=9.0", ("n1", 0, 0, {}), False),
]


@pytest.mark.parametrize(("text", "where", "expected"), CASES)
def test_every_attribute_and_operator(text: str, where: tuple, expected: bool) -> None:
    assert parse(text).allows(slot(*where)) is expected


@pytest.mark.parametrize(("text", "says"), [
    ("gpu.model", "no operator"), ("gpu.model==", "no value"), ("gpu.colour==red", "unknown attribute"),
    ("gpu.model>=H100", "compares numbers"), ("node.labels.==a", "label key"), ("gpu.memory>=lots", "cannot read"),
    ("gpu.index>=-1", "whole number"), ("gpu.compute_capability>=eight", "compute capability"),
    ("x" * 600, "at most"),
])
def test_a_constraint_that_cannot_be_read_is_named(text: str, says: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse(text)
    assert says in str(caught.value)
    if len(text) < 100:
        assert repr(text) in str(caught.value)


def test_too_many_constraints_and_wrong_types_are_refused() -> None:
    with pytest.raises(ValueError, match="at most 32"):
        parse_all(["gpu.index>=0"] * 33)
    with pytest.raises(ValueError, match="must be a string"):
        parse(7)  # type: ignore[arg-type]


# --- the scheduler with constraints, against a reference -------------------------------------
constraint_texts = st.sampled_from([
    "gpu.model==*H100*", "gpu.model!=Tesla T4", "gpu.memory>=40GiB", "gpu.memory<=40GiB", "gpu.index<=1",
    "gpu.index!=0", "gpu.compute_capability>=8.0", "node.labels.zone==a", "node.labels.zone!=a", "node.name!=n0",
])


def reference(slots: list[GpuSlot], request: Request) -> list[tuple[GpuSlot, ...]]:
    """Every set the request may take: ``count`` allowed GPUs of one node that each fit."""
    ok = [s for s in slots if s.free >= request.memory and request.constraints.allows(s)]
    sets = []
    for node in {s.node for s in ok}:
        sets += list(itertools.combinations([s for s in ok if s.node == node], request.count))
    return sets


@settings(max_examples=300, deadline=None, database=None)
@given(st.data())
def test_constrained_placement_matches_the_brute_force_reference(data: st.DataObject) -> None:
    nodes = data.draw(st.integers(1, 4), "nodes")
    slots, index = [], FreeIndex()
    for n in range(nodes):
        labels = {"zone": data.draw(st.sampled_from(["a", "b"]))} if data.draw(st.booleans()) else {}
        for i in range(data.draw(st.integers(1, 4))):
            model = data.draw(st.integers(0, 2))
            s = slot(f"n{n}", i, model, labels, data.draw(st.integers(0, SIZES[model] // G)) * G)
            slots.append(s)
            index.add(s)
    texts = data.draw(st.lists(constraint_texts, max_size=2), "constraints")
    request = Request(data.draw(st.integers(1, 60)) * G, data.draw(st.integers(1, 3)), None,
                      data.draw(st.sampled_from(list(Placement))), parse_all(texts))
    feasible = reference(slots, request)
    try:
        chosen = place(index, request)
    except NoFit:
        assert not feasible, f"{len(feasible)} sets fit {texts}, yet no fit"
        return
    assert frozenset(map(id, chosen)) in {frozenset(map(id, c)) for c in feasible}
    sums = [sum(s.free for s in c) for c in feasible]
    best = max(sums) if request.placement is Placement.SPREAD else min(sums)
    assert sum(s.free for s in chosen) == best


def cluster_of(nodes: dict[str, tuple[dict[str, str], list[int]]]) -> Cluster:
    """Nodes with labels and GPUs of the given models (indexes into MODELS)."""
    cluster = Cluster()
    for name, (labels, models) in nodes.items():
        infos = [GpuInfo(uuid=f"GPU-{name}-{i}", index=i, name=MODELS[m], memory_total=SIZES[m],
                         compute_capability=CCS[m]) for i, m in enumerate(models)]
        cluster.register(name, name.encode(), "docker", infos, [], labels=labels)
    return cluster


def spec(memory: int, count: int = 1, constraints: tuple[str, ...] = (), placement: str = "spread") -> PlacementSpec:
    return PlacementSpec(memory=memory, count=count, placement=placement, image="img", command=[],
                         constraints=list(constraints))


def test_a_constraint_no_gpu_could_ever_satisfy_is_never_fits_queue_or_not() -> None:
    cluster = cluster_of({"n0": ({"zone": "a"}, [0, 1]), "n1": ({}, [2])})
    for queue in (False, True):
        with pytest.raises(NoFit) as caught:
            cluster.submit(spec(G, constraints=("gpu.model==*V100*",)), queue=queue)
        assert caught.value.code == "never_fits" and "gpu.model==*V100*" in caught.value.message
        with pytest.raises(NoFit) as caught:  # a T4 exists, but not with 20 GiB
            cluster.submit(spec(20 * G, constraints=("gpu.model==Tesla*",)), queue=queue)
        assert caught.value.code == "never_fits"
    assert not cluster.containers(state="queued")


def test_a_constraint_that_fits_later_waits_in_the_queue_and_is_placed_when_room_frees() -> None:
    cluster = cluster_of({"n0": ({"zone": "a"}, [0, 1]), "n1": ({"zone": "b"}, [0])})
    first = cluster.reserve(spec(80 * G, constraints=("node.labels.zone==a",)))
    assert first.gpus == ["GPU-n0-0"]
    with pytest.raises(NoFit) as caught:
        cluster.reserve(spec(60 * G, constraints=("node.labels.zone==a",)))
    assert caught.value.code == "no_fit"
    waiting, _ = cluster.submit(spec(60 * G, constraints=("node.labels.zone==a",)), queue=True)
    assert waiting.state == "queued"
    cluster.fail(first.id, "test")
    cluster.dispatch()
    assert waiting.state == "creating" and waiting.gpus == ["GPU-n0-0"]  # not n1's free H100: zone b


# --- health ----------------------------------------------------------------------------------
def test_an_unhealthy_gpu_gets_no_new_grant_keeps_its_own_and_comes_back() -> None:
    cluster = cluster_of({"n0": ({}, [0, 0])})
    held = cluster.reserve(spec(10 * G))
    sick = held.gpus[0]
    other = "GPU-n0-1" if sick == "GPU-n0-0" else "GPU-n0-0"
    samples = [GpuSample(uuid=sick, memory_used=0, memory_unmanaged=0, health="fatal Xid 79"),
               GpuSample(uuid=other, memory_used=0, memory_unmanaged=0)]
    cluster.heartbeat("n0", b"n0", samples, [])
    events = [e for e in cluster.events.since(0) if e["type"] == EventType.GPU_UNHEALTHY]
    assert len(events) == 1 and "fatal Xid 79" in events[0]["message"] and events[0]["gpu"] == sick
    assert cluster.get(held.id).state == "creating" and cluster.ledger.gpus[sick].reserved == 10 * G
    for _ in range(3):  # spread would take the emptier sick GPU if it could
        assert cluster.reserve(spec(G, placement="binpack")).gpus == [other]
    cluster.reserve(spec(60 * G))  # the other now has 17 GiB free, the sick one 70
    with pytest.raises(NoFit) as caught:
        cluster.reserve(spec(20 * G))
    assert caught.value.code == "no_fit"  # not never_fits: it may recover
    view = next(g for n in cluster.nodes_view() for g in n["gpus"] if g["uuid"] == sick)
    assert view["healthy"] is False and view["health"] == "fatal Xid 79"
    cluster.heartbeat("n0", b"n0", [GpuSample(uuid=sick, memory_used=0, memory_unmanaged=0)], [])
    assert cluster.reserve(spec(20 * G)).gpus == [sick]
    assert [e["type"] for e in cluster.events.since(0)][-2:] == [EventType.GPU_HEALTHY, "placed"]
    assert not cluster.ledger.check()


def test_a_gpu_that_registers_unhealthy_is_never_granted() -> None:
    cluster = Cluster()
    infos = [GpuInfo(uuid="GPU-x", index=0, name="m", memory_total=8 * G, health="retired pages are pending")]
    cluster.register("x", b"x", "docker", infos, [])
    with pytest.raises(NoFit):
        cluster.reserve(spec(G))
    cluster.sweep()
    assert cluster.ledger.gpus["GPU-x"] not in cluster.ledger.index


# --- topology --------------------------------------------------------------------------------
def islands(node: str, count: int, nvlink: int, socket: int | None = None) -> list[GpuInfo]:
    """``count`` GPUs of 80 GiB with NVLink blocks of ``nvlink`` (and sockets of ``socket``)."""
    def link(i: int, j: int) -> str:
        if i // nvlink == j // nvlink:
            return "nvlink"
        return "socket" if socket and i // socket == j // socket else "system"
    return [GpuInfo(uuid=f"GPU-{node}-{i}", index=i, name="H100", memory_total=80 * G,
                    links={f"GPU-{node}-{j}": link(i, j) for j in range(count) if j != i}) for i in range(count)]


def test_two_four_gpu_requests_each_get_one_island() -> None:
    cluster = Cluster()
    cluster.register("t", b"t", "docker", islands("t", 8, 4), [])
    for placement, memory in (("spread", 10 * G), ("binpack", 50 * G)):  # binpack would stack two 10 GiB jobs
        first = cluster.reserve(spec(memory, 4, placement=placement))
        second = cluster.reserve(spec(memory, 4, placement=placement))
        assert {frozenset(first.gpus), frozenset(second.gpus)} == {
            frozenset(f"GPU-t-{i}" for i in range(4)), frozenset(f"GPU-t-{i}" for i in range(4, 8))}
        assert first.topology == second.topology == "nvlink"
        assert cluster.view(first)["topology"] == "nvlink"
        for record in (first, second):
            cluster.fail(record.id, "test")


def test_a_pair_on_a_half_full_node_is_a_linked_pair_when_one_exists() -> None:
    """NVLink pairs (0, 1), (2, 3), (4, 5), (6, 7), sockets of four; GPUs 0, 2 and 4 full."""
    cluster = Cluster()
    cluster.register("h", b"h", "docker", islands("h", 8, 2, socket=4), [])
    full = {i: cluster.reserve(spec(80 * G, constraints=(f"gpu.index=={i}",))) for i in (0, 2, 4)}
    for placement in ("spread", "binpack"):
        pair = cluster.reserve(spec(10 * G, 2, placement=placement))
        assert sorted(pair.gpus) == ["GPU-h-6", "GPU-h-7"] and pair.topology == "nvlink"
        cluster.fail(pair.id, "test")
    full[7] = cluster.reserve(spec(80 * G, constraints=("gpu.index==7",)))
    # 1, 3, 5, 6 free: no NVLink pair is left; one socket holds 1 and 3, the other 5 and 6
    pair = cluster.reserve(spec(10 * G, 2))
    assert sorted(pair.gpus) in (["GPU-h-1", "GPU-h-3"], ["GPU-h-5", "GPU-h-6"]) and pair.topology == "socket"
    cluster.fail(pair.id, "test")
    cluster.fail(full[4].id, "test")  # (4, 5) is an NVLink pair again
    pair = cluster.reserve(spec(10 * G, 2, placement="binpack"))
    assert sorted(pair.gpus) == ["GPU-h-4", "GPU-h-5"] and pair.topology == "nvlink"
    assert not cluster.ledger.check()


def test_topology_scoring_can_be_turned_off_per_request() -> None:
    index = FreeIndex()
    gpus = [Gpu(f"g{i}", "n", i, 80 * G, links={f"g{j}": "nvlink" if i // 2 == j // 2 else "system"
                                                 for j in range(4) if j != i}) for i in range(4)]
    assign_groups(gpus)
    gpus[0].reserved = gpus[2].reserved = 30 * G  # most free: 1 and 3, which NVLink does not join
    for gpu in gpus:
        index.add(gpu)
    assert link_of(place(index, Request(G, 2))) == "nvlink"
    assert {s.uuid for s in place(index, Request(G, 2, topology=False))} == {"g1", "g3"}
    assert link_of(place(index, Request(G, 2, topology=False))) == ACROSS


LINK_NAMES = (*LINKS, ACROSS)


@settings(max_examples=300, deadline=None, database=None)
@given(st.data())
def test_the_best_connected_set_matches_the_brute_force_reference(data: st.DataObject) -> None:
    """One node, nested blocks (NVLink within switch within socket): the set's weakest link is the best any
    fitting set has, and among sets that good its free memory is the policy's best."""
    count = data.draw(st.integers(2, 8), "gpus")
    nv, sw = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 2))
    so = data.draw(st.integers(1, 2))
    blocks = (nv, nv * sw, nv * sw * so)

    def link(i: int, j: int) -> str:
        return next((LINKS[level] for level, size in enumerate(blocks) if i // size == j // size), ACROSS)

    gpus = [Gpu(f"g{i}", "n", i, 8 * G, links={f"g{j}": link(i, j) for j in range(count) if j != i})
            for i in range(count)]
    assign_groups(gpus)
    index = FreeIndex()
    for gpu in gpus:
        gpu.reserved = data.draw(st.integers(0, 8)) * G
        index.add(gpu)
    request = Request(data.draw(st.integers(1, 8)) * G, data.draw(st.integers(2, count)), None,
                      data.draw(st.sampled_from(list(Placement))))
    feasible = [c for c in itertools.combinations(gpus, request.count) if all(g.free >= request.memory for g in c)]
    try:
        chosen = place(index, request)
    except NoFit:
        assert not feasible
        return

    def weakest(chosen_set: tuple[Gpu, ...] | list[GpuSlot]) -> int:
        return max(LINK_NAMES.index(link(a.index, b.index)) for a, b in itertools.combinations(chosen_set, 2))

    best_link = min(weakest(c) for c in feasible)
    assert weakest(chosen) == best_link and link_of(chosen) == LINK_NAMES[best_link]
    sums = [sum(g.free for g in c) for c in feasible if weakest(c) == best_link]
    best = max(sums) if request.placement is Placement.SPREAD else min(sums)
    assert sum(s.free for s in chosen) == best


# --- the queue's journal and the plugin ------------------------------------------------------
def test_a_queued_constrained_request_keeps_its_constraints_across_a_manager_restart() -> None:
    cluster = cluster_of({"n0": ({"zone": "a"}, [2]), "n1": ({}, [0])})
    holder = cluster.reserve(spec(16 * G, constraints=("gpu.model==Tesla*",)))
    waiting, _ = cluster.submit(spec(10 * G, constraints=("gpu.model==Tesla*",)), queue=True)
    entry = cluster.life.journal_entry(waiting)
    restarted = cluster_of({"n0": ({"zone": "a"}, [2]), "n1": ({}, [0])})
    restarted.reserve(PlacementSpec(memory=16 * G, count=1, placement="spread", image="i", command=[], node="n0"))
    assert restarted.restore_queue([entry]) == 1
    restarted.dispatch()
    again = restarted.get(waiting.id)
    assert again.state == "queued" and again.spec.constraints == ["gpu.model==Tesla*"]  # the H100 has room: not its
    assert holder.gpus == ["GPU-n0-0"]


def test_docker_gpu_passes_node_constraints_to_swarm_and_gpu_ones_to_the_hook() -> None:
    from gpumgr.plugin.cli_base import PluginError
    from gpumgr.plugin.placement import swarm_constraints
    from gpumgr.plugin.services import constraints_of

    constraints, rest = constraints_of(["--replicas", "2", "--constraint", "node.labels.zone==a", "--constraint=gpu"
                                        ".model==NVIDIA H100 80GB HBM3", "--constraint", "node.name!=n3",
                                        "--constraint", "gpu.memory==80GiB", "--constraint", "gpu.model==*A100*",
                                        "--constraint", "node.role==manager", "img", "cmd"])
    assert rest == ["--replicas", "2", "img", "cmd"]
    options = swarm_constraints(constraints)
    assert options == ["--constraint=node.labels.zone==a", "--constraint=node.hostname!=n3",
                       "--constraint=node.role==manager",
                       "--constraint=node.labels.gpumgr.gpu.model==NVIDIA H100 80GB HBM3",
                       f"--constraint=node.labels.gpumgr.gpu.memory=={80 * G}",
                       '--env=GPUMGR_REQUEST_CONSTRAINTS=["gpu.model==NVIDIA H100 80GB HBM3", "gpu.memory==80GiB", '
                       '"gpu.model==*A100*"]']
    with pytest.raises(PluginError, match="unknown attribute"):
        constraints_of(["--constraint", "gpu.colour==red", "img"])


def test_docker_gpu_run_sends_its_constraints() -> None:
    from gpumgr.plugin import run_flags
    from gpumgr.plugin.docker_gpu import PluginError

    args = run_flags.parser(PluginError).parse_args(["--gpu-memory", "1GiB", "--constraint", "gpu.index==1",
                                                     "--constraint", "node.labels.zone==a", "img"])
    assert run_flags.build_request(args, PluginError)["constraints"] == ["gpu.index==1", "node.labels.zone==a"]


def test_preemption_stops_nothing_on_a_gpu_the_waiting_request_may_not_use() -> None:
    from gpumgr.wire.protocol import ContainerReport

    cluster = cluster_of({"n0": ({}, [2, 2])})  # two T4s of 16 GiB
    low = [cluster.reserve(PlacementSpec(memory=12 * G, count=1, placement="spread", image="i", command=[],
                                         preemptible=True, constraints=[f"gpu.index=={i}"])) for i in (0, 1)]
    for record in low:
        cluster.started(record.id, ContainerReport(grant=record.id, container_id=f"c-{record.id}", gpus=record.gpus,
                                                   gpu_memory=12 * G, state="running"))
    head, _ = cluster.submit(PlacementSpec(memory=8 * G, count=1, placement="spread", image="i", command=[],
                                           priority=5, constraints=["gpu.index==1"]), queue=True)
    assert head.state == "queued"
    assert [r.desired for r in low] == ["running", "preempted"]  # only the one on GPU 1, which it may use


def test_constraints_that_slipped_past_the_edge_are_refused_and_leave_nothing() -> None:
    """A node's hook request or a journal line is not checked by the REST model: the model checks again."""
    from gpumgr.wire.errors import InvalidRequest

    cluster = cluster_of({"n0": ({}, [0])})
    for queue in (False, True):
        with pytest.raises(InvalidRequest, match="unknown attribute"):
            cluster.submit(spec(G, constraints=("gpu.colour==red",)), queue=queue)
    assert not cluster.containers() and not cluster.ledger.check()
    entry = {"id": "j1", "name": "j1", "created_at": 0.0, "queued_at": 0.0,
             "spec": {**spec(G).__dict__, "constraints": ["gpu.index>>0"]}}
    assert cluster.restore_queue([entry]) == 0


def test_gpu_mps_and_a_compute_share_reach_swarm_as_the_mps_label_agents_write() -> None:
    from gpumgr.agent.gpus.source import Device
    from gpumgr.agent.runtimes.swarm_labels import labels_for
    from gpumgr.plugin.placement import swarm_constraints
    from gpumgr.plugin.services import constraints_of

    device = Device(uuid="GPU-a", index=0, name="Simulated GPU", memory_total=24 * G)
    assert labels_for([device], mps=True)["gpumgr.gpu.mps"] == "true"
    assert "gpumgr.gpu.mps" not in labels_for([device])  # a node without MPS has no such label
    hints = {text: [o for o in swarm_constraints(constraints_of(["--constraint", text, "img"])[0])
                    if o.startswith("--constraint=")] for text in
             ("gpu.mps==true", "gpu.mps!=false", "gpu.mps==false", "gpu.mps!=true")}
    assert hints == {"gpu.mps==true": ["--constraint=node.labels.gpumgr.gpu.mps==true"],
                     "gpu.mps!=false": ["--constraint=node.labels.gpumgr.gpu.mps==true"],
                     "gpu.mps==false": ["--constraint=node.labels.gpumgr.gpu.mps!=true"],
                     "gpu.mps!=true": ["--constraint=node.labels.gpumgr.gpu.mps!=true"]}


def test_a_service_with_a_compute_share_asks_swarm_for_an_mps_node() -> None:
    from gpumgr.plugin.cli_base import PluginError
    from gpumgr.plugin.services import grant_args

    class Nodes:  # answers GET /v1/nodes as the manager does, with one MPS node and one without
        def __init__(self, mps: bool) -> None:
            self.mps = mps

        def call(self, method: str, path: str) -> dict[str, object]:
            assert (method, path) == ("GET", "/v1/nodes")
            return {"nodes": [{"name": "n1", "state": "ready", "labels": {}, "gpus": [
                {"uuid": "GPU-1", "index": 0, "memory_total": 24 * G, "mps": self.mps}]}]}

    args = grant_args(Nodes(mps=True), {"--gpu-memory": "4GiB", "--compute-share": "25"})
    assert "--constraint=node.labels.gpumgr.gpu.mps==true" in args
    assert "--constraint=node.labels.gpumgr.gpu.mps==true" not in grant_args(Nodes(True), {"--gpu-memory": "4GiB"})
    with pytest.raises(PluginError, match=r"gpu\.mps==true"):  # no MPS node could ever run it: nothing is created
        grant_args(Nodes(mps=False), {"--gpu-memory": "4GiB", "--compute-share": "25"})
