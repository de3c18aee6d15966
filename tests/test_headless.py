"""A leader cut off from its agents but not from etcd steps down (issue "Network faults", item 7).

The rule alone (pure, on made-up figures), the followers' asks in a real etcd, the hold-off that keeps
the deposed leader out of the next election, and the whole of it with real processes: two managers
on one etcd, agents whose links to the leader run through chaos proxies that go silent.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpumgr.manager.config import ManagerSettings
from gpumgr.manager.control.ha import read_only_store
from gpumgr.manager.control.leadership import LEASE_TTL, Leadership
from gpumgr.manager.control.store_etcd import EtcdStore
from gpumgr.manager.headless import KEY_MARK, Asks, Rule, Verdict, judge
from gpumgr.manager.link.admission import Admission
from gpumgr.manager.service import Manager
from gpumgr.wire import defaults, protocol
from tests.chaos.proxy import ChaosProxy
from tests.fake_agent import FakeAgent
from tests.ha_procs import HaManager, shared_state
from tests.procs import AgentProc, free_port, wait_for

DOWN = defaults.NODE_DOWN_AFTER
AFTER = defaults.HEADLESS_AFTER


def nodes(prefix: str, count: int, silent: float) -> dict[str, float]:
    return {f"{prefix}{i}": silent for i in range(count)}


def run(rule: Rule, verdicts: list[tuple[float, Verdict]]) -> list[float]:
    """The times at which ``rule`` says to step down, fed ``verdicts`` as ``(time, verdict)``."""
    return [now for now, verdict in verdicts if rule.due(verdict, now)]


def every_half_second(start: float, end: float, verdict: Verdict) -> list[tuple[float, Verdict]]:
    return [(start + i / 2, verdict) for i in range(int((end - start) * 2))]


# --- the rule ----------------------------------------------------------------------------------
def test_fewer_than_half_silent_is_no_reason_to_step_down() -> None:
    silent = {**nodes("up", 5, 0.5), **nodes("cut", 5, 20.0)}  # exactly half heard: not fewer
    verdict = judge(silent, dict.fromkeys(nodes("cut", 5, 0), 1.0), down_after=DOWN, after=AFTER)
    assert verdict == Verdict(bound=10, heard=5, asking=5) and not verdict.cut_off
    assert run(Rule(AFTER), every_half_second(0, 60, verdict)) == []


def test_many_silent_asking_nobody_is_the_zone_rules_case_the_leader_stays() -> None:
    silent = {**nodes("up", 3, 0.5), **nodes("rack", 7, 20.0)}  # a rack went down: its nodes ask no one
    verdict = judge(silent, {"rack0": 1.0}, down_after=DOWN, after=AFTER)  # one flaky node is not most
    assert verdict == Verdict(bound=10, heard=3, asking=1) and verdict.cut_off and not verdict.headless
    assert run(Rule(AFTER), every_half_second(0, 60, verdict)) == []


def test_many_silent_asking_followers_for_the_whole_window_steps_down() -> None:
    silent = {**nodes("up", 3, 0.5), **nodes("cut", 7, 5.0)}
    verdict = judge(silent, dict.fromkeys(nodes("cut", 7, 0), 1.5), down_after=DOWN, after=AFTER)
    assert verdict == Verdict(bound=10, heard=3, asking=7) and verdict.headless
    assert run(Rule(AFTER), every_half_second(100, 100 + AFTER + 1, verdict))[0] == 100 + AFTER


def test_a_dip_shorter_than_the_window_does_not_step_down() -> None:
    cut = Verdict(bound=10, heard=2, asking=8)
    back = Verdict(bound=10, heard=9, asking=0)
    rule = Rule(AFTER)
    dip = [*every_half_second(0, AFTER - 1, cut), (AFTER - 1, back), *every_half_second(AFTER, 2 * AFTER - 1, cut)]
    assert run(rule, dip) == []
    assert rule.due(cut, 2 * AFTER)  # cut off again for a whole window since it came back


def test_who_counts_as_bound_heard_and_asking() -> None:
    silent = {"fresh": 1.0, "quiet": DOWN + 1, "gone": DOWN + 2 * AFTER + 1}
    # "gone" was last ready longer ago than the window: a dead node, neither bound nor silent
    assert judge(silent, {"quiet": AFTER + 1, "gone": 0.0}, down_after=DOWN, after=AFTER) == Verdict(2, 1, 0)
    assert judge(silent, {"quiet": AFTER}, down_after=DOWN, after=AFTER) == Verdict(2, 1, 1)
    assert not judge({}, {}, down_after=DOWN, after=AFTER).cut_off  # no nodes: nothing to judge by
    lone = judge({"only": DOWN + 1}, {"only": 0.0}, down_after=DOWN, after=AFTER)
    assert lone == Verdict(1, 0, 1) and lone.headless


def test_a_followers_asks_are_published_only_when_changed_and_stay_bounded() -> None:
    asks = Asks(keep=20.0, most=3)
    assert asks.changed(100.0) is None  # nothing asked, nothing held: nothing to write
    asks.note("a", 99.0)
    asks.note("a", 99.04)
    first = asks.changed(100.0)
    assert first == {"a": 99.0}
    asks.published(first)
    assert asks.changed(100.5) is None
    for i, who in enumerate("bcdefgh"):
        asks.note(who, 100.0 + i)
    assert asks.changed(107.0) == {"f": 104.0, "g": 105.0, "h": 106.0}  # the newest three
    assert asks.changed(200.0) == {}  # all stale: the key is deleted


# --- the pieces on a real etcd -----------------------------------------------------------------
def test_asks_round_trip_through_etcd(etcd) -> None:
    store = EtcdStore(etcd.client(), lambda: [], prefix="/asks-test/")
    store.publish_asks("http://m2:9400", {"gpu1": 1.5, f"{KEY_MARK}abc": 2.0})
    store.publish_asks("m3", {"gpu2": 3.0})
    assert store.asks() == {"http://m2:9400": {"gpu1": 1.5, f"{KEY_MARK}abc": 2.0}, "m3": {"gpu2": 3.0}}
    store.publish_asks("m3", {})
    assert list(store.asks()) == ["http://m2:9400"]


def test_a_manager_that_steps_down_with_a_hold_off_stays_out_of_the_next_election(etcd) -> None:
    client = etcd.client()
    first, second = Leadership(client, "first", prefix="/hold/"), Leadership(client, "second", prefix="/hold/")
    first.start()
    try:
        wait_for(lambda: first.is_leader, 10, what="first to lead")
        second.start()
        wait_for(lambda: second.leader() is not None, 10, what="second to see first")
        stepped = time.monotonic()
        first.step_down("its agents cannot reach it", hold_off=3.0)
        wait_for(lambda: second.is_leader, 5, interval=0.02, what="second to lead")
        second.stop(resign=True)  # the key is free again at once, within first's hold-off
        while time.monotonic() < stepped + 2.5:
            assert not first.is_leader, "it campaigned during its hold-off"
            time.sleep(0.05)
        wait_for(lambda: first.is_leader, 5, what="first to lead once its hold-off ended")
    finally:
        first.stop()
        second.stop()


def test_a_follower_notes_the_bound_node_of_the_asking_key_never_the_claimed_one(etcd, tmp_path) -> None:
    url = "etcd://" + etcd.endpoints[0].removeprefix("http://") + "/asked"

    def manager(name: str) -> Manager:
        started = Manager(ManagerSettings(store=url, state_dir=shared_state(tmp_path, name),
                                          agents=f"tcp://127.0.0.1:{free_port()}",
                                          advertise_api=f"http://127.0.0.1:{free_port()}"))
        started.start()
        return started

    leader = manager("m1")
    agents: list[FakeAgent] = []
    try:
        wait_for(lambda: leader.leading.loaded, 10, what="m1 to lead")
        early = FakeAgent(leader.settings.agents, leader.admission.token(), node="hl-early")
        agents.append(early)
        early.register()
        follower = manager("m2")  # it read the bindings at start: it knows hl-early's key, not hl-late's
        try:
            wait_for(lambda: follower.plane.leader() is not None, 10, what="m2 to see the leader")
            late = FakeAgent(leader.settings.agents, leader.admission.token(), node="hl-late")
            agents.append(late)
            late.register()
            for agent, claim in ((early, "hl-late"), (late, "hl-early")):  # each claims the other's name
                asking = FakeAgent(follower.settings.agents, leader.admission.token(), node=claim, keys=agent.keys)
                agents.append(asking)
                asking.send(protocol.Register(node=claim, runtime="docker", gpus=agent.gpus))
                assert asking.expect(protocol.Refused).code == "not_leader"
            assert follower.headless is not None and leader.headless is not None
            noted = follower.headless.asks.changed(time.time()) or {}
            assert set(noted) == {"hl-early", KEY_MARK + late.keys.public}
            name = follower.headless.name
            store = leader.headless.store
            wait_for(lambda: set(store.asks().get(name, {})) == set(noted), 5, what="the follower to publish its asks")
            asked = leader.headless._read_asks(time.monotonic())
            assert set(asked) == {"hl-early", "hl-late"}  # the leader names the key it knows
        finally:
            follower.stop()
    finally:
        for agent in agents:
            agent.close()
        leader.stop()


# --- real processes through the chaos proxy ----------------------------------------------------
#: the managers' headless_after here: short, so the test runs in well under a minute
SHORT = 4.0
AGENTS = 3


class Roles:
    """Polls each manager's ``/healthz`` on a thread and keeps every change of its role, with the time."""

    def __init__(self, managers: dict[str, HaManager]) -> None:
        self.managers = managers
        self.seen: dict[str, list[tuple[float, str]]] = {name: [] for name in managers}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(0.1):
            for name, manager in self.managers.items():
                role = (manager.health() or {}).get("role", "?")
                if not self.seen[name] or self.seen[name][-1][1] != role:
                    self.seen[name].append((time.monotonic(), role))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.fixture
