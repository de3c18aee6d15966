"""Property-based tests: the scheduler against a brute-force reference, and the wire codec.

Scheduler: a tiny reference enumerates every feasible choice (``count`` distinct GPUs of one ready
node, each with at least ``memory`` schedulable free bytes, free = total − reserved − unmanaged −
headroom, clamped at 0) and scores each by the sum of its GPUs' free memory; ``spread`` must pick a
choice of the highest score, ``binpack`` one of the lowest. Ties may go either way. The same check runs
on a bare :class:`FreeIndex` and, in a state machine, through :class:`Cluster` as the product uses it.

Wire: every message type, built from its pydantic model, round-trips; frames over the size and field
bounds are refused with ProtocolError; garbage bytes and random msgpack raise ProtocolError or nothing;
``parse_bytes`` reads exactly or raises ValueError, and reads back what ``format_bytes`` writes.
"""

from __future__ import annotations

import contextlib
import itertools
import time
import types
import typing
from dataclasses import dataclass
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from pydantic import BaseModel

from gpumgr.manager.model.cluster import Cluster, PlacementSpec
from gpumgr.manager.placing.scheduler import FreeIndex, GpuSlot, Placement, Request, place
from gpumgr.wire import defaults, protocol
from gpumgr.wire.errors import GpumgrError, NoAgents, NoFit, ProtocolError
from gpumgr.wire.names import LIVE, State
from gpumgr.wire.policy import Policy  # issue 19
from gpumgr.wire.protocol import ContainerReport, GpuInfo, GpuSample
from gpumgr.wire.runspec import RunSpec  # issue 19

U = 1 << 30  # one GiB: sizes are small multiples of it, so exact fits and ties are common
MAX_BYTES = 2**63 - 1  # the largest size parse_bytes takes: a signed 64-bit integer, as msgpack and clients carry
MAX_MESSAGE = defaults.MAX_MESSAGE_BYTES
MAX_FIELD = defaults.MAX_FIELD_BYTES
MAX_ITEMS = defaults.MAX_ITEMS
HEAVY = settings(max_examples=200, deadline=None, database=None)
LIGHT = settings(max_examples=40, deadline=None, database=None)


# --- the reference scheduler -----------------------------------------------------------------
@dataclass(frozen=True)
class RefGpu:
    """A ready GPU as the reference sees it; ``free`` is computed by the test, not read from the product."""

    uuid: str
    node: str
    free: int


def schedulable(total: int, reserved: int, unmanaged: int, headroom: int) -> int:
    return max(0, total - reserved - unmanaged - headroom)


def feasible_choices(gpus: list[RefGpu], memory: int, count: int, node: str | None) -> list[tuple[RefGpu, ...]]:
    """Every set of ``count`` GPUs of one ready node (``node`` if pinned) that can each hold ``memory``."""
    choices = []
    for name in sorted({g.node for g in gpus}):
        if node is not None and name != node:
            continue
        on_node = [g for g in gpus if g.node == name]
        choices += [c for c in itertools.combinations(on_node, count) if all(g.free >= memory for g in c)]
    return choices


def check_outcome(gpus: list[RefGpu], memory: int, count: int, node: str | None, policy: Placement,
                  outcome: list[str] | Exception) -> None:
    """Assert that ``outcome`` (the chosen uuids, best first, or the error) is what the contract allows."""
    if not gpus:
        assert isinstance(outcome, NoAgents), f"no ready GPU, yet {outcome!r}"
        return
    choices = feasible_choices(gpus, memory, count, node)
    if not choices:
        assert isinstance(outcome, NoFit), f"nothing fits {count}x{memory} on {node}, yet {outcome!r}"
        scope = [g.free for g in gpus if node is None or g.node == node]
        if getattr(outcome, "code", "") == "never_fits":  # no node could hold it even empty: said at once
            return
        if scope:  # the message names the largest free memory where the request could have gone
            assert f"({max(scope)} bytes)" in str(outcome), str(outcome)
        return
    assert not isinstance(outcome, Exception), f"{outcome!r} although {len(choices)} choices fit"
    by_uuid = {g.uuid: g for g in gpus}
    assert len(outcome) == count == len(set(outcome))
    chosen = [by_uuid[u] for u in outcome]  # KeyError: it chose a GPU that is not ready
    assert frozenset(outcome) in {frozenset(g.uuid for g in c) for c in choices}
    scores = [sum(g.free for g in c) for c in choices]
    best = max(scores) if policy is Placement.SPREAD else min(scores)
    assert sum(g.free for g in chosen) == best, (policy, [g.free for g in chosen], sorted(scores))
    frees = [g.free for g in chosen]
    assert frees == sorted(frees, reverse=policy is Placement.SPREAD), "not best first"


