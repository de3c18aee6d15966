"""Tenants, quotas, the wait queue, preemption, resizing in place and peak usage.

Real parts: a ``gpumgr manager`` process with tenants in its YAML config, a ``gpumgr agent`` process
driving the Docker engine on simulated GPUs (usage declared by real processes in real containers),
real sockets. Each tenant talks to the API with its own token.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from tests.invariant import settles
from tests.procs import AgentProc, ManagerProc, wait_for

GiB = 1 << 30
OPERATOR = "operator-token-0123456789"
ALICE = "alice-token-0123456789abcdef"
BOB = "bob-token-0123456789abcdefgh"
USAGE = "/tmp/use"
POLITE = "trap 'exit 0' TERM; while :; do sleep 1; done"


def write_config(path: Path, alice: dict[str, Any] | None = None, **extra: Any) -> Path:
    config = {"token": OPERATOR, "tenants": {
        "alice": {"token": ALICE, "gpu_memory": "10GiB", "containers": 3, "priority": 5, **(alice or {})},
        "bob": {"token": BOB},
    }, **extra}
    path.write_text(yaml.safe_dump(config))
    return path


class Client:
    """One caller of the API, with its token."""

    def __init__(self, manager: ManagerProc, token: str | None) -> None:
        self.url = manager.url
        self.http = requests.Session()
        if token:
            self.http.headers["Authorization"] = f"Bearer {token}"

    def call(self, method: str, path: str, **kw: Any) -> requests.Response:
        return self.http.request(method, self.url + path, timeout=90, **kw)

    def create(self, image: str, memory: str, use: int = 0, **extra: Any) -> requests.Response:
        body = {"image": image, "gpu_memory": memory, "env": {"GPUMGR_SIM_USAGE_FILE": USAGE},
                "command": ["sh", "-c", f"echo {use} > {USAGE}; {POLITE}"], **extra}
        return self.call("POST", "/v1/containers", json=body)

    def record(self, cid: str) -> dict[str, Any]:
        return self.call("GET", f"/v1/containers/{cid}").json()

    def state_of(self, cid: str) -> str:
        return str(self.record(cid)["state"])


def operator_manager(tmp_path: Path, config: Path, **kw: Any) -> ManagerProc:
    """A manager process on ``config``, its REST helper holding the operator's token."""
    manager = ManagerProc(tmp_path, "--config", str(config), **kw)
    manager.http.headers["Authorization"] = f"Bearer {OPERATOR}"
    return manager


@pytest.fixture
def stack(tmp_path, test_image, cleanup_containers):
    """A manager with tenants alice (10 GiB, 3 containers, priority ≤ 5) and bob, and one agent with one 8 GiB GPU."""
    config = write_config(tmp_path / "manager.yaml")
    manager = operator_manager(tmp_path, config, env={"GPUMGR_QUEUE_AGING": "3600"})
    agent = AgentProc(tmp_path, manager, "tenant-node", gpus="sim:1x8GiB")
    yield manager, agent, config
    agent.stop()
    manager.stop()


def clients(manager: ManagerProc) -> tuple[Client, Client, Client]:
    return Client(manager, OPERATOR), Client(manager, ALICE), Client(manager, BOB)


def wait_state(client: Client, cid: str, state: str, timeout: float = 20.0) -> dict[str, Any]:
    return wait_for(lambda: (r := client.record(cid))["state"] == state and r, timeout,
                    what=f"{cid} to be {state} (is {client.state_of(cid)})")


