"""What a client was told is what happens, across failovers and restarts (issue 31, items 1 to 5).

Everything is real: etcd (Debian's etcd-server), ``gpumgr manager`` processes on it, a ``gpumgr agent``
driving the Docker engine; only the GPU is simulated; loopback only. Each test ends with the invariant
(:func:`tests.invariant.settles`) on the manager that leads at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from gpumgr.manager.control import etcdv3
from tests.etcd import EtcdCluster
from tests.ha_procs import HaManager, HaManagers
from tests.invariant import settles
from tests.procs import AgentProc, ManagerProc, wait_for

GiB = 1 << 30
READY = 30.0
NODE = "ft-a"


def job(image: str, memory: str, tag: str, **extra: Any) -> dict[str, Any]:
    """A sleeping container whose label ``ft.req`` names the request that asked for it."""
    return {"image": image, "gpu_memory": memory, "command": ["sleep", "600"], "labels": {"ft.req": tag}, **extra}


def running(docker_client: Any, tag: str) -> list[dict[str, Any]]:
    """The engine's running containers of request ``tag``."""
    return docker_client.api.containers(filters={"label": [f"gpumgr.node={NODE}", f"ft.req={tag}"]})


def placed(manager: ManagerProc, image: str, memory: str, tag: str) -> dict[str, Any]:
    """Place a sleeping container of request ``tag`` through ``manager``; its record."""
    made = manager.post("/v1/containers", json=job(image, memory, tag))
    assert made.status_code == 201, made.text
    record: dict[str, Any] = made.json()
    return record


def pause(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)


