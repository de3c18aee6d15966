"""Fair share across accounts (issue 34): the shares as KAI computes them, KAI's fixture and its reclaim on the
cluster map, the rule that cannot loop, over_quota and limits, reclaim's exclusions, and the tree's config."""

from __future__ import annotations

import pytest

from gpumgr.manager.fairshare.reclaim import allowed
from gpumgr.manager.fairshare.shares import compute
from gpumgr.manager.model.cluster import Cluster
from gpumgr.manager.model.records import OpKind, PlacementSpec
from gpumgr.manager.tenancy.accounts import DEFAULT, AccountConfig, build_accounts
from gpumgr.manager.tenancy.tenants import OPERATOR, Principal
from gpumgr.wire.errors import Conflict, NoAgents, NoFit
from gpumgr.wire.names import State
from gpumgr.wire.protocol import ContainerReport, GpuInfo
from tests.accounts_model import Accounts, account_tree

G = 80 << 30  # one GPU of KAI's fixture
KAI = {"a0": {"quota": {"gpu_memory": 10 * G}, "over_quota_weight": 3, "reclaim_min_runtime": 1},
       "a1": {"quota": {"gpu_memory": 10 * G}, "over_quota_weight": 1, "reclaim_min_runtime": 1}}


def shares_of(accounts: dict, requested: dict[str, float], capacity: float) -> dict[str, float]:
    tree = account_tree(accounts, {})
    return compute(tree, {}, requested, capacity).fair


# --- the arithmetic ---------------------------------------------------------------------------------
def test_kai_fixture_both_asking_for_everything_share_70_and_30() -> None:
    fair = shares_of(KAI, {"a0": 100 * G, "a1": 100 * G}, 100 * G)
    assert fair["a0"] == pytest.approx(70 * G) and fair["a1"] == pytest.approx(30 * G)
    assert fair[DEFAULT] == 0


def test_one_account_alone_may_have_everything_it_asks_for() -> None:
    fair = shares_of(KAI, {"a0": 100 * G}, 100 * G)
    assert fair["a0"] == pytest.approx(100 * G) and fair["a1"] == 0


def test_quotas_past_the_capacity_are_scaled_down_in_proportion_first() -> None:
    accounts = {"a": {"quota": {"gpu_memory": 30 * G}}, "b": {"quota": {"gpu_memory": 10 * G}}}
    fair = shares_of(accounts, {"a": 40 * G, "b": 40 * G}, 20 * G)  # half the nodes are down
    assert fair["a"] == pytest.approx(15 * G) and fair["b"] == pytest.approx(5 * G)


def test_the_surplus_goes_to_the_higher_priority_first_then_by_weight() -> None:
    accounts = {"prod": {"quota": {"gpu_memory": 2 * G}, "priority": 1},
                "x": {"quota": {"gpu_memory": 2 * G}, "over_quota_weight": 3},
                "y": {"quota": {"gpu_memory": 2 * G}, "over_quota_weight": 1}}
    fair = shares_of(accounts, {"prod": 5 * G, "x": 100 * G, "y": 100 * G}, 14 * G)
    # quotas 2+2+2, then prod takes its 3 more first, and the 5 left go 3:1
    assert fair["prod"] == pytest.approx(5 * G)
    assert fair["x"] == pytest.approx(2 * G + 3.75 * G) and fair["y"] == pytest.approx(2 * G + 1.25 * G)


def test_a_limit_caps_quota_plus_borrowing_and_the_rest_goes_to_the_others() -> None:
    accounts = {"a": {"quota": {"gpu_memory": 10 * G}, "over_quota_weight": 3, "limit": {"gpu_memory": 20 * G}},
                "b": {"quota": {"gpu_memory": 10 * G}, "over_quota_weight": 1, "limit": {"gpu_memory": -1}}}
    fair = shares_of(accounts, {"a": 100 * G, "b": 100 * G}, 100 * G)
    assert fair["a"] == pytest.approx(20 * G) and fair["b"] == pytest.approx(80 * G)