# --- quotas ----------------------------------------------------------------------------------------
def test_quotas_refuse_with_403_saying_which_and_how_much(stack, test_image):
    manager, _, _ = stack
    operator, alice, _ = clients(manager)
    first = alice.create(test_image, "2GiB")
    assert first.status_code == 201, first.text
    assert first.json()["tenant"] == "alice" and first.json()["priority"] == 5  # her ceiling is her default
    over = alice.create(test_image, "9GiB")
    assert over.status_code == 403
    error = over.json()["error"]
    assert error["code"] == "quota_exceeded"
    assert "gpu_memory quota is 10GiB" in error["message"] and "2GiB is in use" in error["message"], error
    # a request over the whole quota is refused at once, queue or not
    never = alice.create(test_image, "11GiB", queue=True)
    assert never.status_code == 403 and "can never be granted" in never.json()["error"]["message"]
    assert alice.create(test_image, "1GiB").status_code == 201
    assert alice.create(test_image, "1GiB").status_code == 201
    fourth = alice.create(test_image, "1GiB")
    assert fourth.status_code == 403 and "containers quota is 3" in fourth.json()["error"]["message"]
    # a priority above her ceiling is refused; the operator may ask for any
    high = alice.create(test_image, "1GiB", priority=6)
    assert high.status_code == 403 and high.json()["error"]["code"] == "priority_not_allowed"
    # the operator acting for alice is held to her quota too
    for_her = operator.create(test_image, "1GiB", tenant="alice")
    assert for_her.status_code == 403 and for_her.json()["error"]["code"] == "quota_exceeded"
    view = alice.call("GET", "/v1/tenants").json()["tenants"]
    assert [t["name"] for t in view] == ["alice"]
    assert view[0]["in_use"] == {"gpu_memory": 4 * GiB, "containers": 3}
    assert view[0]["quota"] == {"gpu_memory": 10 * GiB, "containers": 3, "priority": 5}
    assert {t["name"] for t in operator.call("GET", "/v1/tenants").json()["tenants"]} == {"alice", "bob"}
    settles(manager, __import__("docker").from_env(), {"tenant-node"})


def test_a_tenant_sees_and_touches_only_its_own(stack, test_image):
    manager, _, _ = stack
    operator, alice, bob = clients(manager)
    mine = alice.create(test_image, "1GiB").json()["id"]
    theirs = bob.create(test_image, "1GiB").json()["id"]
    unknown = "0" * 16
    for method, body in (("GET", None), ("DELETE", None), ("PATCH", {"gpu_memory": "2GiB"})):
        answer = bob.call(method, f"/v1/containers/{mine}", json=body)
        missing = bob.call(method, f"/v1/containers/{unknown}", json=body)
        assert answer.status_code == missing.status_code == 404, (method, answer.text)
        assert answer.json()["error"]["message"].replace(mine, unknown) == missing.json()["error"]["message"]
    assert alice.state_of(mine) == "running"  # bob's DELETE touched nothing
    assert [r["id"] for r in bob.call("GET", "/v1/containers").json()["containers"]] == [theirs]
    assert {r["id"] for r in operator.call("GET", "/v1/containers").json()["containers"]} == {mine, theirs}
    bob_events = bob.call("GET", "/v1/events").json()["events"]
    assert bob_events and all(e["tenant"] == "bob" for e in bob_events)
    assert mine not in str(bob_events)
    listed = {c for n in bob.call("GET", "/v1/nodes").json()["nodes"] for g in n["gpus"] for c in g["containers"]}
    assert listed == {theirs}
    assert bob.call("DELETE", "/v1/nodes/tenant-node").status_code == 403
    acting = bob.create(test_image, "1GiB", tenant="alice")
    assert acting.status_code == 403 and acting.json()["error"]["code"] == "forbidden"
    assert Client(manager, None).call("GET", "/v1/containers").status_code == 401
    assert Client(manager, "not-a-token-of-anyone").call("GET", "/v1/tenants").status_code == 401
    assert alice.call("DELETE", f"/v1/containers/{mine}").status_code == 200


