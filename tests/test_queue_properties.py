"""Generated tests of the queue's rules on the cluster map: hypothesis drives submits, dispatches, starts,
ends, withdrawals, resizes and preemptions in any order, and after every step checks that

- every GPU's reserved memory is the sum of the live grants on it and never over what it can grant;
- a queued request holds nothing, and the queue holds exactly the queued records;
- after a dispatch the first request in line that is not stepped over does not fit (room never
  sits idle while a request waits for it);
- each tenant's counted memory and containers are the sums over its live and queued records, and its
  live grants never pass its quota;
- only preemptible containers of lower priority than the request they made room for are preempted.

Nothing changes without accounts (issue 34): seeded scripts played on the real map decide exactly what they
decided on the tree before accounts existed (the digests in ``tests/data``; see :mod:`tests.queue_trace`), and
with one account holding everyone, whose quota never binds, a generated script decides as with no accounts.
"""

from __future__ import annotations

import hashlib
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gpumgr.manager.model.cluster import Cluster
from gpumgr.manager.model.records import OpKind, PlacementSpec
from gpumgr.manager.placing.scheduler import Placement, Request, place
from gpumgr.manager.tenancy.tenants import Tenant, TenantBook
from gpumgr.wire.errors import GpumgrError, NoFit, QuotaExceeded
from gpumgr.wire.names import LIVE, State
from gpumgr.wire.protocol import ContainerReport, GpuInfo, Reply
from tests import queue_trace
from tests.accounts_model import account_tree

U = 1 << 30
TENANTS = {"t1": Tenant("t1", b"t1" * 8, 12 * U, 4, 5), "t2": Tenant("t2", b"t2" * 8, None, None, 2)}


