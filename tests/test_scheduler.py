"""The scheduler and the cluster map: no overbooking, the policy followed, grants exact."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sortedcontainers import SortedList

from gpumgr.manager.model.cluster import Cluster, PlacementSpec
from gpumgr.manager.placing.free_index import first_at_least
from gpumgr.manager.placing.scheduler import FreeIndex, GpuSlot, Placement, Request, place
from gpumgr.wire.errors import NoAgents, NoFit
from gpumgr.wire.names import State
from gpumgr.wire.protocol import ContainerReport, ContainerStatus, GpuInfo, GpuSample

GiB = 1 << 30


def make_cluster(sizes: dict[str, list[int]], headroom: int = 0) -> Cluster:
    cluster = Cluster(headroom=headroom)
    for node, gpus in sizes.items():
        infos = [GpuInfo(uuid=f"{node}-g{i}", index=i, name="Sim", memory_total=s) for i, s in enumerate(gpus)]
        cluster.register(node, node.encode(), "docker", infos, [])
    return cluster


def spec(memory: int, count: int = 1, placement: str = "spread", node: str | None = None) -> PlacementSpec:
    return PlacementSpec(memory=memory, count=count, placement=placement, image="img", command=[], node=node)


def gpu_view(cluster: Cluster) -> dict[str, dict]:
    return {g["uuid"]: g for n in cluster.nodes_view() if n["state"] == "ready" for g in n["gpus"]}


def test_spread_takes_most_free_and_binpack_least_free_that_fits() -> None:
    cluster = make_cluster({"a": [10 * GiB, 20 * GiB], "b": [16 * GiB]})
    assert cluster.reserve(spec(8 * GiB)).gpus == ["a-g1"]
    assert cluster.reserve(spec(9 * GiB, placement="binpack")).gpus == ["a-g0"]
    assert cluster.reserve(spec(1 * GiB, placement="binpack")).gpus == ["a-g0"]


def test_no_fit_names_the_largest_free_memory() -> None:
    cluster = make_cluster({"a": [10 * GiB, 20 * GiB]})
    cluster.reserve(spec(15 * GiB))
    with pytest.raises(NoFit, match=r"largest schedulable free memory on one GPU is 10GiB"):
        cluster.reserve(spec(11 * GiB))


def test_a_request_no_gpu_could_ever_hold_is_never_fits_queue_or_not() -> None:
    cluster = make_cluster({"a": [10 * GiB, 20 * GiB]})
    for queue in (False, True):
        with pytest.raises(NoFit, match="no GPU could ever hold this") as caught:
            cluster.submit(spec(21 * GiB), queue=queue)
        assert caught.value.code == "never_fits"


def test_no_agents_when_no_node_is_ready() -> None:
    with pytest.raises(NoAgents):
        Cluster().reserve(spec(GiB))
    cluster = make_cluster({"a": [GiB]})
    cluster.sweep(now=1e12)
    with pytest.raises(NoAgents):
        cluster.reserve(spec(GiB))


def test_multi_gpu_requests_land_on_one_node() -> None:
    cluster = make_cluster({"a": [8 * GiB, 30 * GiB], "b": [10 * GiB, 10 * GiB, 10 * GiB]})
    record = cluster.reserve(spec(9 * GiB, count=2))
    assert len(record.gpus) == 2 and {u.split("-")[0] for u in record.gpus} == {"b"}
    with pytest.raises(NoFit):
        cluster.reserve(spec(9 * GiB, count=2))


def test_node_filter_and_unknown_node() -> None:
    cluster = make_cluster({"a": [8 * GiB], "b": [30 * GiB]})
    assert cluster.reserve(spec(GiB, node="a")).gpus == ["a-g0"]
    with pytest.raises(NoFit, match="node 'zz'"):
        cluster.reserve(spec(GiB, node="zz"))


def test_unmanaged_memory_and_headroom_are_not_schedulable() -> None:
    cluster = make_cluster({"a": [24 * GiB]}, headroom=GiB)
    cluster.heartbeat("a", b"a", [GpuSample(uuid="a-g0", memory_used=5 * GiB, memory_unmanaged=5 * GiB)], [])
    assert gpu_view(cluster)["a-g0"]["memory_free"] == 18 * GiB
    with pytest.raises(NoFit):
        cluster.reserve(spec(19 * GiB))
    assert cluster.reserve(spec(18 * GiB)).gpus == ["a-g0"]


def test_finishing_frees_the_grant_once() -> None:
    cluster = make_cluster({"a": [24 * GiB]})
    record = cluster.reserve(spec(20 * GiB))
    cluster.finish(record.id, State.EXITED, exit_code=0)
    cluster.finish(record.id, State.REMOVED)
    assert gpu_view(cluster)["a-g0"]["memory_reserved"] == 0
    assert cluster.get(record.id).state is State.REMOVED


def test_registration_adopts_unknown_running_containers_and_orders_removal_of_failed_ones() -> None:
    cluster = make_cluster({"a": [24 * GiB]})
    failed = cluster.reserve(spec(GiB))
    cluster.fail(failed.id, "agent_timeout")
    reports = [
        ContainerReport(grant="adopted", container_id="c1", gpus=["a-g0"], gpu_memory=4 * GiB, state="running"),
        ContainerReport(grant=failed.id, container_id="c2", gpus=["a-g0"], gpu_memory=GiB, state="running"),
    ]
    gpus = [GpuInfo(uuid="a-g0", index=0, name="sim", memory_total=24 * GiB)]
    removals = cluster.register("a", b"a", "docker", gpus, reports)[0]
    assert removals == [failed.id]
    assert cluster.get("adopted").state is State.RUNNING
    assert gpu_view(cluster)["a-g0"]["memory_reserved"] == 4 * GiB


def test_heartbeat_naming_an_unknown_grant_asks_for_the_whole_report() -> None:
    """A heartbeat carries ids and figures only, so an unknown grant is never adopted from it."""
    cluster = make_cluster({"a": [24 * GiB]})
    status = ContainerStatus(grant="stranger", container_id="c1", state="running")
    assert cluster.heartbeat("a", b"a", [], [status]) is None
    assert gpu_view(cluster)["a-g0"]["memory_reserved"] == 0


def test_unknown_node_heartbeat_asks_for_registration() -> None:
    assert Cluster().heartbeat("ghost", b"x", [], []) is None


# --- properties ------------------------------------------------------------------------------
operations = st.lists(
    st.one_of(
        st.tuples(st.just("place"), st.integers(1, 24), st.integers(1, 3), st.sampled_from(["spread", "binpack"])),
        st.tuples(st.just("release"), st.integers(0, 50)),
        st.tuples(st.just("unmanaged"), st.integers(0, 5), st.integers(0, 8)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.integers(4, 32), min_size=1, max_size=4), min_size=1, max_size=4), operations)
def test_random_place_release_never_overbooks_and_follows_policy(shape, ops) -> None:
    cluster = make_cluster({f"n{i}": [s * GiB for s in gpus] for i, gpus in enumerate(shape)})
    live: list[str] = []
    for op in ops:
        before = gpu_view(cluster)
        if op[0] == "place":
            _, size, count, policy = op
            fitting_free = [g["memory_free"] for g in before.values() if g["memory_free"] >= size * GiB]
            try:
                record = cluster.reserve(spec(size * GiB, count, policy))
            except NoFit:
                assert count > 1 or not fitting_free
                continue
            live.append(record.id)
            chosen = [before[u]["memory_free"] for u in record.gpus]
            assert all(c >= size * GiB for c in chosen)
            assert len({before[u]["uuid"].split("-")[0] for u in record.gpus}) == 1
            if count == 1:
                assert chosen[0] == (max(fitting_free) if policy == "spread" else min(fitting_free))
        elif op[0] == "release" and live:
            cluster.finish(live.pop(op[1] % len(live)), State.EXITED)
        elif op[0] == "unmanaged":
            uuids = sorted(before)
            target = uuids[op[1] % len(uuids)]
            cluster.heartbeat(target.split("-")[0], b"x", [
                GpuSample(uuid=target, memory_used=op[2] * GiB, memory_unmanaged=op[2] * GiB)], [])
        _check_accounting(cluster, live)


def _check_accounting(cluster: Cluster, live: list[str]) -> None:
    expected: dict[str, int] = {}
    for cid in live:
        record = cluster.get(cid)
        for uuid in record.gpus:
            expected[uuid] = expected.get(uuid, 0) + record.gpu_memory
    for uuid, gpu in gpu_view(cluster).items():
        assert gpu["memory_reserved"] == expected.get(uuid, 0)
        assert gpu["memory_reserved"] <= gpu["memory_total"]
        assert gpu["memory_free"] == max(0, gpu["memory_total"] - gpu["memory_reserved"] - gpu["memory_unmanaged"])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 100), min_size=1, max_size=30), st.integers(1, 100))
def test_index_search_matches_a_linear_scan(frees, memory) -> None:
    index = FreeIndex()
    for i, free in enumerate(frees):
        index.add(GpuSlot(f"u{i:03d}", f"n{i % 3}", i, free))
    fits = [f for f in frees if f >= memory]
    for policy, pick in ((Placement.SPREAD, max), (Placement.BINPACK, min)):
        if fits:
            assert place(index, Request(memory, placement=policy))[0].free == pick(fits)
        else:
            with pytest.raises(NoFit):
                place(index, Request(memory, placement=policy))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 60), max_size=3000), st.integers(-1, 61))
def test_first_at_least_is_the_first_of_irange(values, key) -> None:
    """The binpack lookup's two bisections give what ``irange``'s first item gives, across many sublists."""
    entries = SortedList(values)
    entries._reset(8)  # short sublists, so a few thousand values span hundreds of them
    assert first_at_least(entries, key) == next(iter(entries.irange(minimum=key)), None)