# --- the queue -------------------------------------------------------------------------------------
def test_queued_requests_go_by_priority_then_first_come_without_another_call(stack, test_image):
    manager, _, _ = stack
    operator, alice, bob = clients(manager)
    blocker = operator.create(test_image, "6GiB").json()["id"]
    low = bob.create(test_image, "5GiB", queue=True)
    assert low.status_code == 202, low.text
    low_id = low.json()["id"]
    assert low.json()["state"] == "queued" and low.json()["queue"]["position"] == 1 and low.json()["node"] is None
    high_id = alice.create(test_image, "5GiB", queue=True, priority=5).json()["id"]
    later_id = bob.create(test_image, "5GiB", queue=True).json()["id"]
    assert alice.record(high_id)["queue"]["position"] == 1
    assert bob.record(low_id)["queue"]["position"] == 2 and bob.record(later_id)["queue"]["position"] == 3
    # without "queue", a request that would jump the line is refused though 2 GiB are free
    jumper = bob.create(test_image, "1GiB")
    assert jumper.status_code == 409 and "queued request(s)" in jumper.json()["error"]["message"]
    queued = operator.call("GET", "/v1/containers", params={"state": "queued"}).json()["containers"]
    assert [r["id"] for r in queued] == [high_id, low_id, later_id]
    assert operator.call("DELETE", f"/v1/containers/{blocker}").status_code == 200
    wait_state(alice, high_id, "running")
    assert bob.state_of(low_id) == "queued" and bob.record(low_id)["queue"]["position"] == 1
    assert alice.call("DELETE", f"/v1/containers/{high_id}").status_code == 200
    wait_state(bob, low_id, "running")
    assert bob.state_of(later_id) == "queued"
    placed = [e for e in operator.call("GET", "/v1/events", params={"type": "placed"}).json()["events"]
              if e["container"] in (high_id, low_id)]
    assert [e["container"] for e in placed] == [high_id, low_id]
    assert "after waiting" in placed[0]["message"]
    settles(manager, __import__("docker").from_env(), {"tenant-node"})


def test_aging_lets_a_long_wait_pass_newer_higher_priority(tmp_path, test_image, cleanup_containers):
    config = write_config(tmp_path / "manager.yaml")
    manager = operator_manager(tmp_path, config, env={"GPUMGR_QUEUE_AGING": "0.5"})
    agent = AgentProc(tmp_path, manager, "aging-node", gpus="sim:1x8GiB")
    try:
        operator, alice, bob = clients(manager)
        blocker = operator.create(test_image, "6GiB").json()["id"]
        old = bob.create(test_image, "5GiB", queue=True).json()["id"]  # priority 0
        time.sleep(2.0)  # four aging steps: effective priority 4 and rising
        assert bob.record(old)["queue"]["effective_priority"] >= 4
        newer = alice.create(test_image, "5GiB", queue=True, priority=2).json()["id"]
        assert bob.record(old)["queue"]["position"] == 1 and alice.record(newer)["queue"]["position"] == 2
        fresh_high = alice.create(test_image, "5GiB", queue=True, priority=5).json()["id"]
        assert alice.record(fresh_high)["queue"]["position"] == 1  # 5 still beats 0 + 2 s / 0.5 s, for now
        operator.call("DELETE", f"/v1/containers/{blocker}")
        wait_state(alice, fresh_high, "running")
        assert bob.state_of(old) == "queued" and alice.state_of(newer) == "queued"
    finally:
        agent.stop()
        manager.stop()


def test_withdrawal_and_timeout_end_a_wait(stack, test_image):
    manager, _, _ = stack
    operator, alice, _ = clients(manager)
    blocker = operator.create(test_image, "6GiB").json()["id"]
    withdrawn = alice.create(test_image, "5GiB", queue=True).json()["id"]
    timed = alice.create(test_image, "5GiB", queue=True, queue_timeout=1).json()["id"]
    gone = alice.call("DELETE", f"/v1/containers/{withdrawn}")
    assert gone.status_code == 200 and gone.json()["state"] == "removed"
    assert "withdrawn" in gone.json()["reason"]
    expired = wait_state(alice, timed, "expired", timeout=5)
    assert "queue_timeout" in expired["reason"]
    finals = [e for e in alice.call("GET", "/v1/events").json()["events"] if e.get("final")]
    assert {e["container"]: e["type"] for e in finals if e["container"] in (withdrawn, timed)} == {
        withdrawn: "removed", timed: "expired"}
    assert alice.call("GET", "/v1/tenants").json()["tenants"][0]["queued"] == {"gpu_memory": 0, "requests": 0}
    operator.call("DELETE", f"/v1/containers/{blocker}")
    time.sleep(1.5)  # room is free: neither may be placed now
    assert alice.state_of(withdrawn) == "removed" and alice.state_of(timed) == "expired"


