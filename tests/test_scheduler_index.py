"""The free index's per-node rankings: multi-GPU requests answered without scanning every node, ties spread.

The rankings are kept lazily (re-ranked on the next request for as many GPUs), so these tests
interleave changes and requests many times over one index, against a brute-force reference.
"""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from gpumgr.manager.model.cluster import Cluster, PlacementSpec
from gpumgr.manager.placing import free_index
from gpumgr.manager.placing.scheduler import FreeIndex, GpuSlot, Placement, Request, place
from gpumgr.wire.errors import NoFit
from gpumgr.wire.protocol import GpuInfo

U = 1 << 30


def best_sum(slots: list[GpuSlot], memory: int, count: int, spread: bool) -> int | None:
    """The best sum of free memory over every set of ``count`` fitting GPUs of one node (None: none fits)."""
    sums = []
    for node in {s.node for s in slots}:
        fits = [s.free for s in slots if s.node == node and s.free >= memory]
        sums += [sum(c) for c in itertools.combinations(fits, count)]
    if not sums:
        return None
    return max(sums) if spread else min(sums)


def set_ready(index: FreeIndex, node_slots: list[GpuSlot], ready: bool) -> None:
    """What the cluster map does when a node comes up (its GPUs in, once) or goes down (out)."""
    for slot in node_slots:
        if not ready:
            index.discard(slot)
        elif slot not in index:
            index.add(slot)


steps = st.lists(st.one_of(
    st.tuples(st.just("reserve"), st.integers(0, 99), st.integers(0, 12)),
    st.tuples(st.just("down"), st.integers(0, 99), st.just(0)),
    st.tuples(st.just("up"), st.integers(0, 99), st.just(0)),
    st.tuples(st.just("ask"), st.integers(1, 8), st.integers(2, 4)),
), min_size=1, max_size=40)


@settings(max_examples=150, deadline=None, database=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=6), steps, st.sampled_from(list(Placement)),
       st.sampled_from([2, free_index.CHANGES_LOGGED]))
def test_multi_gpu_choice_matches_brute_force_through_many_changes(shape, ops, policy, logged) -> None:
    """``logged``: how many changed nodes the index logs for its rankings before handing each its share."""
    kept, free_index.CHANGES_LOGGED = free_index.CHANGES_LOGGED, logged
    try:
        check_choices(shape, ops, policy)
    finally:
        free_index.CHANGES_LOGGED = kept


def check_choices(shape: list[int], ops: list[tuple[str, int, int]], policy: Placement) -> None:
    """Apply ``ops`` to one index of nodes of ``shape`` GPUs; every request's choice must match brute force."""
    slots = [GpuSlot(f"n{n}-g{i}", f"n{n}", i, 12 * U) for n, count in enumerate(shape) for i in range(count)]
    index, up = FreeIndex(), set()
    for slot in slots:
        index.add(slot)
        up.add(slot.node)
    for op, a, b in ops:
        if op == "reserve":
            slot = slots[a % len(slots)]
            slot.reserved = b * U
            index.update(slot)
        elif op in ("up", "down"):
            node = f"n{a % len(shape)}"
            set_ready(index, [s for s in slots if s.node == node], op == "up")
            (up.add if op == "up" else up.discard)(node)
        elif up:
            ready = [s for s in slots if s.node in up]
            expected = best_sum(ready, a * U, b, policy is Placement.SPREAD)
            try:
                chosen = place(index, Request(a * U, b, None, policy))
            except NoFit:
                assert expected is None
                continue
            assert expected is not None and sum(s.free for s in chosen) == expected
            assert len({s.node for s in chosen}) == 1 and len(set(map(id, chosen))) == b
            assert all(s.free >= a * U for s in chosen)


def empty_cluster(nodes: int, gpus: int) -> Cluster:
    cluster = Cluster()
    for n in range(nodes):
        infos = [GpuInfo(uuid=f"n{n:03d}-g{i}", index=i, name="Sim", memory_total=80 * U) for i in range(gpus)]
        cluster.register(f"n{n:03d}", f"n{n:03d}".encode(), "docker", infos, [])
    return cluster


def test_two_gpu_spread_ties_go_to_different_nodes() -> None:
    """On empty nodes every node ties; each request must go to a node nobody took yet, not four to the first."""
    cluster = empty_cluster(60, 8)
    nodes = [cluster.reserve(PlacementSpec(memory=U, count=2, placement="spread", image="img", command=[])).node
             for _ in range(60)]
    assert len(set(nodes)) == 60


def test_binpack_ties_go_to_the_fuller_node() -> None:
    cluster = empty_cluster(3, 4)
    first = cluster.reserve(PlacementSpec(memory=80 * U, count=1, placement="binpack", image="img", command=[],
                                          node="n001"))
    chosen = cluster.reserve(PlacementSpec(memory=U, count=2, placement="binpack", image="img", command=[]))
    # every node offers the same best pair (80 + 80 GiB); n001 has one GPU full, so the least free in all
    assert chosen.node == first.node == "n001"
    assert first.gpus[0] not in chosen.gpus


def test_a_node_going_down_leaves_the_rankings() -> None:
    cluster = empty_cluster(2, 2)
    assert cluster.reserve(PlacementSpec(memory=U, count=2, placement="spread", image="img", command=[])).node
    index = cluster.ledger.index
    for slot in list(index.by_node["n000"]):
        index.discard(slot)
    for _ in range(3):
        for policy in Placement:
            assert {s.node for s in place(index, Request(U, 2, None, policy))} == {"n001"}


def test_the_free_order_is_brought_up_to_date_when_read_after_updates_adds_and_discards() -> None:
    """``update`` only notes a slot; every read of ``by_free`` (and each placement) sees the true order."""
    index = FreeIndex()
    slots = [GpuSlot(uuid=f"g{i}", node=f"n{i % 2}", index=i, total=10 * U) for i in range(4)]
    for slot in slots:
        index.add(slot)
    slots[0].reserved = 9 * U
    index.update(slots[0])
    slots[3].reserved = 2 * U
    index.update(slots[3])
    index.discard(slots[3])  # noted, then gone: the next read must not trip over it
    slots[1].reserved = U
    index.update(slots[1])
    slots[1].reserved = 0  # moved and back again before any read: nothing to re-sort
    index.update(slots[1])
    assert [(key, slot.uuid) for key, slot in index.by_free] == [
        ((U, "g0"), "g0"), ((10 * U, "g1"), "g1"), ((10 * U, "g2"), "g2")]
    assert index.largest_free() == 10 * U
    slots[2].reserved = 7 * U
    index.update(slots[2])
    index.add(slots[3])  # back with its current figure
    assert [slot.uuid for _, slot in index.by_free] == ["g0", "g2", "g3", "g1"]
    chosen = place(index, Request(8 * U, 1, None, Placement.BINPACK))
    assert [s.uuid for s in chosen] == ["g3"]
