"""A repeated Register (an agent retrying one whose answer it had not seen) changes nothing but the figures.

It writes no event (no second ``node_up``, no second "not adopted" for the same container) and is
answered once, with nothing else sent: a herd of agents retrying cannot flood the event log or the link.
A Register from a new agent process (a restart) is news, and is recorded as such.
"""

from __future__ import annotations

import threading
import time

from gpumgr.manager.config import ManagerSettings
from gpumgr.manager.model.cluster import Cluster
from gpumgr.manager.service import Manager
from gpumgr.wire import protocol
from gpumgr.wire.protocol import GpuInfo, RefusedAdoption
from tests.fake_agent import FakeAgent, GiB

GPUS = [GpuInfo(uuid=f"GPU-rep-{i}", index=i, name="Sim", memory_total=80 * GiB) for i in range(2)]
REFUSED = [RefusedAdoption(container_id="c0ffee" * 10, name="stray", reason="its grant label is not a grant id")]


def kinds(cluster: Cluster) -> list[str]:
    return [e["type"] for e in cluster.events.since(0)]


def register(cluster: Cluster, instance: str) -> None:
    cluster.register("rep", b"rid", "docker", GPUS, [], instance=instance)
    cluster.refuse_adoptions("rep", REFUSED)


def test_a_repeated_register_of_one_agent_process_writes_no_event() -> None:
    cluster = Cluster()
    register(cluster, "first")
    once = kinds(cluster)
    assert once == ["node_up", "failed"]
    for _ in range(5):
        register(cluster, "first")
    assert kinds(cluster) == once, "a repeated Register wrote events"
    assert cluster.node_ready("rep") and cluster.check() == []


def test_a_register_of_a_new_agent_process_is_recorded_again() -> None:
    cluster = Cluster()
    register(cluster, "first")
    register(cluster, "second")  # the agent restarted: its refusals are news for this process
    assert kinds(cluster) == ["node_up", "failed", "node_up", "failed"]
    register(cluster, "second")
    assert kinds(cluster) == ["node_up", "failed", "node_up", "failed"]


def test_a_new_refusal_in_a_repeated_register_is_still_recorded() -> None:
    cluster = Cluster()
    register(cluster, "first")
    other = RefusedAdoption(container_id="beef" * 16, name="other", reason="its grant label is not a grant id")
    cluster.refuse_adoptions("rep", [*REFUSED, other])
    assert kinds(cluster) == ["node_up", "failed", "failed"]


def test_over_the_link_each_register_gets_one_answer_and_nothing_more(tmp_path) -> None:
    manager = Manager(ManagerSettings(agents="tcp://127.0.0.1:0", heartbeat_interval=5.0,
                                      state_dir=str(tmp_path / "state")))
    manager.start()
    agent = FakeAgent(manager.link.bound_endpoint, manager.admission.token(), node="rep-link", gpus=4)
    try:
        agent.register()
        ups = [e for e in manager.events.since(0) if e["type"] == "node_up"]
        assert len(ups) == 1
        for _ in range(3):  # the agent retries: the answers crossed its retries
            agent.send(protocol.Register(node=agent.node, runtime="docker", gpus=agent.gpus, containers=[]))
        answers = [agent.expect(protocol.Registered) for _ in range(3)]
        assert len(answers) == 3
        stop = threading.Event()
        thread = agent.serve(stop)
        time.sleep(0.5)  # anything else the manager would send arrives meanwhile
        stop.set()
        thread.join(2)
        after_join = agent.received[1:]  # the first is the join's answer
        assert [type(m).__name__ for m in after_join] == ["Registered"] * 4, agent.received
        assert [e for e in manager.events.since(0) if e["type"] == "node_up"] == ups
    finally:
        agent.close()
        manager.stop()