def test_only_preemptible_containers_of_lower_priority_are_preempted(stack, test_image, docker_client):
    manager, _, _ = stack
    operator, alice, bob = clients(manager)
    steady = bob.create(test_image, "3GiB").json()["id"]  # not preemptible
    victim = bob.create(test_image, "4GiB", preemptible=True).json()["id"]
    victim_container = bob.record(victim)["container_id"]
    waiting = alice.create(test_image, "5GiB", queue=True, priority=3)
    assert waiting.status_code == 202
    ended = wait_state(bob, victim, "preempted")
    assert waiting.json()["id"] in ended["reason"] and ended["preempted_for"] == waiting.json()["id"]
    wait_state(alice, waiting.json()["id"], "running")
    assert bob.state_of(steady) == "running"
    assert victim_container not in {c.id for c in docker_client.containers.list()}
    event = [e for e in operator.call("GET", "/v1/events", params={"type": "preempted"}).json()["events"]
             if e["container"] == victim and e.get("final")]
    assert len(event) == 1 and event[0]["preempted_for"] == waiting.json()["id"]
    # the steady one is never preempted, whatever waits
    big = operator.create(test_image, "6GiB", queue=True, priority=100).json()["id"]
    time.sleep(2.0)
    assert operator.state_of(big) == "queued" and bob.state_of(steady) == "running"
    settles(manager, docker_client, {"tenant-node"})


# --- resizing and peak -----------------------------------------------------------------------------
def test_resize_grows_shrinks_and_refuses_and_the_agent_enforces_the_new_figure(stack, test_image, docker_client):
    manager, _, _ = stack
    operator, alice, _ = clients(manager)
    record = alice.create(test_image, "2GiB", use=GiB).json()
    cid = record["id"]
    wait_for(lambda: alice.record(cid)["gpu_memory_used"] == GiB, 10, what="usage sampled")
    grown = alice.call("PATCH", f"/v1/containers/{cid}", json={"gpu_memory": "4GiB"})
    assert grown.status_code == 200 and grown.json()["gpu_memory"] == 4 * GiB
    assert manager.gpu(record["gpus"][0]["uuid"])["memory_reserved"] == 4 * GiB
    # the agent enforces 4 GiB now: 3 GiB of use, over the old grant, is not killed
    docker_client.containers.get(record["container_id"]).exec_run(["sh", "-c", f"echo {3 * GiB} > {USAGE}"])
    wait_for(lambda: alice.record(cid)["gpu_memory_used"] == 3 * GiB, 10, what="3 GiB sampled")
    time.sleep(1.5)
    assert alice.state_of(cid) == "running"
    over_quota = alice.call("PATCH", f"/v1/containers/{cid}", json={"gpu_memory": "11GiB"})
    assert over_quota.status_code == 403 and over_quota.json()["error"]["code"] == "quota_exceeded"
    filler = operator.create(test_image, "3GiB").json()["id"]
    no_room = alice.call("PATCH", f"/v1/containers/{cid}", json={"gpu_memory": "6GiB"})
    assert no_room.status_code == 409 and no_room.json()["error"]["code"] == "no_fit"
    below = alice.call("PATCH", f"/v1/containers/{cid}", json={"gpu_memory": "2GiB"})
    assert below.status_code == 409 and below.json()["error"]["code"] == "below_usage"
    assert alice.record(cid)["gpu_memory"] == 4 * GiB
    bad = alice.call("PATCH", f"/v1/containers/{cid}", json={"gpu_memory": "lots"})
    assert bad.status_code == 400
    forced = alice.call("PATCH", f"/v1/containers/{cid}", json={"gpu_memory": "2GiB", "force": True})
    assert forced.status_code == 200 and forced.json()["gpu_memory"] == 2 * GiB
    killed = wait_state(alice, cid, "killed", timeout=10)
    assert killed["detail"]["overrun"]["grant_bytes"] == 2 * GiB
    assert killed["gpu_memory_peak"] == 3 * GiB  # the peak stays after it ended
    assert operator.state_of(filler) == "running"
    settles(manager, docker_client, {"tenant-node"})


