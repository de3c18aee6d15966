"""``Idempotency-Key`` across managers on a real etcd (issue 31): two ``gpumgr manager`` processes, a
``gpumgr agent`` with the Docker engine (simulated GPU), and the leader killed with SIGKILL.

The key travels from a follower to the leader; its answer lives in etcd, so the next leader gives a
repeat the same answer and the engine holds one container. The key book's compare-and-set writes are
checked on the same etcd, with a deposed writer fenced.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import uuid
from typing import Any

import pytest

from gpumgr.manager.control.etcdv3 import EtcdClient
from gpumgr.manager.control.idempotency import EtcdKeys
from gpumgr.manager.control.store import Fenced
from gpumgr.manager.control.store_etcd import EtcdStore
from tests.ha_procs import HaManagers
from tests.procs import AgentProc, wait_for

NODE = "idem31-a"


def job(image: str, tag: str) -> dict[str, Any]:
    return {"image": image, "gpu_memory": "1GiB", "command": ["sleep", "300"], "labels": {"idem.req": tag}}


def test_a_keyed_create_answers_the_same_through_a_follower_and_after_the_leader_dies(
        tmp_path, etcd, test_image, docker_client, cleanup_containers) -> None:
    ha = HaManagers(tmp_path, etcd.endpoints, count=2, prefix="idem")
    agent = None
    try:
        leader = ha.leader()
        follower = ha.followers(leader)[0]
        agent = ha.agent(NODE, leader, gpus="sim:1x24GiB")
        key = {"Idempotency-Key": str(uuid.uuid4())}
        first = follower.post("/v1/containers", json=job(test_image, "one"), headers=key)
        assert first.status_code == 201, first.text
        # the header reached the leader: the leader itself has the key, and another body under it is refused
        assert leader.post("/v1/containers", json=job(test_image, "one"), headers=key).json() == first.json()
        other = follower.post("/v1/containers", json=job(test_image, "two"), headers=key)
        assert other.status_code == 422 and other.json()["error"]["code"] == "idempotency_mismatch"

        leader.stop(signal.SIGKILL)
        successor = ha.leader(besides=leader)
        agent.manager = successor
        agent.wait_ready(30)
        again = successor.post("/v1/containers", json=job(test_image, "one"), headers=key)
        assert again.status_code == 201 and again.json() == first.json(), again.text
        assert again.headers.get("Idempotent-Replayed") == "true"
        running = docker_client.api.containers(all=True, filters={"label": ["idem.req=one", f"gpumgr.node={NODE}"]})
        assert len(running) == 1
    finally:
        if agent is not None:
            with contextlib.suppress(Exception):
                agent.stop(signal.SIGKILL)
        ha.stop()


def test_a_create_in_flight_when_the_leader_dies_runs_once_for_its_key(
        tmp_path, etcd, test_image, docker_client, cleanup_containers, monkeypatch) -> None:
    """The leader claims the key in etcd, sends the create to a node that is paused, and is killed. The next
    leader knows the key: a repeat is 409 in_progress until the node's report settles it, then answered with
    the container the key named (or, had the create never run, by running it once); one container either way."""
    monkeypatch.setenv("GPUMGR_CREATE_TIMEOUT", "3")  # so a create that never ran is known as such within 20 s
    ha = HaManagers(tmp_path, etcd.endpoints, count=2, prefix="idem2")
    agent: AgentProc | None = None
    try:
        leader = ha.leader()
        agent = ha.agent(NODE, leader, gpus="sim:1x24GiB")
        key = {"Idempotency-Key": str(uuid.uuid4())}
        entries = etcd.client()
        os.kill(agent.popen.pid, signal.SIGSTOP)  # the create waits in its socket
        first: list[Any] = []

        def send() -> None:
            try:
                first.append(leader.post("/v1/containers", json=job(test_image, "flight"), headers=key))
            except Exception as exc:  # the leader is killed under it
                first.append(exc)

        threading.Thread(target=send, daemon=True).start()
        claimed = wait_for(lambda: entries.get_prefix(b"/idem2/idempotency/"), 10, what="the key claimed in etcd")
        entry = json.loads(claimed[0].value)
        assert entry["state"] == "in_progress" and len(entry["record"]) == 16
        time.sleep(0.5)  # the create goes out right after the claim
        leader.stop(signal.SIGKILL)
        os.kill(agent.popen.pid, signal.SIGCONT)
        successor = ha.leader(besides=leader)
        agent.manager = successor

        def settled() -> Any:
            answer = successor.post("/v1/containers", json=job(test_image, "flight"), headers=key)
            return None if answer.status_code == 409 and answer.json()["error"]["code"] == "in_progress" else answer

        soon = settled()  # the next leader knows the key at once: not run again while the create may land
        assert soon is None or soon.json().get("id") == entry["record"], soon.text if soon is not None else ""
        answer = wait_for(settled, 60, interval=0.5, what="the key's outcome settled on the next leader")
        assert answer.status_code == 201, answer.text
        engine = docker_client.api.containers(all=True, filters={"label": ["idem.req=flight", f"gpumgr.node={NODE}"]})
        assert len(engine) == 1 and engine[0]["Labels"]["gpumgr.grant"] == answer.json()["id"]
        again = successor.post("/v1/containers", json=job(test_image, "flight"), headers=key)
        assert again.json() == answer.json() and again.headers["Idempotent-Replayed"] == "true"
    finally:
        if agent is not None:
            with contextlib.suppress(Exception):
                os.kill(agent.popen.pid, signal.SIGCONT)
                agent.stop(signal.SIGKILL)
        ha.stop()


def test_etcd_entries_change_only_as_read_and_only_while_leading(etcd) -> None:
    client: EtcdClient = etcd.client()
    leading = [True]

    def guard() -> list[dict[str, Any]]:
        if not leading[0]:
            raise Fenced("not the leader")
        return []

    book = EtcdKeys(EtcdStore(client, guard, prefix="/idem-book/"))
    made = book.create("k1", {"state": "in_progress", "expires": 1.0})
    assert made is not None and book.create("k1", {"state": "in_progress"}) is None  # claimed once
    read = book.read("k1")
    assert read is not None and read.data == {"state": "in_progress", "expires": 1.0}
    done = book.replace(read, {"state": "done", "expires": 1.0})
    assert done is not None and book.replace(read, {"state": "other"}) is None  # a stale read changes nothing
    assert book.read("k1").state == "done"  # type: ignore[union-attr]
    book.create("k2", {"state": "done", "expires": 10.0})
    assert book.purge(5.0) == 1 and book.read("k1") is None and book.read("k2") is not None
    leading[0] = False
    with pytest.raises(Fenced):
        book.create("k3", {"state": "in_progress", "expires": 1.0})
    wait_for(lambda: book.read("k3") is None, 1, what="nothing written by a fenced writer")