def resume(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


def patch(manager: ManagerProc, path: str, body: dict[str, Any]) -> requests.Response:
    return manager.http.patch(manager.url + path, json=body, timeout=60)


def down(manager: ManagerProc) -> bool:
    node = manager.node(NODE)
    return node is not None and node["state"] != "ready"


@pytest.fixture
def plane(tmp_path, test_image, docker_client, cleanup_containers) -> Iterator[dict[str, Any]]:
    """One etcd member, two managers, one Docker agent with one simulated 24 GiB GPU."""
    etcd = EtcdCluster(tmp_path / "etcd", size=1)
    ha = HaManagers(tmp_path, etcd.endpoints, count=2)
    agents: list[AgentProc] = []
    try:
        leader = ha.leader()
        agents.append(ha.agent(NODE, leader, gpus="sim:1x24GiB"))
        yield {"etcd": etcd, "ha": ha, "agent": agents[0]}
    finally:
        for proc in [*agents, *ha.managers]:
            resume(proc.popen.pid)
        for member in etcd.members:
            if member.popen is not None:
                resume(member.popen.pid)
        for agent in agents:
            with contextlib.suppress(Exception):
                agent.stop(signal.SIGKILL)
        ha.stop()
        etcd.stop()


def follow(agent: AgentProc, leader: HaManager) -> None:
    agent.manager = leader
    agent.wait_ready(READY)


def test_item1_a_reelected_manager_starts_from_the_store_and_the_nodes_not_its_old_map(
        plane, docker_client, test_image) -> None:
    """M1 → M2 → M1: what M2 did (a grow, a create) stands when M1 leads again; M1 rolls nothing back."""
    ha, agent = plane["ha"], plane["agent"]
    m1 = ha.leader()
    cid = placed(m1, test_image, "4GiB", "grown")["id"]
    pause(m1.popen.pid)
    try:
        m2 = ha.leader(besides=m1)
        follow(agent, m2)
        grown = patch(m2, f"/v1/containers/{cid}", {"gpu_memory": "12GiB"})
        assert grown.status_code == 200 and grown.json()["gpu_memory"] == 12 * GiB, grown.text
        other = m2.post("/v1/containers", json=job(test_image, "10GiB", "by-m2"))
        assert other.status_code == 201, other.text
    finally:
        resume(m1.popen.pid)
    wait_for(lambda: (m1.health() or {}).get("role") == "follower", 15, what="M1 to find itself deposed")
    pause(m2.popen.pid)  # M2 goes quiet: M1 leads again, as it campaigns every 0.2 s
    try:
        assert ha.leader(besides=m2) is m1
        follow(agent, m1)
        settles(m1, docker_client, {NODE})
        time.sleep(3)  # a few heartbeats: a stale figure would be sent back to the node by now
        record = m1.get(f"/v1/containers/{cid}").json()
        assert record["state"] == "running" and record["gpu_memory"] == 12 * GiB, record
        assert m1.get(f"/v1/containers/{other.json()['id']}").json()["state"] == "running"
        assert [e for e in m1.events("resized") if e["container"] == cid] == [], "M1 resized the grant back"
        assert len(running(docker_client, "grown")) == 1 and len(running(docker_client, "by-m2")) == 1
        settles(m1, docker_client, {NODE})
    finally:
        resume(m2.popen.pid)


def test_item3_a_delete_answered_202_is_carried_out_by_the_next_leader(plane, docker_client, test_image) -> None:
    """The node is down, the DELETE is answered 202, the leader dies: the next one removes the container."""
    ha, agent = plane["ha"], plane["agent"]
    m1 = ha.leader()
    cid = placed(m1, test_image, "2GiB", "doomed")["id"]
    pause(agent.popen.pid)
    try:
        wait_for(lambda: down(m1), 30, what="the node to be marked down")
        answer = m1.delete(f"/v1/containers/{cid}")
        assert answer.status_code == 202 and answer.json()["desired_state"] == "removed", answer.text
        m1.stop(signal.SIGKILL)
        m2 = ha.leader(besides=m1)
    finally:
        resume(agent.popen.pid)
    follow(agent, m2)
    wait_for(lambda: not running(docker_client, "doomed"), 30, what="the next leader to remove the container")
    wait_for(lambda: m2.get(f"/v1/containers/{cid}").json()["state"] == "removed", 10, what="the record removed")
    settles(m2, docker_client, {NODE})


def test_item3_a_delete_answered_202_survives_a_restart_of_a_single_manager(
        tmp_path, docker_client, test_image, cleanup_containers) -> None:
    manager = ManagerProc(tmp_path)
    agent = AgentProc(tmp_path, manager, NODE, gpus="sim:1x24GiB")
    try:
        cid = placed(manager, test_image, "2GiB", "solo-doomed")["id"]
        pause(agent.popen.pid)
        try:
            wait_for(lambda: down(manager), 30, what="the node to be marked down")
            assert manager.delete(f"/v1/containers/{cid}").status_code == 202
            manager.stop(signal.SIGKILL)
            manager = ManagerProc(tmp_path, api_port=manager.api_port, agent_port=manager.agent_port)
        finally:
            resume(agent.popen.pid)
        agent.manager = manager
        agent.wait_ready(READY)
        wait_for(lambda: not running(docker_client, "solo-doomed"), 30, what="the restarted manager to remove it")
        settles(manager, docker_client, {NODE})
    finally:
        agent.stop(signal.SIGKILL)
        manager.stop(signal.SIGKILL)


def test_item4_a_call_waiting_when_leadership_ends_is_told_outcome_unknown(plane, docker_client, test_image) -> None:
    """The create was sent; the lease is lost while it waits: 502 outcome_unknown at once, never a 503 to retry."""
    ha, agent, etcd = plane["ha"], plane["agent"], plane["etcd"]
    m1 = ha.leader()
    pause(agent.popen.pid)  # it takes the create and does not answer
    answers: list[requests.Response] = []
    caller = threading.Thread(target=lambda: answers.append(m1.post("/v1/containers",
                                                                    json=job(test_image, "2GiB", "limbo"))))
    caller.start()
    member = etcd.members[0]
    try:
        wait_for(lambda: any(r["state"] == "creating" for r in m1.get("/v1/containers").json()["containers"]), 10,
                 what="the create to be sent")
        assert member.popen is not None
        pause(member.popen.pid)  # the lease cannot be renewed: M1 stops leading within its TTL
        caller.join(30)
        assert answers, "the call was left waiting after leadership ended"
        assert answers[0].status_code == 502 and answers[0].json()["error"]["code"] == "outcome_unknown", \
            answers[0].text
        assert "Retry-After" not in answers[0].headers
    finally:
        if member.popen is not None:
            resume(member.popen.pid)
        resume(agent.popen.pid)
    leader = ha.leader()
    follow(agent, leader)
    settles(leader, docker_client, {NODE})
    assert len(running(docker_client, "limbo")) <= 1


def test_item5_a_queued_post_the_store_refused_leaves_nothing(tmp_path, test_image, docker_client,
                                                              cleanup_containers) -> None:
    """etcd refuses the queue entry (too large for its --max-request-bytes): the POST fails and never runs."""
    etcd = EtcdCluster(tmp_path / "etcd", size=1)
    member = etcd.members[0]
    member.kill()
    member.args += ["--max-request-bytes", "65536"]
    member.start()
    wait_for(etcd.healthy, 30, what="etcd to come back")
    ha = HaManagers(tmp_path, etcd.endpoints, count=1)
    agent: AgentProc | None = None
    try:
        leader = ha.leader()
        agent = ha.agent(NODE, leader, gpus="sim:1x24GiB")
        filler = leader.post("/v1/containers", json=job(test_image, "24GiB", "filler"))
        assert filler.status_code == 201, filler.text
        big = job(test_image, "2GiB", "refused", queue=True, env={f"PAD{i}": "x" * 4000 for i in range(20)})
        answer = leader.post("/v1/containers", json=big)
        assert answer.status_code == 413 and answer.json()["error"]["code"] == "too_large", answer.text
        assert not [r for r in leader.get("/v1/containers").json()["containers"]
                    if r["labels"].get("ft.req") == "refused"], "the refused request is still on the map"
        assert leader.delete(f"/v1/containers/{filler.json()['id']}").status_code in (200, 202)
        queued = leader.post("/v1/containers", json=job(test_image, "2GiB", "after", queue=True))
        assert queued.status_code in (201, 202), queued.text
        wait_for(lambda: running(docker_client, "after"), 30, what="the next request to run")
        assert not running(docker_client, "refused"), "a request answered with an error ran after all"
        settles(leader, docker_client, {NODE})
    finally:
        if agent is not None:
            agent.stop(signal.SIGKILL)
        ha.stop()
        etcd.stop()


def test_item2_a_queued_request_found_running_is_adopted_not_placed_again(plane, docker_client, test_image) -> None:
    """The store still holds a request queued whose container runs (a leader died between the create and the
    dequeue): the next leader adopts the running container instead of creating it a second time."""
    ha, agent, etcd = plane["ha"], plane["agent"], plane["etcd"]
    m1 = ha.leader()
    made = placed(m1, test_image, "4GiB", "twice")
    cid, container = made["id"], made["container_id"]
    placed(m1, test_image, "20GiB", "full")
    waiting = m1.post("/v1/containers", json=job(test_image, "4GiB", "waiting", queue=True))
    assert waiting.status_code == 202, waiting.text
    client = etcd.client()
    prefix = ha.store.rsplit("/", 1)[1]
    found = client.get(f"/{prefix}/queue/{waiting.json()['id']}".encode())
    assert found is not None, "the queued request is not in the store"
    entry = json.loads(found.value)
    entry.update(id=cid, name=made["name"])  # what a leader that died before its dequeue left behind
    client.txn([], [etcdv3.put(f"/{prefix}/queue/{cid}".encode(), json.dumps(entry).encode())])
    m1.stop(signal.SIGKILL)
    m2 = ha.leader(besides=m1)
    follow(agent, m2)
    wait_for(lambda: m2.get(f"/v1/containers/{cid}").json()["state"] == "running", 20, what="it adopted")
    time.sleep(3)  # a second placement would have been sent and answered by now
    assert [c["Id"] for c in running(docker_client, "twice")] == [container], "it ran twice, or was removed"
    assert client.get(f"/{prefix}/queue/{cid}".encode()) is None, "the stale queue entry stayed"
    assert m2.get(f"/v1/containers/{waiting.json()['id']}").json()["state"] == "queued"
    settles(m2, docker_client, {NODE})


def test_a_new_leader_does_not_deny_a_container_its_node_has_not_reported_yet(plane, docker_client,
                                                                              test_image) -> None:
    """Found by the HA chaos schedules: right after a failover, before the node registers again, a DELETE of a
    container that runs was a 404. It is 503 not_known_yet (retry), and once the node is back the DELETE works."""
    ha, agent = plane["ha"], plane["agent"]
    m1 = ha.leader()
    cid = placed(m1, test_image, "2GiB", "early")["id"]
    pause(agent.popen.pid)
    try:
        m1.stop(signal.SIGKILL)
        m2 = ha.leader(besides=m1)
        answer = m2.delete(f"/v1/containers/{cid}")
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "not_known_yet", answer.text
        assert answer.headers.get("Retry-After") and NODE in answer.json()["error"]["message"]
        assert m2.get(f"/v1/containers/{cid}").status_code == 503
        assert running(docker_client, "early"), "the container should still run"
    finally:
        resume(agent.popen.pid)
    follow(agent, m2)
    assert m2.delete(f"/v1/containers/{cid}").status_code in (200, 202)
    wait_for(lambda: not running(docker_client, "early"), 30, what="the container to be removed")
    assert m2.get("/v1/containers/no-such-one").status_code == 404  # every known node is back: a miss is a 404
    settles(m2, docker_client, {NODE})