def test_peak_stays_after_usage_falls(stack, test_image, docker_client):
    manager, _, _ = stack
    _, alice, _ = clients(manager)
    record = alice.create(test_image, "4GiB", use=3 * GiB).json()
    cid = record["id"]
    wait_for(lambda: alice.record(cid)["gpu_memory_peak"] == 3 * GiB, 10, what="peak of 3 GiB")
    docker_client.containers.get(record["container_id"]).exec_run(["sh", "-c", f"echo {GiB} > {USAGE}"])
    now = wait_for(lambda: (r := alice.record(cid))["gpu_memory_used"] == GiB and r, 10, what="1 GiB used")
    assert now["gpu_memory_peak"] == 3 * GiB
    ended = alice.call("DELETE", f"/v1/containers/{cid}").json()
    assert ended["state"] == "removed" and ended["gpu_memory_peak"] == 3 * GiB


# --- restarts and reloads --------------------------------------------------------------------------
def test_the_queue_survives_a_manager_kill_and_is_placed_after(tmp_path, test_image, docker_client,
                                                               cleanup_containers):
    config = write_config(tmp_path / "manager.yaml")
    manager = operator_manager(tmp_path, config)
    agent = AgentProc(tmp_path, manager, "queue-node", gpus="sim:1x8GiB")
    try:
        operator, alice, bob = clients(manager)
        blocker = operator.create(test_image, "6GiB").json()["id"]
        first = alice.create(test_image, "5GiB", queue=True, priority=4).json()["id"]
        second = bob.create(test_image, "5GiB", queue=True).json()["id"]
        manager.popen.send_signal(signal.SIGKILL)
        manager.popen.wait(10)
        manager = operator_manager(tmp_path, config, api_port=manager.api_port, agent_port=manager.agent_port)
        operator, alice, bob = clients(manager)
        assert alice.record(first)["queue"]["position"] == 1 and bob.record(second)["queue"]["position"] == 2
        assert alice.call("GET", "/v1/tenants").json()["tenants"][0]["queued"]["requests"] == 1
        agent.wait_ready()
        wait_for(lambda: operator.state_of(blocker) == "running", 10, what="blocker re-adopted")
        assert operator.call("DELETE", f"/v1/containers/{blocker}").status_code == 200
        wait_state(alice, first, "running")
        assert bob.state_of(second) == "queued"
        journal = manager.state_dir / "queue.jsonl"
        assert oct(journal.stat().st_mode & 0o777) == "0o600"
        settles(manager, docker_client, {"queue-node"})
    finally:
        agent.stop()
        manager.stop()