def cluster(etcd, tmp_path) -> Iterator[dict[str, Any]]:
    """Manager ``a`` leads, ``b`` follows; each agent reaches ``a`` through a proxy of its own, ``b`` directly."""
    store = "etcd://" + etcd.endpoints[0].removeprefix("http://") + "/headless"
    env = {"GPUMGR_HEADLESS_AFTER": str(SHORT)}
    started: list[Any] = []

    def manager() -> HaManager:
        port = free_port()
        shared_state(tmp_path, f"manager-state-{port}")
        found = HaManager(tmp_path, "--store", store, "--advertise-api", f"http://127.0.0.1:{port}",
                          api_port=port, env=env)
        started.append(found)
        return found

    try:
        a = manager()
        wait_for(lambda: a.leads, 20, what="a to lead")
        b = manager()
        wait_for(lambda: (b.health() or {}).get("leader") == a.url, 20, what="b to see a lead")
        token = Admission(tmp_path / "shared-key", store=read_only_store(store)).token()
        proxies = [ChaosProxy(("127.0.0.1", a.agent_port)).start() for _ in range(AGENTS)]
        started += proxies
        agents = [AgentProc(tmp_path, a, f"hl-{i}", gpus="sim:1x8GiB", runtime="process", token=token,
                            endpoints=f"{proxy.address},{b.endpoint}") for i, proxy in enumerate(proxies)]
        started += agents
        yield {"a": a, "b": b, "proxies": proxies, "agents": agents}
    finally:
        for thing in reversed(started):
            thing.stop()


