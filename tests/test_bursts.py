"""Burstable grants in the model: which burster a request reclaims, when none may be, and what is counted.

The cluster model itself (:class:`gpumgr.manager.model.cluster.Cluster`) on a logical clock, one node with one
24 GiB GPU, containers confirmed running and their use reported by heartbeats as an agent sends them.
"""

from __future__ import annotations

import pytest

from gpumgr.manager.model.cluster import Cluster
from gpumgr.manager.model.records import Container, PlacementSpec
from gpumgr.wire.errors import InvalidRequest, NoFit
from gpumgr.wire.names import BURST_RECLAIMED, State
from gpumgr.wire.protocol import ContainerReport, ContainerStatus, GpuInfo, GpuSample
from tests.lifecycle_model import LogicalClock

GiB = 1 << 30
GPU = "g0"


class OneGpu:
    """A cluster with node ``n`` holding one 24 GiB GPU; ``run`` places and confirms, ``beat`` reports use."""

    def __init__(self) -> None:
        self.clock = LogicalClock()
        self.cluster = Cluster(clock=self.clock)
        self.cluster.register("n", b"r", "docker", [GpuInfo(uuid=GPU, index=0, name="Sim", memory_total=24 * GiB)],
                              [])
        self.use: dict[str, int] = {}

    def run(self, request: int, limit: int = 0, priority: int = 0) -> Container:
        spec = PlacementSpec(memory=request, count=1, placement="spread", image="img", command=[], priority=priority,
                             memory_limit=limit)
        record, _ = self.cluster.submit(spec)
        self.cluster.started(record.id, ContainerReport(grant=record.id, container_id=f"c-{record.id}", gpus=[GPU],
                                                        gpu_memory=request, state="running"))
        self.clock.advance(1)
        return record

    def beat(self, **use: int) -> None:
        """A heartbeat in which each record (by id) uses the bytes given, the others what they used before."""
        self.use.update(use)
        live = [r for r in self.cluster.ledger.records.values() if r.state is State.RUNNING]
        statuses = [ContainerStatus(grant=r.id, container_id=f"c-{r.id}", state="running", gpu_memory=r.gpu_memory,
                                    usage={GPU: self.use.get(r.id, 0)}) for r in live]
        sample = GpuSample(uuid=GPU, memory_used=sum(self.use.get(r.id, 0) for r in live), memory_unmanaged=0)
        assert self.cluster.heartbeat("n", b"r", [sample], statuses) is not None

    def gpu(self) -> dict:
        return self.cluster.nodes_view()[0]["gpus"][0]  # type: ignore[no-any-return]

    def wanting(self, request: int) -> Container:
        """A POST of ``request`` bytes (not queued) that waits for a reclaim."""
        record, _ = self.cluster.submit(PlacementSpec(memory=request, count=1, placement="spread", image="img",
                                                      command=[]))
        assert record.state is State.QUEUED
        return record


@pytest.fixture
def one() -> OneGpu:
    return OneGpu()


def reclaimed(one: OneGpu) -> list[str]:
    return sorted(r.id for r in one.cluster.ledger.records.values()
                  if r.desired is State.PREEMPTED and r.desired_reason == BURST_RECLAIMED)


def test_the_burst_is_shown_and_taken_from_what_is_free(one):
    burster = one.run(4 * GiB, 12 * GiB)
    one.beat(**{burster.id: 10 * GiB})
    gpu = one.gpu()
    assert (gpu["memory_reserved"], gpu["memory_burst"], gpu["memory_free"]) == (4 * GiB, 6 * GiB, 14 * GiB)
    one.beat(**{burster.id: 3 * GiB})  # back under its request: no burst
    assert (one.gpu()["memory_burst"], one.gpu()["memory_free"]) == (0, 20 * GiB)


def test_the_lowest_priority_then_the_largest_burst_is_reclaimed_and_no_more(one):
    one.cluster.dispatcher.bursts.min_runtime = 0
    small, large, high = one.run(4 * GiB, 12 * GiB), one.run(4 * GiB, 12 * GiB), one.run(4 * GiB, 12 * GiB, 1)
    one.beat(**{small.id: 6 * GiB, large.id: 8 * GiB, high.id: 10 * GiB})  # 12 reserved + 12 burst: none free
    head = one.wanting(6 * GiB)
    assert reclaimed(one) == [large.id] and large.preempted_for == head.id  # frees 8 GiB: enough
    one.cluster.finish(large.id, State.KILLED, reason="stopped")
    assert (large.state, large.reason) == (State.PREEMPTED, BURST_RECLAIMED)
    one.cluster.dispatch()
    assert head.state is State.CREATING


def test_of_equal_bursters_the_youngest_is_reclaimed(one):
    one.cluster.dispatcher.bursts.min_runtime = 0
    older, younger = one.run(4 * GiB, 12 * GiB), one.run(4 * GiB, 12 * GiB)
    one.beat(**{older.id: 12 * GiB, younger.id: 12 * GiB})
    one.wanting(8 * GiB)
    assert reclaimed(one) == [younger.id]


def test_a_burster_within_burst_min_runtime_and_a_container_without_a_limit_are_never_reclaimed(one):
    one.cluster.dispatcher.bursts.min_runtime = 30
    burster, overrun = one.run(4 * GiB, 12 * GiB), one.run(4 * GiB)
    one.beat(**{burster.id: 12 * GiB, overrun.id: 8 * GiB})  # the second is over its grant: its agent kills it
    with pytest.raises(NoFit):
        one.cluster.submit(PlacementSpec(memory=10 * GiB, count=1, placement="spread", image="img", command=[]))
    assert reclaimed(one) == [] and not list(one.cluster.queue.ids())  # a refused POST leaves nothing waiting
    one.clock.advance(30)
    one.wanting(10 * GiB)
    assert reclaimed(one) == [burster.id]