def assert_index_consistent(index: FreeIndex, ready: list[GpuSlot]) -> None:
    """The index holds exactly the ready slots, each sorted under its current free memory."""
    entries = list(index.by_free)
    assert sorted(id(s) for _, s in entries) == sorted(id(s) for s in ready)
    for key, slot in entries:
        free = schedulable(slot.total, slot.reserved, slot.unmanaged, slot.headroom)
        assert key == (free, slot.uuid), f"stale key {key} for {slot.uuid} with {free} free"
        assert slot in index
    expected: dict[str, set[int]] = {}
    for slot in ready:
        expected.setdefault(slot.node, set()).add(id(slot))
    assert {n: {id(s) for s in slots} for n, slots in index.by_node.items()} == expected
    assert index.largest_free() == max((k[0] for k, _ in entries), default=0)


# --- the scheduler on a bare index -----------------------------------------------------------
memories = st.builds(lambda gib, nudge: max(1, gib * U + nudge), st.integers(0, 6), st.sampled_from([0, 0, 0, -1, 1]))
policies = st.sampled_from(list(Placement))


@HEAVY
@given(st.data())
def test_place_matches_the_brute_force_reference(data: st.DataObject) -> None:
    n_nodes = data.draw(st.sampled_from([1, 2, 3, 3, 4]), "nodes")
    per_node = st.sampled_from([0, 1, 2, 3, 4, 4])
    shape = data.draw(st.lists(per_node, min_size=n_nodes, max_size=n_nodes), "gpus per node")
    uuids = data.draw(st.lists(st.text("0123456789abcdef", min_size=1, max_size=3), unique=True,
                               min_size=sum(shape), max_size=sum(shape)), "uuids")
    slots: list[GpuSlot] = []
    for n, count in enumerate(shape):
        for i in range(count):
            total = data.draw(st.integers(0, 12))
            slots.append(GpuSlot(uuids[len(slots)], f"n{n}", i, total * U,
                                 reserved=data.draw(st.just(0) | st.integers(0, total + 1)) * U,  # +1: overbooked
                                 unmanaged=data.draw(st.just(0) | st.integers(0, 2)) * U,
                                 headroom=data.draw(st.sampled_from([0, 0, U // 2]))))
    # Build the index the way the cluster maintains it: nodes going up and down, free memory changing.
    index, up = FreeIndex(), set()
    history = st.tuples(st.sampled_from(["up", "down", "reserved", "reserved", "unmanaged"]), st.integers(0, 99),
                        st.integers(0, 8))
    for op, target, amount in [("up", n, 0) for n in range(n_nodes)] + data.draw(st.lists(history, max_size=8)):
        if op in ("up", "down"):
            node = f"n{target % n_nodes}"
            for slot in (s for s in slots if s.node == node):
                if op == "up" and slot not in index:
                    index.add(slot)
                elif op == "down":
                    index.discard(slot)
            (up.add if op == "up" else up.discard)(node)
        elif slots:
            slot = slots[target % len(slots)]
            setattr(slot, op, amount * U)
            index.update(slot)
    ready = [s for s in slots if s.node in up]
    assert_index_consistent(index, ready)

    memory, count = data.draw(memories, "memory"), data.draw(st.sampled_from([1, 1, 2, 2, 3]), "count")
    node = data.draw(st.sampled_from([None, None, "n0", "n1", "n2", "n3", "n4"]), "node")
    policy = data.draw(policies, "policy")
    before = [(key, id(slot)) for key, slot in index.by_free], [vars(s).copy() for s in slots]
    try:
        outcome: list[str] | Exception = [s.uuid for s in place(index, Request(memory, count, node, policy))]
    except GpumgrError as exc:
        outcome = exc
    refs = [RefGpu(s.uuid, s.node, schedulable(s.total, s.reserved, s.unmanaged, s.headroom)) for s in ready]
    check_outcome(refs, memory, count, node, policy, outcome)
    assert before == ([(key, id(slot)) for key, slot in index.by_free], [vars(s) for s in slots]), "place mutated"


# --- the scheduler through the cluster map ---------------------------------------------------
NODES = st.sampled_from(["a", "b", "c"])
FINAL = st.sampled_from([State.EXITED, State.KILLED, State.FAILED, State.REMOVED])


@dataclass
class Grant:
    node: str
    uuids: tuple[str, ...]
    memory: int
    running: bool


class ClusterMachine(RuleBasedStateMachine):
    """Register, heartbeat, reserve, start, finish, nodes down and forgotten; the model recomputes every grant.

    Checked after every step: each GPU's reserved memory and holders equal the sum over the live
    records (kept by the model, not read back), its free memory is total − reserved − unmanaged −
    headroom, and the free-memory index holds exactly the GPUs of ready nodes under their current
    free memory. Each reservation must match the reference and fit at grant time.
    """

    @initialize(headroom=st.sampled_from([0, U // 2, U]),
                shape=st.lists(st.lists(st.integers(1, 12), min_size=1, max_size=4), min_size=1, max_size=3))
    def start(self, headroom: int, shape: list[list[int]]) -> None:
        self.headroom = headroom
        self.cluster = Cluster(headroom=headroom)
        self.totals: dict[str, list[int]] = {}  # node -> its GPUs' totals, as last registered
        self.ready: set[str] = set()
        self.unmanaged: dict[str, int] = {}
        self.live: dict[str, Grant] = {}
        self.finished: list[str] = []
        self.adopted = 0
        for node, totals in zip(["a", "b", "c"], shape, strict=False):
            infos = [GpuInfo(uuid=f"{node}-g{i}", index=i, name="Sim", memory_total=t * U)
                     for i, t in enumerate(totals)]
            self.cluster.register(node, node.encode(), "docker", infos, [])
            self.totals[node] = [t * U for t in totals]
            self.ready.add(node)

    def uuids(self, node: str) -> list[str]:
        return [f"{node}-g{i}" for i in range(len(self.totals[node]))]

    def reserved(self, uuid: str) -> int:
        return sum(g.memory for g in self.live.values() if uuid in g.uuids)

    def report(self, cid: str) -> ContainerReport:
        g = self.live[cid]
        return ContainerReport(grant=cid, container_id=f"c-{cid}", gpus=list(g.uuids), gpu_memory=g.memory,
                               state="running")

    def drop_unreported(self, node: str, reported: set[str]) -> None:
        """A node's report leaves out running containers: their grants end if they hold a GPU it reports."""
        present = set(self.uuids(node))
        for cid, g in list(self.live.items()):
            if g.node == node and g.running and cid not in reported and present & set(g.uuids):
                self.finished.append(cid)
                del self.live[cid]

    @rule(node=NODES, totals=st.lists(st.integers(0, 12).map(lambda g: g * U), max_size=4), data=st.data())
    def register(self, node: str, totals: list[int], data: st.DataObject) -> None:
        running = [c for c, g in self.live.items() if g.node == node and g.running]  # ids are random: keep their order
        keep = data.draw(st.lists(st.sampled_from(running), unique=True)) if running else []
        reports = [self.report(cid) for cid in keep]
        adopt = None
        if totals and data.draw(st.booleans(), "adopt a running container"):
            adopt = f"adopted-{self.adopted}"
            self.adopted += 1
            on = data.draw(st.lists(st.integers(0, len(totals) - 1), min_size=1, max_size=2, unique=True))
            memory = data.draw(st.integers(1, 6)) * U
            self.live[adopt] = Grant(node, tuple(f"{node}-g{i}" for i in on), memory, running=True)
            reports.append(self.report(adopt))
        infos = [GpuInfo(uuid=f"{node}-g{i}", index=i, name="Sim", memory_total=t) for i, t in enumerate(totals)]
        refused = self.cluster.register(node, node.encode(), "docker", infos, reports)[0]
        self.totals[node] = totals
        self.ready.add(node)
        self.drop_unreported(node, set(keep) | {adopt})
        if adopt is not None:
            # an unknown container is adopted only if it fits beside what is still granted on each of its GPUs
            g = self.live[adopt]
            fits = all(self.reserved(u) <= totals[int(u.rsplit("-g", 1)[1])] - self.headroom for u in g.uuids)
            assert (adopt in refused) == (not fits), (adopt, refused, fits)
            if not fits:
                del self.live[adopt]
                self.finished.append(adopt)

    @precondition(lambda self: self.totals)
    @rule(data=st.data())
    def heartbeat(self, data: st.DataObject) -> None:
        node = data.draw(st.sampled_from(sorted(self.totals)), "node")
        everyone = sorted(u for n in self.totals for u in self.uuids(n))
        samples = data.draw(st.lists(st.tuples(st.sampled_from(everyone), st.integers(0, 6)), max_size=3)) \
            if everyone else []
        running = [c for c, g in self.live.items() if g.node == node and g.running]
        dropped = set(data.draw(st.lists(st.sampled_from(running), max_size=1))) if running else set()
        reports = [self.report(cid) for cid in running if cid not in dropped]
        answer = self.cluster.heartbeat(node, node.encode(), [
            GpuSample(uuid=u, memory_used=v * U, memory_unmanaged=v * U) for u, v in samples], reports)
        if node not in self.ready:  # back from down: nothing is taken from a heartbeat, its registration is asked for
            assert answer is None
            return
        for uuid, amount in samples:
            if uuid in self.uuids(node):  # another node's GPU in the sample is ignored
                self.unmanaged[uuid] = amount * U
        self.ready.add(node)
        self.drop_unreported(node, {c for c in running if c not in dropped})

    @precondition(lambda self: self.ready)
    @rule()
    def all_down(self) -> None:
        # silent for longer than down_after, well short of grant deadlines and of forgetting the node
        assert sorted(self.cluster.sweep(now=time.monotonic() + self.cluster.down_after + 1)[0]) == sorted(self.ready)
        self.ready.clear()

    @precondition(lambda self: set(self.totals) - self.ready)
    @rule(data=st.data())
    def forget(self, data: st.DataObject) -> None:
        node = data.draw(st.sampled_from(sorted(set(self.totals) - self.ready)))
        assert self.cluster.forget_node(node)
        for cid in [c for c, g in self.live.items() if g.node == node]:
            self.finished.append(cid)
            del self.live[cid]
        for uuid in self.uuids(node):
            self.unmanaged.pop(uuid, None)
        del self.totals[node]

    @rule(memory=memories, count=st.sampled_from([1, 1, 2, 3]), node=st.none() | NODES | st.just("zz"),
          policy=policies)
    def reserve(self, memory: int, count: int, node: str | None, policy: Placement) -> None:
        refs = []
        for name in sorted(self.ready):
            for uuid, total in zip(self.uuids(name), self.totals[name], strict=True):
                refs.append(RefGpu(uuid, name, schedulable(total, self.reserved(uuid), self.unmanaged.get(uuid, 0),
                                                           self.headroom)))
        spec = PlacementSpec(memory=memory, count=count, placement=str(policy), image="img", command=[], node=node)
        try:
            record = self.cluster.reserve(spec)
        except (NoFit, NoAgents) as exc:
            check_outcome(refs, memory, count, node, policy, exc)
            return
        check_outcome(refs, memory, count, node, policy, record.gpus)
        assert record.state is State.CREATING and record.gpu_memory == memory
        assert {u.rsplit("-g", 1)[0] for u in record.gpus} == {record.node}
        for uuid in record.gpus:  # never over-granted: what was free at grant time holds the new grant
            total = self.totals[record.node][int(uuid.rsplit("-g", 1)[1])]
            assert self.reserved(uuid) + memory <= total - self.headroom - self.unmanaged.get(uuid, 0)
        self.live[record.id] = Grant(record.node, tuple(record.gpus), memory, running=False)

    @precondition(lambda self: any(not g.running for g in self.live.values()))
    @rule(data=st.data())
    def started(self, data: st.DataObject) -> None:
        cid = data.draw(st.sampled_from([c for c, g in self.live.items() if not g.running]))
        assert self.cluster.started(cid, self.report(cid)).state is State.RUNNING
        self.live[cid].running = True

    @precondition(lambda self: self.live or self.finished)
    @rule(data=st.data(), state=FINAL)
    def finish(self, data: st.DataObject, state: State) -> None:
        cid = data.draw(st.sampled_from(list(self.live) + self.finished))
        record = self.cluster.finish(cid, state)
        assert record.state not in LIVE
        if cid in self.live:
            assert record.state is state
            del self.live[cid]
            self.finished.append(cid)

    @invariant()
    def grants_add_up(self) -> None:
        if not hasattr(self, "cluster"):
            return
        nodes = {n["name"]: n for n in self.cluster.nodes_view()}
        assert set(nodes) == set(self.totals)
        for name, view in nodes.items():
            assert (view["state"] == "ready") == (name in self.ready)
            assert [g["uuid"] for g in view["gpus"]] == self.uuids(name)
            for gpu, total in zip(view["gpus"], self.totals[name], strict=True):
                uuid, reserved, unmanaged = gpu["uuid"], self.reserved(gpu["uuid"]), self.unmanaged.get(gpu["uuid"], 0)
                assert gpu["memory_total"] == total
                assert gpu["memory_reserved"] == reserved, uuid
                assert gpu["memory_unmanaged"] == unmanaged, uuid
                assert set(gpu["containers"]) == {c for c, g in self.live.items() if uuid in g.uuids}
                assert gpu["memory_free"] == schedulable(total, reserved, unmanaged, self.headroom)
        live = {c.id: c.state for c in self.cluster.containers() if c.state in LIVE}
        assert live == {c: State.RUNNING if g.running else State.CREATING for c, g in self.live.items()}

    @invariant()
    def index_matches_the_map(self) -> None:
        if not hasattr(self, "cluster"):
            return
        # The free-memory index is private to the cluster; the test reads it to check it is never stale.
        ready = [gpu for name in self.ready for gpu in self.cluster.ledger.nodes[name].gpus]
        assert_index_consistent(self.cluster.ledger.index, ready)

    @invariant()
    def the_model_invariant_holds(self) -> None:
        if hasattr(self, "cluster"):
            assert self.cluster.check() == []


ClusterMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None, database=None,
                                            suppress_health_check=[HealthCheck.too_slow])
test_cluster_grants_stay_consistent = pytest.mark.timeout(600)(ClusterMachine.TestCase)


@settings(max_examples=30, deadline=None, database=None)
@given(moved=st.integers(1, 3), others=st.integers(0, 2), memory=st.integers(1, 8))
@example(moved=1, others=0, memory=8)
def test_a_node_back_by_heartbeat_never_corrupts_the_index(moved: int, others: int, memory: int) -> None:
    cluster = Cluster()
    infos = [GpuInfo(uuid=f"X{i}", index=i, name="Sim", memory_total=8 * U) for i in range(moved + others)]
    cluster.register("a", b"a", "docker", infos, [])
    cluster.sweep(now=time.monotonic() + cluster.down_after + 1)  # a goes silent; b (a second agent) takes its GPUs
    cluster.register("b", b"b", "docker", [i.model_copy(update={"index": n}) for n, i in enumerate(infos[:moved])], [])
    with contextlib.suppress(GpumgrError):  # a is back; refusing it would be fine
        cluster.heartbeat("a", b"a", [], [])
    for _ in range(2 * (moved + others) * 8 // memory + 2):  # fill every GPU
        try:
            cluster.reserve(PlacementSpec(memory=memory * U, count=1, placement="spread", image="i", command=[]))
        except (NoFit, NoAgents):
            break
    for node in cluster.nodes_view():
        for gpu in node["gpus"]:
            assert gpu["memory_reserved"] <= gpu["memory_total"], f"{gpu['uuid']} of {node['name']} over-granted"


# --- the wire codec ----------------------------------------------------------------------------
int64 = st.integers(-(2**63), 2**63 - 1)
leaves = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False)
          | st.text(max_size=8) | st.binary(max_size=8))
any_values = st.recursive(leaves, lambda inner: st.lists(inner, max_size=3)
                          | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)


#: issue 19: the container spec and policy, as examples (their fields' own validators decide what is valid)
WIRE_EXAMPLES: dict[Any, list[Any]] = {
    RunSpec: [RunSpec(), RunSpec.model_validate({"volumes": ["/data:/d:ro", "v:/v"], "ports": {"80": ["::1", None]},
                                                 "shm_size": "1g", "ulimits": [{"name": "memlock", "soft": -1}],
                                                 "log_config": {"type": "local", "config": {"max-size": "1m"}}})],
    Policy: [Policy(), Policy(bind_paths={"/data": "ro"}, cap_add=["ALL"], privileged=True)],
}


def strategy_for(annotation: Any, metadata: list[Any] | tuple[Any, ...] = ()) -> st.SearchStrategy[Any]:
    """Values of a pydantic field's type that satisfy its constraints (Ge/Gt/Le/Lt, MinLen/MaxLen)."""
    bound = {name: getattr(m, name) for m in metadata for name in ("ge", "gt", "le", "lt", "min_length", "max_length")
             if getattr(m, name, None) is not None}
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation in WIRE_EXAMPLES:  # issue 19: models whose fields carry validators of their own
        return st.sampled_from(WIRE_EXAMPLES[annotation])
    pattern = next((m.pattern for m in metadata if getattr(m, "pattern", None)), None)  # issue 19
    if annotation is str and pattern is not None:  # issue 19
        return st.from_regex(pattern, fullmatch=True).filter(lambda s: len(s) <= bound.get("max_length", 64))
    if annotation is Any:
        return any_values
    if origin is typing.Literal:  # issue 23: link names
        return st.sampled_from(args)
    if annotation is type(None):
        return st.none()
    if origin in (typing.Union, types.UnionType):
        return st.one_of([strategy_for(a) for a in args])
    if annotation is bool:
        return st.booleans()
    if annotation is int:
        low = bound.get("ge", bound.get("gt", -(2**63) - 1) + 1)
        high = bound.get("le", bound.get("lt", 2**63) - 1)
        return st.integers(low, high)
    if annotation is float:
        return st.floats(min_value=bound.get("ge", bound.get("gt")), max_value=bound.get("le", bound.get("lt")),
                         exclude_min="gt" in bound, exclude_max="lt" in bound, allow_nan=False)
    if annotation is str:
        low = bound.get("min_length", 0)
        return st.text(min_size=low, max_size=min(bound.get("max_length", 12), max(low, 12)))
    if origin is list:
        return st.lists(strategy_for(args[0]), min_size=bound.get("min_length", 0),
                        max_size=min(bound.get("max_length", 3), max(bound.get("min_length", 0), 3)))
    if origin is typing.Annotated:  # a constrained element (the fence's epoch: two bounded ints)
        return strategy_for(args[0], [m for a in args[1:] for m in getattr(a, "metadata", [a])])
    if origin is tuple and args and args[-1] is not Ellipsis:
        return st.tuples(*(strategy_for(a) for a in args))
    if origin is dict:
        return st.dictionaries(strategy_for(args[0]), strategy_for(args[1]), max_size=3)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return model_strategy(annotation)
    raise TypeError(f"no strategy for {annotation!r}; teach strategy_for about it")


def model_strategy(cls: type[BaseModel]) -> st.SearchStrategy[Any]:
    fields = {name: strategy_for(f.annotation, f.metadata) for name, f in cls.model_fields.items()}
    return st.builds(cls, **fields)


def frame_of(kind: str, body: Any, **head: Any) -> bytes:
    return msgpack.packb({"v": protocol.VERSION, "type": kind, "id": "x" * 32, "reply_to": None, "body": body, **head},
                         use_bin_type=True)


def assert_sound(frame: bytes) -> None:
    """``decode(frame)`` raises ProtocolError or gives a typed message that re-encodes to a fixed point."""
    try:
        head, message = protocol.decode(frame)
    except ProtocolError:
        return
    assert head.v == protocol.VERSION and type(message) is protocol.message_types()[head.type]
    again = protocol.encode(message, msg_id=head.id, reply_to=head.reply_to)
    head2, message2 = protocol.decode(again)
    assert (head2.type, head2.id, head2.reply_to) == (head.type, head.id, head.reply_to)
    assert protocol.encode(message2, msg_id=head.id, reply_to=head.reply_to) == again


@pytest.mark.parametrize("kind", sorted(protocol.message_types()))
@LIGHT
@given(data=st.data())
def test_every_message_type_round_trips(kind: str, data: st.DataObject) -> None:
    cls = protocol.message_types()[kind]
    message = data.draw(model_strategy(cls), "message")
    msg_id = data.draw(st.none() | st.text(min_size=1, max_size=64), "id")
    reply_to = data.draw(st.none() | st.text(max_size=64), "reply_to")
    frame = protocol.encode(message, msg_id=msg_id, reply_to=reply_to)
    assert len(frame) <= MAX_MESSAGE
    head, decoded = protocol.decode(frame)
    assert type(decoded) is cls and decoded == message
    assert (head.v, head.type, head.reply_to) == (protocol.VERSION, kind, reply_to)
    assert head.id == msg_id if msg_id else len(head.id) >= 1


def _reply_of_size(size: int) -> tuple[bytes, list[bytes]]:
    """A raw reply frame of exactly ``size`` bytes (chunks of at most MAX_FIELD), and its chunks."""
    chunks = [b"x" * 60_000] * ((size - 1_000) // 60_000) + [b"x" * 1_000]
    for _ in range(3):  # every chunk keeps a bin16 header, so the last one's length is right at once
        raw = frame_of("reply", {"ok": True, "result": {"c": chunks}, "error": None})
        chunks = [*chunks[:-1], b"x" * (len(chunks[-1]) + size - len(raw))]
    raw = frame_of("reply", {"ok": True, "result": {"c": chunks}, "error": None})
    assert len(raw) == size
    return raw, chunks


@settings(max_examples=12, deadline=None, database=None)
@given(offset=st.integers(-40, 40))
@example(offset=0)
@example(offset=1)
def test_the_frame_bound_is_exact_both_ways(offset: int) -> None:
    raw, chunks = _reply_of_size(MAX_MESSAGE + offset)
    message = protocol.Reply(ok=True, result={"c": chunks})
    if offset <= 0:
        assert protocol.decode(raw)[1] == message
        assert len(protocol.encode(message, msg_id="x" * 32)) == len(raw)
    else:
        for attempt in (lambda: protocol.decode(raw), lambda: protocol.encode(message, msg_id="x" * 32)):
            with pytest.raises(ProtocolError, match="bound"):
                attempt()


@settings(max_examples=10, deadline=None, database=None)
@given(prefix=st.binary(max_size=64), extra=st.integers(1, 1 << 16))
def test_oversized_garbage_is_refused_by_its_size(prefix: bytes, extra: int) -> None:
    with pytest.raises(ProtocolError, match="bound"):
        protocol.decode(prefix + bytes(MAX_MESSAGE + extra - len(prefix)))


@settings(max_examples=60, deadline=None, database=None)
@given(kind=st.sampled_from(["str", "utf8", "bin", "list", "map"]), offset=st.integers(-3, 3))
def test_field_bounds_are_exact(kind: str, offset: int) -> None:
    """No string or bin over MAX_FIELD bytes and no list or map over MAX_ITEMS items is decoded."""
    limit = MAX_ITEMS if kind in ("list", "map") else MAX_FIELD
    n = limit + offset
    value: Any = {
        "str": lambda: "x" * n,
        "utf8": lambda: "é" * (n // 2) + "x" * (n % 2),  # n bytes of UTF-8 in fewer characters
        "bin": lambda: b"x" * n,
        "list": lambda: [0] * n,
        "map": lambda: {str(i): 0 for i in range(n)},
    }[kind]()
    raw = frame_of("reply", {"ok": True, "result": {"v": value}})
    if n <= limit:
        assert protocol.decode(raw)[1].result == {"v": value}
    else:
        with pytest.raises(ProtocolError):
            protocol.decode(raw)


@HEAVY
@given(st.binary(max_size=1024))
def test_garbage_bytes_raise_only_protocol_error(data: bytes) -> None:
    assert_sound(data)


mutation = st.tuples(st.sampled_from(["flip", "insert", "delete", "truncate"]), st.integers(0, 1 << 20),
                     st.integers(0, 255))


@HEAVY
@given(kind=st.sampled_from(sorted(protocol.message_types())), data=st.data(),
       mutations=st.lists(mutation, min_size=1, max_size=4))
def test_mutated_frames_raise_only_protocol_error(kind: str, data: st.DataObject, mutations: list) -> None:
    frame = bytearray(protocol.encode(data.draw(model_strategy(protocol.message_types()[kind]))))
    for op, where, byte in mutations:
        at = where % (len(frame) + 1)
        if op == "flip" and at < len(frame):
            frame[at] ^= byte or 1
        elif op == "insert":
            frame[at:at] = bytes([byte])
        elif op == "delete":
            del frame[at:at + 1]
        elif op == "truncate":
            del frame[at:]
    assert_sound(bytes(frame))


packable = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8) | st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=4)),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.text(max_size=6) | st.binary(max_size=4) | st.integers(-5, 5) | st.none(), inner, max_size=3),
    max_leaves=10)
head_values = {
    "v": st.just(protocol.VERSION) | packable,
    "type": st.sampled_from(sorted(protocol.message_types())) | packable,
    "id": st.text(min_size=1, max_size=70) | packable,
    "reply_to": st.none() | st.text(max_size=70) | packable,
    "body": st.dictionaries(st.sampled_from(["ok", "result", "node", "gpus", "spec", "grant", "containers", "x"]),
                            packable, max_size=4) | packable,
}


@HEAVY
@given(data=st.data(), bin_type=st.booleans())
def test_random_msgpack_envelopes_raise_only_protocol_error(data: st.DataObject, bin_type: bool) -> None:
    head = {key: data.draw(values, key) for key, values in head_values.items() if data.draw(st.integers(0, 9)) > 0}
    extra = data.draw(st.dictionaries(st.text(max_size=4), packable, max_size=1), "extra keys")
    top = data.draw(st.just({**head, **extra}) | packable, "top")
    assert_sound(msgpack.packb(top, use_bin_type=bin_type))