def test_children_share_what_their_parent_gets() -> None:
    accounts = {"research": {"quota": {"gpu_memory": 4 * G}, "over_quota_weight": 3},
                "research/vision": {"quota": {"gpu_memory": 2 * G}},
                "research/nlp": {"quota": {"gpu_memory": 0}, "over_quota_weight": 1},
                "prod": {"quota": {"gpu_memory": 4 * G}, "over_quota_weight": 1}}
    fair = shares_of(accounts, {"research/vision": 10 * G, "research/nlp": 10 * G, "prod": 10 * G}, 12 * G)
    assert fair["research"] == pytest.approx(7 * G) and fair["prod"] == pytest.approx(5 * G)
    # vision's quota 2, then the 5 left split 1:1 by weight
    assert fair["research/vision"] == pytest.approx(4.5 * G) and fair["research/nlp"] == pytest.approx(2.5 * G)


def test_the_rule_fixture_shares_are_1_75_and_2_25() -> None:
    accounts = {"a0": {"quota": {"gpu_memory": G}, "over_quota_weight": 3},
                "a1": {"quota": {"gpu_memory": 2 * G}, "over_quota_weight": 1}}
    fair = shares_of(accounts, {"a0": 4 * G, "a1": 4 * G}, 4 * G)
    assert fair["a0"] == pytest.approx(1.75 * G) and fair["a1"] == pytest.approx(2.25 * G)


def test_less_than_or_equal_to_final_share() -> None:
    tree = account_tree(KAI, {})
    shares = compute(tree, {"a0": 71 * G, "a1": 29 * G}, {"a1": 71 * G}, 100 * G)
    assert allowed(shares, "a1", G, "a0", G)  # 30/30 <= 70/70
    shares = compute(tree, {"a0": 70 * G, "a1": 30 * G}, {"a1": 70 * G}, 100 * G)
    assert not allowed(shares, "a1", G, "a0", G)  # 31/30 > 69/70: settled


# --- KAI's fixture on the cluster map ---------------------------------------------------------------
def test_kai_fixture_on_the_map_both_at_once_get_70_and_30_without_reclaim() -> None:
    sim = Accounts(KAI, nodes=0, gpus=4, gpu_memory=G)
    for _ in range(100):  # interleaved, before any node is there: both ask for everything at once
        sim.ask("a0", 1)
        sim.ask("a1", 1)
    for n in range(25):
        sim.add_node(f"n{n}", 4)
    sim.settle_down()
    assert (sim.gpus_of("a0"), sim.gpus_of("a1")) == (70, 30)
    assert sim.reclaimed == [] and sim.cluster.dispatcher.fair.reclaims == 0
    sim.check()


def test_kai_fixture_the_first_borrows_everything_then_the_second_reclaims_30_and_it_holds() -> None:
    sim = Accounts(KAI, nodes=25, gpus=4, gpu_memory=G)
    first = sim.ask("a0", 100)
    assert sim.gpus_of("a0") == 100
    assert sum(r.over_quota for r in first) == 90 and not any(r.over_quota for r in first[:10])
    second = sim.ask("a1", 100)
    assert all(r.state is State.QUEUED for r in second)
    sim.step(2.0)  # the borrowers have run their reclaim_min_runtime
    sim.settle_down(resubmit=True)
    assert (sim.gpus_of("a0"), sim.gpus_of("a1")) == (70, 30)
    assert len(sim.reclaimed) == 30
    for victim in sim.reclaimed:
        assert victim.account == "a0" and victim.over_quota
        assert victim.reason == "reclaimed" and victim.detail["reclaimed_for_account"] == "a1"
        assert sim.cluster.get(victim.preempted_for or "").account == "a1"
    # after that no reclaim happens, however long both keep asking (a0's stopped jobs ask again)
    for _ in range(600):
        assert sim.step(1.0, resubmit=True) == []
    assert (sim.gpus_of("a0"), sim.gpus_of("a1")) == (70, 30)
    sim.check()