class QueueMachine(RuleBasedStateMachine):
    @initialize(sizes=st.lists(st.integers(2, 8), min_size=1, max_size=3))
    def start(self, sizes: list[int]) -> None:
        self.cluster = Cluster(aging=3600.0)
        self.cluster.tenants = TenantBook(dict(TENANTS), "operator-token-0000")
        infos = [GpuInfo(uuid=f"a-g{i}", index=i, name="Sim", memory_total=s * U) for i, s in enumerate(sizes)]
        self.cluster.register("a", b"a", "docker", infos, [])
        self.totals = {f"a-g{i}": s * U for i, s in enumerate(sizes)}

    def records(self, *states: State) -> list[str]:
        return [c.id for c in self.cluster.containers() if c.state in states]

    @rule(memory=st.integers(1, 8), count=st.sampled_from([1, 1, 2]), queue=st.booleans(),
          priority=st.integers(0, 5), preemptible=st.booleans(), tenant=st.sampled_from([None, "t1", "t2"]))
    def submit(self, memory: int, count: int, queue: bool, priority: int, preemptible: bool,
               tenant: str | None) -> None:
        owner = TENANTS.get(tenant) if tenant else None
        spec = PlacementSpec(memory=memory * U, count=count, placement="spread", image="img", command=[],
                             priority=min(priority, owner.priority) if owner else priority, preemptible=preemptible)
        try:
            record, _ = self.cluster.submit(spec, queue=queue, tenant=owner)
        except QuotaExceeded:
            return
        except (NoFit, GpumgrError):
            sizes = sorted(self.totals.values(), reverse=True)
            assert not queue or count > len(sizes) or sizes[count - 1] < memory * U, "a request that could fit"
            return
        assert record.state in (State.CREATING, State.QUEUED)
        assert queue or record.state is State.CREATING

    @rule()
    def dispatch(self) -> None:
        commands, _ = self.cluster.dispatch()
        victims = [c for c in commands if c.kind is OpKind.REMOVE]
        for command in commands:
            assert command.record.gpus  # placed, or chosen to make room
        for command in victims:
            victim = command.record
            assert victim.preemptible and victim.preempted_for is not None
            head = self.cluster.get(victim.preempted_for)
            assert victim.priority < head.priority, (victim.priority, head.priority)
            self.cluster.settle(command, Reply(ok=True), None)
            assert victim.state is State.PREEMPTED
        if not victims:
            self.assert_head_blocked()

    @precondition(lambda self: self.records(State.CREATING))
    @rule(data=st.data())
    def confirm(self, data: st.DataObject) -> None:
        cid = data.draw(st.sampled_from(self.records(State.CREATING)))
        record = self.cluster.get(cid)
        self.cluster.started(cid, ContainerReport(grant=cid, container_id=f"c-{cid}", gpus=record.gpus,
                                                  gpu_memory=record.gpu_memory, state="running"))

    @precondition(lambda self: self.records(State.CREATING, State.RUNNING, State.QUEUED))
    @rule(data=st.data(), state=st.sampled_from([State.EXITED, State.REMOVED, State.FAILED]))
    def end(self, data: st.DataObject, state: State) -> None:
        cid = data.draw(st.sampled_from(self.records(State.CREATING, State.RUNNING, State.QUEUED)))
        if self.cluster.get(cid).state is State.QUEUED:
            self.cluster.withdraw(cid)
            assert self.cluster.get(cid).state is State.REMOVED
        else:
            self.cluster.finish(cid, state)

    @precondition(lambda self: self.records(State.RUNNING, State.QUEUED))
    @rule(data=st.data(), memory=st.integers(1, 8))
    def resize(self, data: st.DataObject, memory: int) -> None:
        cid = data.draw(st.sampled_from(self.records(State.RUNNING, State.QUEUED)))
        record = self.cluster.get(cid)
        tenant = TENANTS.get(record.tenant) if record.tenant else None
        try:
            record, command = self.cluster.begin_resize(cid, memory * U, force=True, tenant=tenant)
        except GpumgrError:
            return
        if command is not None:
            self.cluster.settle(command, Reply(ok=data.draw(st.booleans(), "node took it")), None)

    def assert_head_blocked(self) -> None:
        cluster = self.cluster
        for cid in cluster.queue.ids():
            record = cluster.get(cid)
            assert record.spec is not None
            if not cluster.quotas.within_live(record):  # stepped over: only its own quota holds it
                continue
            if cluster.ledger.capacity(record.spec.count) < record.gpu_memory:
                continue  # stepped over: no node on the map could ever hold it
            request = Request(record.spec.memory, record.spec.count, None, Placement.SPREAD)
            try:
                place(cluster.ledger.index, request)
            except NoFit:
                return
            raise AssertionError(f"queued {cid} fits but was left waiting")

    @invariant()
    def grants_add_up(self) -> None:
        live = [c for c in self.cluster.containers() if c.state in LIVE]
        for node in self.cluster.nodes_view():
            for gpu in node["gpus"]:
                held = sum(c.held for c in live if gpu["uuid"] in c.gpus)
                assert gpu["memory_reserved"] == held <= self.totals[gpu["uuid"]]

    @invariant()
    def the_model_invariant_holds(self) -> None:
        assert self.cluster.check() == []

    @invariant()
    def queued_hold_nothing(self) -> None:
        queued = self.records(State.QUEUED)
        assert sorted(queued) == sorted(self.cluster.queue.ids())
        for cid in queued:
            record = self.cluster.get(cid)
            assert not record.gpus and not record.node and record.spec is not None

    @invariant()
    def tenants_add_up(self) -> None:
        for name, tenant in TENANTS.items():
            mine = [c for c in self.cluster.containers() if c.tenant == name and c.state in (*LIVE, State.QUEUED)]
            use = self.cluster.usage_of(name)
            assert use.memory == sum(c.gpu_memory * c.count for c in mine)
            assert use.containers == len(mine)
            live = sum(c.gpu_memory * c.count for c in mine if c.state in LIVE)
            assert use.live_memory == live
            if tenant.gpu_memory is not None:
                assert use.memory <= tenant.gpu_memory

    @invariant()
    def only_preemptible_are_preempted(self) -> None:
        for record in self.cluster.containers(state=State.PREEMPTED):
            assert record.preemptible and record.preempted_for is not None
            assert record.priority < self.cluster.get(record.preempted_for).priority


QueueMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=50, deadline=None, database=None,
                                          suppress_health_check=[HealthCheck.too_slow])
test_the_queue_keeps_its_rules = QueueMachine.TestCase