def test_sighup_reloads_tenants_and_a_broken_file_keeps_them(stack, test_image):
    manager, _, config = stack
    _, alice, _ = clients(manager)
    write_config(config, alice={"gpu_memory": "1GiB"})
    manager.popen.send_signal(signal.SIGHUP)
    wait_for(lambda: alice.call("GET", "/v1/tenants").json()["tenants"][0]["quota"]["gpu_memory"] == GiB, 10,
             what="the new quota")
    assert alice.create(test_image, "2GiB").json()["error"]["code"] == "quota_exceeded"
    config.write_text("token: [unclosed\n")
    manager.popen.send_signal(signal.SIGHUP)
    wait_for(lambda: "reload refused" in manager.output(), 10, what="the refusal logged")
    assert alice.call("GET", "/v1/tenants").json()["tenants"][0]["quota"]["gpu_memory"] == GiB
    write_config(config, alice={"token": "alice-rotated-token-0123456789"})
    manager.popen.send_signal(signal.SIGHUP)
    wait_for(lambda: alice.call("GET", "/v1/tenants").status_code == 401, 10, what="the old token refused")
    rotated = Client(manager, "alice-rotated-token-0123456789")
    assert rotated.call("GET", "/v1/tenants").json()["tenants"][0]["name"] == "alice"


def test_docker_gpu_run_passes_priority_preemptible_and_queue(stack, test_image, monkeypatch, capsys):
    from gpumgr.plugin import docker_gpu

    manager, _, _ = stack
    operator, alice, _ = clients(manager)
    monkeypatch.setenv("GPUMGR_TOKEN", ALICE)
    blocker = operator.create(test_image, "6GiB").json()["id"]
    status = docker_gpu.main(["gpu", "--manager", manager.url, "run", "-d", "--gpu-memory", "5GiB", "--priority", "4",
                              "--preemptible", "--queue", "--queue-timeout", "600", test_image, "sleep", "60"])
    assert status == 0
    printed = capsys.readouterr().out
    assert "queued at position 1 of 1" in printed, printed
    record = alice.call("GET", "/v1/containers", params={"state": "queued"}).json()["containers"][0]
    assert record["priority"] == 4 and record["preemptible"] and record["queue"]["expires_at"] is not None
    assert docker_gpu.main(["gpu", "--manager", manager.url, "ps"]) == 0
    assert "queued #1" in capsys.readouterr().out
    refused = docker_gpu.main(["gpu", "--manager", manager.url, "run", "--gpu-memory", "1GiB", "--priority", "9",
                               test_image, "true"])
    assert refused == 125 and "priority_not_allowed" in capsys.readouterr().err  # docker run's own failure code
    operator.call("DELETE", f"/v1/containers/{blocker}")
    wait_state(alice, record["id"], "running")


def test_a_resize_outlives_an_agent_restart_and_a_request_that_could_never_fit_is_refused(stack, test_image,
                                                                                          tmp_path, docker_client):
    manager, agent, _ = stack
    _, alice, bob = clients(manager)
    never = bob.create(test_image, "9GiB", queue=True)  # the one GPU holds 8 GiB
    assert never.status_code == 409 and never.json()["error"]["code"] == "never_fits"
    assert bob.call("GET", "/v1/containers", params={"state": "queued"}).json()["containers"] == []
    record = alice.create(test_image, "2GiB", use=GiB).json()
    cid = record["id"]
    assert bob.call("GET", "/v1/containers", params={"tenant": "alice"}).json()["containers"] == []
    assert alice.call("PATCH", f"/v1/containers/{cid}", json={"gpu_memory": "4GiB"}).status_code == 200
    ups = len(manager.events("node_up"))
    agent.stop()
    # the container's labels still say 2 GiB: the restarted agent must enforce the 4 GiB it was told
    restarted = AgentProc(tmp_path, manager, agent.node, gpus="sim:1x8GiB", state_dir=agent.state_dir, join=False)
    try:
        wait_for(lambda: len(manager.events("node_up")) > ups, 20, what="the agent to register again")
        docker_client.containers.get(record["container_id"]).exec_run(["sh", "-c", f"echo {3 * GiB} > {USAGE}"])
        wait_for(lambda: alice.record(cid)["gpu_memory_used"] == 3 * GiB, 10, what="3 GiB sampled")
        time.sleep(1.5)
        assert alice.record(cid)["state"] == "running" and alice.record(cid)["gpu_memory"] == 4 * GiB
        settles(manager, docker_client, {"tenant-node"})
    finally:
        restarted.stop()
