"""Generated tests of fair share (issue 34) over random trees and demands, and of reclaim over random workloads.

- the fair shares sum to at most the capacity, and children's to at most their parent's;
- no account gets less than ``min(quota, requested)`` when the quotas fit (at every level);
- no account gets more than it requested or than its limit;
- the surplus goes by priority, then by weight;
- reclaim never stops a container that is not over quota, nor one younger than its account's minimum runtime;
- once demands stop changing, reclaims stop, and no request is preempted, re-placed and preempted again;
- the same with waiting gangs among the requests, and no gang is ever partly placed.

The examples are capped so CI stays in budget.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpumgr.manager.fairshare.shares import compute, rolled_up
from gpumgr.manager.model.gangs import GangSpec
from gpumgr.manager.model.records import PlacementSpec
from gpumgr.manager.tenancy.accounts import AccountTree, leaves
from gpumgr.wire.errors import Conflict
from gpumgr.wire.names import State
from tests.accounts_model import Accounts, account_tree

U = 1 << 30
SLACK = 1e-3 * U  # the arithmetic is in floats


@st.composite
def trees(draw: st.DrawFn) -> dict[str, dict[str, Any]]:
    """A tree of up to 3 levels and 8 accounts, each with a quota, weight, priority and maybe a limit."""
    names: list[str] = []
    for top in range(draw(st.integers(1, 3))):
        names.append(f"t{top}")
        for kid in range(draw(st.integers(0, 2))):
            names.append(f"t{top}/k{kid}")
            names += [f"t{top}/k{kid}/g{g}" for g in range(draw(st.integers(0, 1)))]
    accounts = {}
    for name in names:
        quota = draw(st.integers(0, 40)) * U
        config: dict[str, Any] = {"quota": {"gpu_memory": quota},
                                  "over_quota_weight": draw(st.sampled_from([0, 1, 1, 2, 3])),
                                  "priority": draw(st.sampled_from([0, 0, 1]))}
        if draw(st.booleans()):
            config["limit"] = {"gpu_memory": quota + draw(st.integers(0, 40)) * U}
        accounts[name] = config
    return accounts


def demands(tree: AccountTree) -> st.SearchStrategy[dict[str, float]]:
    return st.fixed_dictionaries({leaf: st.integers(0, 60).map(lambda n: float(n * U)) for leaf in leaves(tree)})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(accounts=trees(), capacity=st.integers(0, 120), data=st.data())
def test_fair_shares_hold_their_rules(accounts: dict[str, dict[str, Any]], capacity: int,
                                      data: st.DataObject) -> None:
    tree = account_tree(accounts, {})
    asked = data.draw(demands(tree))
    shares = compute(tree, {}, asked, capacity * U)
    fair, requested = shares.fair, shares.requested
    assert sum(fair[t] for t in tree.tops) <= capacity * U + SLACK
    for name, account in tree.accounts.items():
        assert fair[name] >= -SLACK
        assert fair[name] <= requested[name] + SLACK
        if account.limit is not None:
            assert fair[name] <= account.limit + SLACK
        if account.children:
            assert sum(fair[c] for c in account.children) <= fair[name] + SLACK
    for parent in [None, *tree.accounts]:
        kids = tree.children_of(parent)
        if not kids:
            continue
        budget = capacity * U if parent is None else fair[parent]
        if sum(tree[k].quota for k in kids) <= budget:  # the quotas fit: each gets at least its quota's worth
            for kid in kids:
                assert fair[kid] >= min(tree[kid].quota, requested[kid]) - SLACK
        # the surplus: a child of a higher priority still short of its cap leaves none to a lower priority
        def cap(k: str) -> float:
            limit = tree[k].limit
            return min(requested[k], float("inf") if limit is None else limit)

        base = {k: min(tree[k].quota * min(1.0, budget / max(1, sum(tree[q].quota for q in kids))), cap(k))
                for k in kids}
        for high in kids:
            if tree[high].over_quota_weight > 0 and fair[high] < cap(high) - SLACK:
                for low in kids:
                    if tree[low].priority < tree[high].priority:
                        assert fair[low] <= base[low] + SLACK, (high, low)
        # within one priority, children short of their cap got surplus in proportion to their weights
        short = [k for k in kids if tree[k].over_quota_weight > 0 and fair[k] < cap(k) - SLACK]
        for one in short:
            for other in short:
                if tree[one].priority == tree[other].priority:
                    per_weight_one = (fair[one] - base[one]) / tree[one].over_quota_weight
                    per_weight_other = (fair[other] - base[other]) / tree[other].over_quota_weight
                    assert abs(per_weight_one - per_weight_other) <= SLACK


def test_rolled_up_sums_the_leaves() -> None:
    tree = account_tree({"a": {}, "a/b": {}, "a/c": {}}, {})
    totals = rolled_up(tree, {"a/b": 2.0, "a/c": 3.0, "default": 1.0})
    assert totals == {"a": 5.0, "a/b": 2.0, "a/c": 3.0, "default": 1.0}


ACCOUNTS = {"x": {"quota": {"gpu_memory": 2 * U}, "over_quota_weight": 3, "reclaim_min_runtime": 3},
            "y": {"quota": {"gpu_memory": 3 * U}, "over_quota_weight": 1, "reclaim_min_runtime": 1},
            "z/p": {"quota": {"gpu_memory": U}, "reclaim_min_runtime": 0},
            "z": {"quota": {"gpu_memory": 2 * U}, "over_quota_weight": 2}}
LEAVES = ["x", "y", "z/p"]


def play(sim: Accounts, action: str, account: str, count: int, quarters: int, flag: bool) -> None:
    """One step of a script: ``count`` requests of ``quarters`` GiB (preemptible with ``flag``), a gang of 2 or 3
    such members (on their own nodes when ``count`` > 2), an end of one of ``account``'s containers, or time."""
    try:
        if action == "ask":
            for _ in range(count):
                sim.ask(account, 1, quarters * U, preemptible=flag)
        elif action == "gang":
            member = PlacementSpec(memory=quarters * U, count=1, placement="spread", image="img", command=[],
                                   preemptible=flag)
            sim.cluster.submit_gang(GangSpec(member, 2 + count % 2, one_per_node=count > 2),
                                    tenant=sim.tenants[account], queue=True)
    except Conflict as exc:  # over_quota for one that may never run: refused, nothing kept
        assert exc.code == "over_quota"
    if action == "end":
        running = [r for r in sim.cluster.containers() if r.state is State.RUNNING and r.account == account]
        if running:
            sim.cluster.finish(running[0].id, State.EXITED, exit_code=0)
    elif action == "step":
        sim.step(float(count))
    sim.check()
    no_gang_in_part(sim)