def test_a_request_that_does_not_wait_never_preempts_anything() -> None:
    """Only a queued request is worth stopping a container for: one refused with 409 must leave everything running."""
    cluster = Cluster(aging=3600.0)
    cluster.register("a", b"a", "docker", [GpuInfo(uuid="a-g0", index=0, name="Sim", memory_total=8 * U)], [])
    victim, _ = cluster.submit(PlacementSpec(memory=6 * U, count=1, placement="spread", image="img", command=[],
                                             preemptible=True))
    cluster.started(victim.id, ContainerReport(grant=victim.id, container_id="c1", gpus=victim.gpus,
                                               gpu_memory=6 * U, state="running"))
    # something waits (for a node that is not here), so the newcomer goes through the queue's walk
    cluster.submit(PlacementSpec(memory=U, count=1, placement="spread", image="img", command=[], node="elsewhere"),
                   queue=True)
    try:
        cluster.submit(PlacementSpec(memory=4 * U, count=1, placement="spread", image="img", command=[],
                                     priority=5))
    except NoFit:
        pass
    else:
        raise AssertionError("4 GiB cannot fit beside 6 GiB on an 8 GiB GPU")
    commands, _ = cluster.dispatch()
    assert commands == [] and cluster.get(victim.id).preempted_for is None


def test_without_accounts_the_queue_decides_as_it_did_before_accounts_existed() -> None:
    """Every seeded script records the same decisions, line for line, as on the tree before accounts; and the
    scripts reach what the proof needs (preemptions, nodes down and back, every refusal), or it proves little."""
    recorded = json.loads(queue_trace.DATA.read_text())
    assert (recorded["seeds"], recorded["steps"]) == (queue_trace.SEEDS, queue_trace.STEPS)
    # what the scripts must reach, as it reads in a trace's lines
    needs = {"a node down": ',false]', "one back": '"registered"', "a preemption": ',"preempted","preempted",',
             "a queued request": ',"queued","running",', "a running one": ',"running","running",',
             **{code: f'["error","{code}"' for code in ("quota_exceeded", "no_fit", "never_fits", "no_agents")}}
    changed, reached = [], set()
    for seed in range(queue_trace.SEEDS):
        trace = "\n".join(queue_trace.Trace().play(queue_trace.script(seed)))
        if hashlib.sha256(trace.encode()).hexdigest() != recorded["digests"][seed]:
            changed.append(seed)
        reached |= {need for need, text in needs.items() if text in trace}
    assert not changed, (f"seeds {changed} decide otherwise than before accounts; diff "
                         "'python -m tests.queue_trace show SEED' on both trees (see tests/queue_trace.py)")
    assert reached == set(needs), set(needs) - reached


def everyone_in_default(cluster: Cluster) -> None:
    """One account holds every tenant and the operator (``default``), with a quota no script can reach.

    Twice the capacity, not the capacity itself: at exactly the capacity a request that cannot fit now because
    the map is full passes the quota first, and is refused ``over_quota`` instead of ``no_fit`` (the issue's
    rule; ``never_fits`` and ``no_agents`` come before ``over_quota``).
    """
    cluster.accounts = account_tree({"default": {"quota": {"gpu_memory": 2 * queue_trace.CAPACITY}}},
                                    dict.fromkeys(queue_trace.TENANTS))


#: the scripts' actions as often as in the seeded ones (a submit most often), long enough to fill the map; each
#: step's numbers come from one drawn integer (hypothesis' own integers favour 0 and the bounds)
steps = st.lists(st.tuples(st.sampled_from([a for a, weight in queue_trace.ACTIONS for _ in range(weight)]),
                           st.integers(0, 2**32 - 1)), min_size=20, max_size=120)


def spread(number: int) -> tuple[int, ...]:
    """Six numbers below 1000, evenly spread over every ``number``."""
    digest = hashlib.sha256(number.to_bytes(4, "big")).digest()
    return tuple(int.from_bytes(digest[4 * i:4 * i + 4], "big") % 1000 for i in range(6))


@settings(max_examples=120, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(script=steps)
def test_one_account_holding_everyone_decides_as_no_accounts(script: list[tuple[str, int]]) -> None:
    """Two maps driven side by side, one without accounts and one with a single account whose quota never
    binds: after every step their decisions are the same (placements, queue order, stops, refusals)."""
    plain, one = queue_trace.Trace(), queue_trace.Trace(everyone_in_default)
    assert one.cluster.accounts is not None
    for number, (action, drawn) in enumerate(script):
        assert plain.step(action, spread(drawn)) == one.step(action, spread(drawn)), (number, action)