@pytest.mark.parametrize("order", ["a0 first", "a1 first", "interleaved"])
def test_the_rule_cannot_loop(order: str) -> None:
    """4 GPUs; a0 quota 1 weight 3, a1 quota 2 weight 1; both ask 4 GPUs in half-GPU pieces: fair 1.75 and 2.25."""
    accounts = {"a0": {"quota": {"gpu_memory": G}, "over_quota_weight": 3, "reclaim_min_runtime": 1},
                "a1": {"quota": {"gpu_memory": 2 * G}, "over_quota_weight": 1, "reclaim_min_runtime": 1}}
    sim = Accounts(accounts, nodes=1, gpus=4, gpu_memory=G)
    half = G // 2
    turns = {"a0 first": ["a0"] * 8 + ["a1"] * 8, "a1 first": ["a1"] * 8 + ["a0"] * 8,
             "interleaved": ["a0", "a1"] * 8}[order]
    for account in turns:
        sim.ask(account, 1, half)
    sim.step(2.0, resubmit=True)
    sim.settle_down(resubmit=True)
    assert sim.fair_gpus("a0") == pytest.approx(1.75) and sim.fair_gpus("a1") == pytest.approx(2.25)
    assert sim.gpus_of("a0") >= 1 and sim.gpus_of("a1") >= 2  # neither ends below its quota
    assert sim.gpus_of("a0") + sim.gpus_of("a1") == 4
    reclaims = sim.cluster.dispatcher.fair.reclaims
    for _ in range(600):  # 10 minutes of simulated time bring no reclaim
        assert sim.step(1.0, resubmit=True) == []
    assert sim.cluster.dispatcher.fair.reclaims == reclaims
    sim.check()


# --- borrowing and limits ---------------------------------------------------------------------------
SMALL = {"a": {"quota": {"gpu_memory": 2 * G}, "limit": {"gpu_memory": 3 * G}, "reclaim_min_runtime": 5},
         "b": {"quota": {"gpu_memory": 2 * G}}}


def test_past_its_quota_a_request_that_is_not_preemptible_waits_or_is_409_over_quota() -> None:
    sim = Accounts(SMALL, nodes=1, gpus=4, gpu_memory=G)
    within = sim.ask("a", 2, preemptible=False, queue=False)
    assert all(r.state is State.RUNNING and not r.over_quota for r in within)
    with pytest.raises(Conflict) as refused:
        sim.ask("a", 1, preemptible=False, queue=False)
    assert refused.value.code == "over_quota" and "preemptible" in str(refused.value)
    (waiting,) = sim.ask("a", 1, preemptible=False, queue=True)
    assert waiting.state is State.QUEUED  # 202: it waits for its account's allocation to fall
    sim.step()
    assert waiting.state is State.QUEUED
    sim.cluster.finish(within[0].id, State.EXITED, exit_code=0)
    sim.step()
    assert waiting.state is State.RUNNING and not waiting.over_quota
    sim.check()


def test_a_request_that_can_never_run_or_has_no_agent_is_told_so_before_over_quota() -> None:
    """``409 over_quota`` tells a user to send ``"queue": true`` and wait for the account's allocation to fall:
    for a request no GPU could ever hold (``never_fits``) or with no agent ready (``503 no_agents``) that
    advice is wrong, so those refusals come first, as they do without accounts."""
    sim = Accounts(SMALL, nodes=1, gpus=4, gpu_memory=G)
    within = sim.ask("a", 2, preemptible=False, queue=False)
    with pytest.raises(NoFit) as never:
        sim.ask("a", 1, memory=2 * G, preemptible=False, queue=False)
    assert never.value.code == "never_fits"
    sim.clock.advance(sim.cluster.down_after + 1)
    assert sim.cluster.sweep()[0] == ["n0"]
    with pytest.raises(NoAgents):
        sim.ask("a", 1, preemptible=False, queue=False)
    with pytest.raises(Conflict) as refused:  # with an agent ready again, past its quota it is over_quota
        sim.heal(["n0"], [], within)
        sim.ask("a", 1, preemptible=False, queue=False)
    assert refused.value.code == "over_quota"
    sim.check()