def test_a_leader_its_agents_cannot_reach_steps_down_and_a_reachable_one_leads(cluster) -> None:
    """Before the rule: ``a`` led on (its lease renewed through etcd) and never heard its nodes again, ``b``
    refused every agent ``not_leader``, and no node was ready anywhere until the test gave up."""
    a, b, proxies, agents = cluster["a"], cluster["b"], cluster["proxies"], cluster["agents"]
    old_epoch = (a.health() or {})["epoch"]
    roles = Roles({"a": a, "b": b})
    try:
        cut = time.monotonic()
        for proxy in proxies:
            proxy.swallow("both")  # a silent partition between a and its agents; a still reaches etcd
        bound = SHORT + defaults.NODE_DOWN_AFTER + LEASE_TTL + 10

        def all_on_b() -> bool:
            if not b.leads:
                return False
            return all((b.node(agent.node) or {}).get("state") == "ready" for agent in agents)

        try:
            wait_for(all_on_b, bound, interval=0.2, what="b to lead with every node ready")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; roles seen {roles.seen}\n--- a:\n{a.output()[-2500:]}\n"
                                 f"--- b:\n{b.output()[-1500:]}") from None
        took = time.monotonic() - cut
        print(f"every node ready on b {took:.1f}s after the partition")
        assert "headless:" in a.output() and f"{SHORT:g}s" in a.output()
        new_epoch = (b.health() or {})["epoch"]
        assert new_epoch != old_epoch
        stepped = next(at for at, role in roles.seen["a"] if role != "leader")
        time.sleep(max(0.0, stepped + 2 * LEASE_TTL + 1 - time.monotonic()))  # past a's hold-off
        assert b.leads and not a.leads
        assert all(role != "leader" for at, role in roles.seen["a"] if at >= stepped), roles.seen["a"]
        assert all(proxy.swallowed > 0 for proxy in proxies)
    finally:
        roles.stop()


def test_the_managers_take_headless_after_from_their_settings(tmp_path: Path, monkeypatch) -> None:
    assert ManagerSettings().headless_after == defaults.HEADLESS_AFTER == 10.0
    monkeypatch.setenv("GPUMGR_HEADLESS_AFTER", "4")
    assert ManagerSettings().headless_after == 4.0
    with pytest.raises(ValueError):
        ManagerSettings(headless_after=0)