def test_a_limit_below_the_request_is_refused_and_a_patch_keeps_limit_above_request(one):
    from gpumgr.manager.model.bursts.limits import limit_of

    with pytest.raises(InvalidRequest, match="below gpu_memory"):
        limit_of(8 * GiB, 4 * GiB)
    assert limit_of(4 * GiB, 4 * GiB) == 0 and limit_of(4 * GiB, None) == 0
    burster = one.run(4 * GiB, 12 * GiB)
    with pytest.raises(InvalidRequest):  # growing the request past the limit, without a new limit
        one.cluster.begin_resize(burster.id, 16 * GiB)
    assert (burster.gpu_memory, burster.gpu_memory_limit) == (4 * GiB, 12 * GiB)
    _, command = one.cluster.begin_resize(burster.id, None, limit=16 * GiB)
    assert command is not None and burster.gpu_memory_limit == 16 * GiB and burster.gpu_memory == 4 * GiB


def test_a_queued_request_reclaims_when_it_reaches_the_head(one):
    one.cluster.dispatcher.bursts.min_runtime = 0
    burster, blocker = one.run(4 * GiB, 12 * GiB), one.run(4 * GiB)
    one.beat(**{burster.id: 12 * GiB})  # 8 reserved, 8 burst: 8 free
    ahead = one.cluster.submit(PlacementSpec(memory=20 * GiB, count=1, placement="spread", image="img", command=[],
                                             priority=1), queue=True)[0]
    waiting = one.cluster.submit(PlacementSpec(memory=10 * GiB, count=1, placement="spread", image="img",
                                               command=[]), queue=True)[0]
    assert ahead.state is waiting.state is State.QUEUED
    assert reclaimed(one) == [burster.id] and burster.preempted_for == ahead.id  # for the head, not behind it
    one.cluster.withdraw(ahead.id)
    one.cluster.finish(burster.id, State.KILLED, reason="stopped")
    one.cluster.dispatch()
    assert waiting.state is State.CREATING and blocker.state is State.RUNNING


def test_quotas_and_accounts_count_the_request_not_the_limit(one):
    from gpumgr.manager.tenancy.accounts import AccountConfig, build_accounts
    from gpumgr.manager.tenancy.tenants import OPERATOR, Tenant, TenantBook

    team = Tenant("team", b"team-token-0123456789", 8 * GiB, None, 5)
    one.cluster.tenants = TenantBook({"team": team}, "operator-token-0000")
    one.cluster.accounts = build_accounts({"a": AccountConfig(quota={"gpu_memory": 4 * GiB})}, {"team": "a"})
    spec = PlacementSpec(memory=4 * GiB, count=1, placement="spread", image="img", command=[], memory_limit=20 * GiB)
    record, _ = one.cluster.submit(spec, tenant=team)  # a 20 GiB limit, quotas of 8 and 4 GiB: the 4 GiB counts
    assert record.state is State.CREATING
    assert one.cluster.tenants_view(OPERATOR)[0]["in_use"]["gpu_memory"] == 4 * GiB
    account = next(a for a in one.cluster.accounts_view(OPERATOR) or [] if a["name"] == "a")
    assert account["allocated"] == account["requested"] == 4 * GiB and not account["waiting"]


def test_a_restarted_manager_adopts_the_limit_and_the_burst_from_a_registration():
    cluster = Cluster(clock=LogicalClock())
    report = ContainerReport(grant="b1", container_id="c-b1", gpus=[GPU], gpu_memory=4 * GiB, state="running",
                             gpu_memory_limit=12 * GiB, usage={GPU: 10 * GiB})
    cluster.register("n", b"r", "docker", [GpuInfo(uuid=GPU, index=0, name="Sim", memory_total=24 * GiB)], [report])
    record = cluster.get("b1")
    assert (record.state, record.gpu_memory, record.gpu_memory_limit) == (State.RUNNING, 4 * GiB, 12 * GiB)
    gpu = cluster.nodes_view()[0]["gpus"][0]
    assert (gpu["memory_reserved"], gpu["memory_burst"], gpu["memory_free"]) == (4 * GiB, 6 * GiB, 14 * GiB)


def test_the_agents_protection_stops_only_bursters_never_a_container_without_a_limit() -> None:
    """A container with no limit over its grant is the enforcer's, per its on_overrun (``report`` keeps it running):
    the protection of granted bytes stopped it too (CI: a report-policy container with a huge usage figure)."""
    from gpumgr.agent.bursts import bursters
    from gpumgr.agent.meter import Sample
    from gpumgr.agent.runtimes.runtime import Managed

    G = 1 << 30
    plain = Managed("plain", "c-plain", "plain", ["GPU-0"], 1 * G, on_overrun="report")
    burster = Managed("burst", "c-burst", "burst", ["GPU-0"], 4 * G, gpu_memory_limit=12 * G)
    sample = Sample([], usage={"plain": {"GPU-0": 30 * G}, "burst": {"GPU-0": 10 * G}})
    found = bursters("GPU-0", sample, {"plain": plain, "burst": burster})
    assert [(c.grant, used) for c, used in found] == [("burst", 10 * G)]