def settles(sim: Accounts) -> None:
    """Reclaim stopped only old enough over-quota containers; with demands fixed from here (what was stopped asks
    again, as a Swarm service does), reclaims stop, and no request is stopped twice: none is preempted, placed
    again and preempted again (each stopped one's line is followed through the requests that ask again for it)."""
    for victim in sim.reclaimed:
        assert victim.over_quota and victim.reason == "reclaimed", victim
        assert sim.chosen[victim.id] >= ACCOUNTS[victim.account or ""]["reclaim_min_runtime"], victim
    line: dict[str, str] = {}  # a request that asks again for a stopped one → the first of its line
    stopped_lines: set[str] = set()
    quiet = 0
    for _ in range(400):
        stopped = sim.step(1.0)
        for record in stopped:
            first = line.get(record.id, record.id)
            assert first not in stopped_lines, f"{first} was stopped, placed again and stopped again: a loop"
            stopped_lines.add(first)
            (again,) = sim.ask(sim.account_of(record), 1, record.gpu_memory, preemptible=record.preemptible)
            line[again.id] = first
        quiet = 0 if stopped else quiet + 1
        no_gang_in_part(sim)
        if quiet >= 60:
            break
    assert quiet >= 60, "reclaims went on with demands fixed: a loop"
    sim.check()


def no_gang_in_part(sim: Accounts) -> None:
    """No gang is partly placed: a waiting one has no members, a live one has every member placed."""
    for gang in sim.cluster.gangs.gangs.values():
        states = [sim.cluster.get(m).state for m in gang.members]
        if gang.state == "queued":
            assert not gang.members
        elif gang.state in ("creating", "running"):
            assert len(states) == gang.spec.replicas and State.QUEUED not in states


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hog=st.sampled_from(LEAVES),
       script=st.lists(st.tuples(st.sampled_from(["ask", "ask", "end", "step"]), st.sampled_from(LEAVES),
                                 st.integers(1, 4), st.sampled_from([1, 2, 4]), st.booleans()),
                       min_size=1, max_size=40))
def test_reclaim_stops_only_old_enough_over_quota_containers_and_settles(
        hog: str, script: list[tuple[str, str, int, int, bool]]) -> None:
    sim = Accounts(ACCOUNTS, nodes=1, gpus=3, gpu_memory=4 * U, leaves=LEAVES)
    sim.ask(hog, 6, 2 * U)  # one account borrows the idle cluster first: the others' asks owe reclaim
    for step in script:
        play(sim, *step)
    settles(sim)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hog=st.sampled_from(LEAVES),
       script=st.lists(st.tuples(st.sampled_from(["ask", "gang", "gang", "end", "step"]), st.sampled_from(LEAVES),
                                 st.integers(1, 4), st.sampled_from([1, 2, 4]), st.booleans()),
                       min_size=1, max_size=30))
def test_waiting_gangs_are_reclaimed_for_whole_by_the_same_rules_and_it_settles(
        hog: str, script: list[tuple[str, str, int, int, bool]]) -> None:
    """Gangs among single requests: reclaim (for either) stops only old enough over-quota containers, no gang
    is ever partly placed, and once demands stop changing reclaims stop."""
    sim = Accounts(ACCOUNTS, nodes=3, gpus=2, gpu_memory=4 * U, leaves=LEAVES)
    sim.ask(hog, 6, 4 * U)  # one account borrows the idle cluster first: the others' asks owe reclaim
    for step in script:
        play(sim, *step)
    settles(sim)
