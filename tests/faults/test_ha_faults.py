"""Several managers on etcd under faults: kill -9 and SIGSTOP the leader, kill etcd members.

Everything is real: a three-member etcd (Debian's etcd-server, ``tests/etcd.py``), three ``gpumgr
manager --store etcd://...`` processes sharing one key pair, ``gpumgr agent`` processes given every
manager's address, the Docker engine and its containers; only the GPUs are simulated; loopback only.
Every test ends with the invariant of ``tests/invariant.py`` holding within two heartbeats on the
leader. Skipped without an etcd server unless ``GPUMGR_REQUIRE_ETCD=1`` (and without Docker unless
``GPUMGR_REQUIRE_DOCKER=1``).
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from gpumgr.wire.epoch import Epoch
from tests.etcd import EtcdCluster
from tests.faults.test_faults import fire
from tests.ha_procs import HaManager, HaManagers
from tests.invariant import settles
from tests.procs import AgentProc, wait_for

GiB = 1 << 30
READY = 30.0
NODES = ("ha2-a", "ha2-b")


def job(image: str, memory: str, tag: str, **extra: Any) -> dict[str, Any]:
    """A sleeping container whose label ``ha.req`` names the request that asked for it."""
    return {"image": image, "gpu_memory": memory, "command": ["sleep", "300"], "labels": {"ha.req": tag}, **extra}


def engine_of(docker_client: Any, *nodes: str) -> list[dict[str, Any]]:
    """Every container of ``nodes`` the engine has, running or not."""
    found: list[dict[str, Any]] = []
    for node in nodes:
        found += docker_client.api.containers(all=True, filters={"label": f"gpumgr.node={node}"})
    return found


def follow(agents: list[AgentProc], leader: HaManager) -> None:
    """Wait until every agent's node is ready on ``leader`` (they find it themselves)."""
    for agent in agents:
        agent.manager = leader
        agent.wait_ready(READY)


def epoch_of(manager: HaManager) -> Epoch:
    health = manager.health() or {}
    generation, revision = str(health.get("epoch")).split(".")
    return Epoch(int(generation), int(revision))


@pytest.fixture
def plane(tmp_path, test_image, docker_client, cleanup_containers) -> Iterator[dict[str, Any]]:
    """Three etcd members, three managers and two Docker agents (one 24 GiB simulated GPU each)."""
    etcd = EtcdCluster(tmp_path / "etcd", size=3)
    ha = HaManagers(tmp_path, etcd.endpoints)
    agents: list[AgentProc] = []
    try:
        leader = ha.leader()
        agents += [ha.agent(node, leader, gpus="sim:1x24GiB") for node in NODES]
        yield {"etcd": etcd, "ha": ha, "agents": agents}
    finally:
        for agent in agents:
            with contextlib.suppress(Exception):
                agent.stop(signal.SIGKILL)
        ha.stop()
        etcd.stop()


def test_leader_killed_during_a_burst_then_queue_keeps_its_order_through_a_second_failover(
        plane, docker_client, test_image) -> None:
    ha, agents = plane["ha"], plane["agents"]
    first = ha.leader()
    follower = ha.followers(first)[0]
    # a follower forwards a POST to the leader, which places it
    forwarded = follower.post("/v1/containers", json=job(test_image, "2GiB", "fwd"))
    assert forwarded.status_code == 201, forwarded.text
    assert forwarded.json()["id"] in {r["id"] for r in first.get("/v1/containers").json()["containers"]}

    # kill -9 the leader while a burst of creates goes through the follower
    results, thread = fire(follower, "POST", [job(test_image, "2GiB", f"b{i}") for i in range(8)])
    wait_for(lambda: len(engine_of(docker_client, *NODES)) >= 3, 60, what="creates under way")
    first.stop(signal.SIGKILL)
    second = ha.leader(besides=first)
    thread.join(150)
    follow(agents, second)
    settles(second, docker_client, set(NODES))
    running = {r["id"] for r in second.get("/v1/containers", params={"state": "running"}).json()["containers"]}
    answered = [r.json()["id"] for r in results if isinstance(r, requests.Response) and r.status_code == 201]
    assert set(answered) <= running, "a create answered 201 lost its grant in the failover"
    placed = Counter(c["Labels"].get("ha.req") for c in engine_of(docker_client, *NODES))
    assert placed and max(placed.values()) == 1, f"a request was placed twice: {placed}"
    for answer in results:  # what was not placed was told why, never left hanging
        if isinstance(answer, requests.Response) and answer.status_code != 201:
            assert answer.status_code in (502, 503) and answer.json()["error"]["code"], answer.text

    # fill both GPUs, queue three requests, kill the new leader too: the third places them in order
    for node in second.get("/v1/nodes").json()["nodes"]:
        free = node["gpus"][0]["memory_free"]
        if free >= GiB:
            filler = second.post("/v1/containers", json=job(test_image, str(free), f"fill-{node['name']}",
                                                             node=node["name"]))
            assert filler.status_code == 201, filler.text
    queued = [second.post("/v1/containers", json=job(test_image, "2GiB", f"q{i}", queue=True)) for i in range(3)]
    assert [q.status_code for q in queued] == [202, 202, 202], [q.text for q in queued]
    ids = [q.json()["id"] for q in queued]
    second.stop(signal.SIGKILL)
    third = ha.leader(besides=second)
    follow(agents, third)  # the agents followed the leader through two failovers
    waiting = third.get("/v1/containers", params={"state": "queued"}).json()["containers"]
    assert [r["id"] for r in sorted(waiting, key=lambda r: r["queue"]["position"])] == ids
    fillers = [r for r in third.get("/v1/containers").json()["containers"]
               if r["labels"].get("ha.req", "").startswith("fill-") and r["state"] == "running"]
    assert fillers, "the fillers were adopted by the third leader"
    assert third.delete(f"/v1/containers/{fillers[0]['id']}").status_code in (200, 202)
    wait_for(lambda: all(third.get(f"/v1/containers/{i}").json()["state"] == "running" for i in ids), 60,
             what="the queued requests to run")
    placed_events = [e["container"] for e in third.events("placed") if e["container"] in ids]
    assert placed_events == ids, f"queued requests were placed out of order: {placed_events} != {ids}"
    settles(third, docker_client, set(NODES))