def test_a_preemptible_request_borrows_marked_over_quota_up_to_the_limit() -> None:
    sim = Accounts(SMALL, nodes=1, gpus=4, gpu_memory=G)
    records = sim.ask("a", 3, queue=False)
    assert [r.over_quota for r in records] == [False, False, True]
    with pytest.raises(Conflict) as refused:
        sim.ask("a", 1, queue=False)  # quota plus borrowing may not pass the limit of 3 GPUs
    assert refused.value.code == "over_quota" and "limit" in str(refused.value)
    with pytest.raises(Conflict) as never:
        sim.ask("a", 1, 4 * G // 1, queue=True)
    assert never.value.code == "over_quota" and "never" in str(never.value)
    assert sim.cluster.get(records[2].id).over_quota  # fixed at placement
    sim.check()


def test_reclaim_waits_for_reclaim_min_runtime_and_stops_only_over_quota_containers() -> None:
    sim = Accounts(SMALL, nodes=1, gpus=4, gpu_memory=G)
    mine = sim.ask("a", 3)  # two within quota, one borrowed
    sim.ask("b", 1)  # fits the free GPU
    (waiting,) = sim.ask("b", 1)
    assert waiting.state is State.QUEUED
    assert sim.step(1.0) == []  # the borrower has run 1 s of its 5
    assert sim.step(3.0) == []
    (victim,) = sim.step(1.5)
    assert victim.id == mine[2].id and victim.over_quota and victim.reason == "reclaimed"
    sim.step()
    assert waiting.state is State.RUNNING
    assert all(r.state is State.RUNNING for r in mine[:2])  # never stopped: not over quota
    sim.check()


def test_priority_preemption_happens_only_inside_one_account() -> None:
    accounts = {"a": {"quota": {"gpu_memory": 5 * G}}, "b": {"quota": {"gpu_memory": 0}}}
    sim = Accounts(accounts, nodes=1, gpus=4, gpu_memory=G)
    low = sim.ask("a", 4, priority=0)  # within a's quota: none of them borrows
    (theirs,) = sim.ask("b", 1, priority=9)
    for _ in range(5):
        assert sim.step(2.0) == []  # b's priority gives it no right to a's containers
    assert theirs.state is State.QUEUED
    sim.cluster.withdraw(theirs.id)
    (mine,) = sim.ask("a", 1, priority=9, preemptible=False)
    (stopped,) = sim.step()
    assert stopped.id in {r.id for r in low} and stopped.reason != "reclaimed"
    sim.step()
    assert mine.state is State.RUNNING
    sim.check()


def test_a_blocked_head_blocks_only_its_own_account() -> None:
    accounts = {"a": {"quota": {"gpu_memory": 4 * G}}, "b": {"quota": {"gpu_memory": 4 * G}}}
    sim = Accounts(accounts, nodes=2, gpus=2, gpu_memory=G)
    sim.ask("a", 3)
    big = PlacementSpec(memory=G, count=2, placement="spread", image="img", command=[], preemptible=True)
    wide, _ = sim.cluster.submit(big, queue=True, tenant=sim.tenants["a"])  # 2 GPUs of one node: none free
    (small,) = sim.ask("b", 1)
    assert wide.state is State.QUEUED and small.state is State.RUNNING
    sim.check()


def test_reclaim_is_paused_while_the_zone_rule_holds() -> None:
    accounts = {"a": {"quota": {"gpu_memory": G}, "reclaim_min_runtime": 0},
                "b": {"quota": {"gpu_memory": G}, "reclaim_min_runtime": 0}}
    sim = Accounts(accounts, nodes=10, gpus=1, gpu_memory=G)
    held = sim.ask("a", 10)
    alive, silent = [f"n{i}" for i in range(4)], [f"n{i}" for i in range(4, 10)]
    sim.partition(alive, held)  # six of ten silent at once: a partition, not six deaths
    (waiting,) = sim.ask("b", 1)
    for _ in range(3):
        assert sim.step(0.5) == []
        sim.heartbeat(alive, held)
    assert waiting.state is State.QUEUED
    sim.heal(silent, alive, held)
    stopped = sim.step(0.5)
    assert len(stopped) == 1 and stopped[0].reason == "reclaimed"
    sim.check()


@pytest.mark.parametrize("quotas", [(3, 1), (6, 2)], ids=["quotas-fill-the-capacity", "quotas-past-it"])
def test_a_node_down_scales_the_quotas_down_in_proportion_on_the_map(quotas: tuple[int, int]) -> None:
    """Fair shares are of the ready nodes' capacity: with one of four nodes down (no zone rule) the quotas are
    scaled down in proportion to the three left, though its containers keep their grants; back, they are not."""
    accounts = {"a": {"quota": {"gpu_memory": quotas[0] * G}}, "b": {"quota": {"gpu_memory": quotas[1] * G}}}
    sim = Accounts(accounts, nodes=4, gpus=1, gpu_memory=G)
    held = sim.ask("a", 3, preemptible=False) + sim.ask("b", 1, preemptible=False)
    sim.ask("a", 2, preemptible=False)  # both ask for more than there is: each gets its (scaled) quota
    sim.ask("b", 2, preemptible=False)
    assert (sim.fair_gpus("a"), sim.fair_gpus("b")) == pytest.approx((3, 1))
    silent = held[-1].node  # b's container's node goes silent alone: down, not a partition
    alive = [f"n{i}" for i in range(4) if f"n{i}" != silent]
    sim.clock.advance(sim.cluster.down_after + 1)
    sim.heartbeat(alive, held)
    assert sim.cluster.sweep()[0] == [silent] and not sim.cluster.reconciler.disrupted
    assert (sim.gpus_of("a"), sim.gpus_of("b")) == (3, 1)  # the silent node's grant is kept
    assert (sim.fair_gpus("a"), sim.fair_gpus("b")) == pytest.approx((3 * 3 / 4, 3 * 1 / 4))
    assert sum(sim.fair_gpus(name) for name in sim.view()) == pytest.approx(3)
    sim.heal([silent], alive, held)
    assert (sim.fair_gpus("a"), sim.fair_gpus("b")) == pytest.approx((3, 1))
    sim.check()


# --- without accounts, and the tree's config --------------------------------------------------------
def test_without_accounts_records_carry_no_account_and_there_is_no_view() -> None:
    cluster = Cluster()
    cluster.register("n", b"n", "docker", [GpuInfo(uuid="g", index=0, name="Sim", memory_total=G)], [])
    record, _ = cluster.submit(PlacementSpec(memory=G, count=1, placement="spread", image="i", command=[]))
    assert record.account is None and not record.over_quota
    assert cluster.accounts_view(OPERATOR) is None
    assert cluster.check() == []


def test_a_tenant_sees_its_own_account_and_those_above_it() -> None:
    accounts = {"research": {"quota": {"gpu_memory": 4 * G}}, "research/vision": {}, "research/nlp": {},
                "prod": {}}
    sim = Accounts(accounts, nodes=1, gpus=1, gpu_memory=G, leaves=["research/vision", "research/nlp", "prod"])
    seen = [a["name"] for a in sim.cluster.accounts_view(Principal("research-vision")) or []]
    assert seen == ["research", "research/vision"]
    everything = [a["name"] for a in sim.cluster.accounts_view(OPERATOR) or []]
    assert everything == sorted(["research", "research/vision", "research/nlp", "prod", DEFAULT])


def test_a_reload_moves_records_to_their_tenants_new_accounts_and_counts_again() -> None:
    sim = Accounts(SMALL, nodes=1, gpus=4, gpu_memory=G)
    sim.ask("a", 2)
    sim.cluster.accounts = account_tree({"c": {"quota": {"gpu_memory": G}}}, {"a": "c"})
    assert sim.view()["c"]["allocated"] == 2 * G
    sim.cluster.accounts = None
    assert all(r.account is None for r in sim.cluster.containers())
    sim.check()


@pytest.mark.parametrize(("accounts", "tenants", "says"), [
    ({"research/vision": {}}, {}, "parent research is not configured"),
    ({"research": {}, "research/vision": {}}, {"alice": "research"}, "has children"),
    ({"a": {"quota": {"gpu_memory": "8GiB"}, "limit": {"gpu_memory": "4GiB"}}}, {}, "below its quota"),
    ({"a": {}}, {"alice": "b"}, "'b' is not configured"),
    ({"default": {}, "default/x": {}}, {}, "may not have children"),
    ({}, {"alice": "a"}, "no accounts are configured"),
    ({"Bad Name": {}}, {}, "a path of up to"),
])
def test_a_tree_that_cannot_be_applied_is_refused_with_what_is_wrong(accounts: dict, tenants: dict,
                                                                     says: str) -> None:
    with pytest.raises(ValueError, match=says):
        build_accounts({n: AccountConfig(**c) for n, c in accounts.items()}, tenants)


def test_limit_minus_one_means_unlimited_and_reclaim_min_runtime_is_inherited() -> None:
    tree = account_tree({"r": {"limit": {"gpu_memory": -1}, "reclaim_min_runtime": 7}, "r/v": {}}, {})
    assert tree["r"].limit is None and tree["r/v"].reclaim_min_runtime == 7
    assert tree[DEFAULT].reclaim_min_runtime == 60


def test_the_docs_worked_example() -> None:
    """docs/concepts/accounts.md: 16 GPUs of 80 GiB, every leaf asking for everything."""
    gib = 1 << 30
    accounts = {"research": {"quota": {"gpu_memory": 320 * gib}, "over_quota_weight": 3,
                             "limit": {"gpu_memory": 640 * gib}},
                "research/vision": {"quota": {"gpu_memory": 160 * gib}},
                "research/nlp": {"quota": {"gpu_memory": 80 * gib}},
                "prod": {"quota": {"gpu_memory": 160 * gib}, "priority": 1}}
    asked = {"research/vision": 9999.0 * gib, "research/nlp": 9999.0 * gib, "prod": 9999.0 * gib}
    fair = shares_of(accounts, asked, 1280 * gib)
    assert {k: round(v / gib) for k, v in fair.items() if k != DEFAULT} == {
        "research": 320, "prod": 960, "research/vision": 200, "research/nlp": 120}
    accounts["prod"]["priority"] = 0
    fair = shares_of(accounts, asked, 1280 * gib)
    assert {k: round(v / gib) for k, v in fair.items() if k != DEFAULT} == {
        "research": 640, "prod": 640, "research/vision": 360, "research/nlp": 280}


def test_a_resize_past_the_quota_borrows_only_if_preemptible_and_never_past_a_limit() -> None:
    gib = 1 << 30
    accounts = {"a": {"quota": {"gpu_memory": 2 * gib}, "limit": {"gpu_memory": 3 * gib}}}
    sim = Accounts(accounts, nodes=1, gpus=1, gpu_memory=8 * gib)
    (steady,) = sim.ask("a", 1, gib, preemptible=False, queue=False)
    (loose,) = sim.ask("a", 1, gib // 2, queue=False)
    with pytest.raises(Conflict) as refused:
        sim.cluster.begin_resize(steady.id, 2 * gib)  # a would hold 2.5 GiB of its 2: not preemptible
    assert refused.value.code == "over_quota" and "quota" in str(refused.value)
    sim.answer([sim.cluster.begin_resize(loose.id, gib)[1]])  # 2 GiB: within the quota
    assert not loose.over_quota
    sim.answer([sim.cluster.begin_resize(loose.id, gib + gib // 2)[1]])  # 2.5 GiB: the growth borrows
    assert loose.over_quota
    with pytest.raises(Conflict) as limited:
        sim.cluster.begin_resize(loose.id, 3 * gib)  # 4 GiB: past the limit of 3
    assert limited.value.code == "over_quota" and "limit" in str(limited.value)
    sim.check()


def test_a_restarted_manager_counts_its_journaled_queue_and_adopted_containers_in_their_accounts(tmp_path) -> None:
    from gpumgr.manager.model.queue import QueueJournal

    sim = Accounts(SMALL, nodes=1, gpus=2, gpu_memory=G)
    sim.cluster.journal = sim.cluster.life.journal = QueueJournal(tmp_path)
    running = sim.ask("a", 2)  # two GPUs, within a's quota
    (waiting,) = sim.ask("b", 1)
    assert waiting.state is State.QUEUED
    again = Accounts(SMALL, nodes=0, gpus=2, gpu_memory=G)
    again.cluster.journal = again.cluster.life.journal = QueueJournal(tmp_path)
    assert again.cluster.restore_queue(again.cluster.journal.load()) == 1
    reports = [ContainerReport(grant=r.id, container_id=f"c-{r.id}", gpus=r.gpus, gpu_memory=r.gpu_memory,
                               state="running", tenant="a") for r in running]
    again.cluster.register("n0", b"n0", "docker", [GpuInfo(uuid=f"n0-g{i}", index=i, name="Sim", memory_total=G)
                                                   for i in range(2)], reports)
    view = again.view()
    assert view["a"]["allocated"] == 2 * G and view["b"]["waiting"] == G
    assert again.cluster.get(waiting.id).account == "b"
    again.check()


@pytest.mark.parametrize("gpus", [6, 4])
def test_a_request_within_its_own_quota_is_not_held_back_by_a_sibling_that_borrowed_its_part(gpus: int) -> None:
    """The tree's finding: x asks within its own quota, but its parent p is at its quota because sibling y
    borrowed x's part. Borrowed containers use no quota: with room free x runs at once (it waited before, for
    y's jobs to end by themselves); with none, x is below its fair share and reclaims one of y's borrowers."""
    accounts = {"p": {"quota": {"gpu_memory": 4 * G}, "reclaim_min_runtime": 1},
                "p/x": {"quota": {"gpu_memory": 2 * G}}, "p/y": {"quota": {"gpu_memory": 2 * G}},
                "q": {"quota": {"gpu_memory": 0}}}
    sim = Accounts(accounts, nodes=1, gpus=gpus, gpu_memory=G, leaves=["p/x", "p/y", "q"])
    borrowed = sim.ask("p/y", 4)  # two within y's quota, two borrowed from x's part of p
    assert [r.over_quota for r in borrowed] == [False, False, True, True]
    sim.step(2.0)
    (mine,) = sim.ask("p/x", 1, preemptible=False)
    sim.settle_down()
    assert mine.state is State.RUNNING and not mine.over_quota
    if gpus == 6:
        assert sim.reclaimed == []
    else:
        (victim,) = sim.reclaimed
        assert victim.id in {r.id for r in borrowed[2:]} and victim.detail["reclaimed_for_account"] == "p/x"
    sim.check()


def test_a_victim_whose_room_another_request_of_its_account_took_is_not_replaced_by_another_victim() -> None:
    """Seen end to end under load: victims V1-V3 were chosen for prod's R1-R3; V2 stopped first and R1 took its
    room; R2's own victim then looked gone, and a fourth container was reclaimed: prod 16 GiB, research 16."""
    gib = 1 << 30
    accounts = {"research": {"quota": {"gpu_memory": 8 * gib}, "over_quota_weight": 3, "reclaim_min_runtime": 0},
                "prod": {"quota": {"gpu_memory": 8 * gib}, "over_quota_weight": 1, "reclaim_min_runtime": 0}}
    sim = Accounts(accounts, nodes=2, gpus=2, gpu_memory=8 * gib)
    sim.ask("research", 8, 4 * gib)
    sim.ask("prod", 8, 4 * gib)
    commands, _ = sim.cluster.dispatch()
    removals = [c for c in commands if c.kind is OpKind.REMOVE]
    assert len(removals) == 3  # prod's fair share is 12 GiB: three of research's borrowed 4 GiB
    sim.answer([removals[1]])  # one victim stops first; the other two are still stopping
    for _ in range(3):
        sim.clock.advance(1.0)
        commands, _ = sim.cluster.dispatch()
        assert not [c for c in commands if c.kind is OpKind.REMOVE and c.record.id not in
                    {r.record.id for r in removals}], "a fourth container was reclaimed"
        sim.answer([c for c in commands if c.kind is OpKind.CREATE])
    sim.answer([removals[0], removals[2]])
    sim.settle_down()
    assert (sim.view()["prod"]["allocated"], sim.view()["research"]["allocated"]) == (12 * gib, 20 * gib)
    sim.check()