def test_a_paused_leader_comes_back_fenced_steps_down_and_changes_nothing(plane, docker_client,
                                                                          test_image) -> None:
    ha, agents = plane["ha"], plane["agents"]
    first = ha.leader()
    for i in range(2):
        assert first.post("/v1/containers", json=job(test_image, "3GiB", f"p{i}")).status_code == 201
    before = {c["Id"] for c in engine_of(docker_client, *NODES) if c["State"] == "running"}
    old_epoch = epoch_of(first)
    os.kill(first.popen.pid, signal.SIGSTOP)
    try:
        second = ha.leader(besides=first)
        follow(agents, second)
        assert epoch_of(second) > old_epoch
    finally:
        os.kill(first.popen.pid, signal.SIGCONT)
    wait_for(lambda: (first.health() or {}).get("role") == "follower", 15, what="the old leader to step down")
    wait_for(lambda: "no longer leading" in first.output(), 10, what="the old leader's step-down line")
    assert ha.leader() is second, "the old leader came back and took over again"
    # it stopped before it could send anything (a frame it sent would carry its old epoch, which agents refuse:
    # tests/test_ha_manager.py); nothing changed on the engine
    after = {c["Id"] for c in engine_of(docker_client, *NODES) if c["State"] == "running"}
    assert after == before
    settles(second, docker_client, set(NODES))
    # and it forwards now: a POST through it is placed once, by the new leader
    answer = first.post("/v1/containers", json=job(test_image, "1GiB", "via-old"))
    assert answer.status_code == 201, answer.text
    assert answer.json()["id"] in {r["id"] for r in second.get("/v1/containers").json()["containers"]}


def test_etcd_one_member_lost_changes_nothing_two_is_no_quorum_and_it_recovers(plane, docker_client,
                                                                               test_image) -> None:
    etcd, ha, agents = plane["etcd"], plane["ha"], plane["agents"]
    leader = ha.leader()
    kept = leader.post("/v1/containers", json=job(test_image, "2GiB", "kept"))
    assert kept.status_code == 201, kept.text
    etcd.members[0].kill()
    one_down = leader.post("/v1/containers", json=job(test_image, "2GiB", "one-down"))
    assert one_down.status_code == 201, one_down.text
    assert ha.leader() is leader, "one etcd member of three changed the leader"

    etcd.members[1].kill()

    def no_quorum() -> dict[str, Any] | None:
        # until its lease runs out the leader may still place (no one else can lead meanwhile); then it stops
        answer = ha.followers(leader)[0].post("/v1/containers", json=job(test_image, "1GiB", "nq"))
        body = answer.json()
        return body if answer.status_code == 503 and body["error"]["code"] == "no_quorum" else None

    refused = wait_for(no_quorum, 30, interval=0.5, what="503 no_quorum")
    assert "etcd" in refused["error"]["message"]
    for manager in ha.managers:  # no manager places any more, whichever is asked
        answer = manager.post("/v1/containers", json=job(test_image, "1GiB", "nq-after"))
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "no_quorum", answer.text
        assert answer.headers["Retry-After"]
    for record in (kept.json(), one_down.json()):  # running containers are untouched
        container = docker_client.api.inspect_container(record["container_id"])
        assert container["State"]["Running"], f"{record['id']} stopped while etcd had no quorum"

    for member in etcd.members[:2]:
        member.start()
    back = ha.leader(timeout=40)
    follow(agents, back)
    again = back.post("/v1/containers", json=job(test_image, "1GiB", "back"))
    assert again.status_code == 201, again.text
    running = {r["id"] for r in back.get("/v1/containers", params={"state": "running"}).json()["containers"]}
    assert {kept.json()["id"], one_down.json()["id"]} <= running
    settles(back, docker_client, set(NODES))

