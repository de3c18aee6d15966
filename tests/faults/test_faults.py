"""Fault injection: kill -9 and restart the manager, the agent and dockerd at chosen points; stop an
agent past the down threshold; a burst of placements on a nearly full cluster.

Everything is real: ``gpumgr manager`` and ``gpumgr agent`` processes, ZeroMQ over loopback, Docker
engines and their containers; only the GPUs are simulated. Each test ends the same way: the
invariant of tests/invariant.py must hold within two heartbeats of the fault settling.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.faults.engine import ThrowawayEngine
from tests.images import busybox_tar
from tests.invariant import settles
from tests.procs import AgentProc, ManagerProc, wait_for

GiB = 1 << 30
USAGE = "/tmp/use"
READY = 30.0


def job(image: str, memory: str, use: int = 0, **extra: Any) -> dict[str, Any]:
    """A container that declares ``use`` bytes of simulated GPU memory and sleeps."""
    return {"image": image, "gpu_memory": memory, "env": {"GPUMGR_SIM_USAGE_FILE": USAGE},
            "command": ["sh", "-c", f"echo {use} > {USAGE}; exec sleep 300"], **extra}


def fire(manager: ManagerProc, method: str, paths_or_bodies: list[Any]) -> tuple[list[Any], threading.Thread]:
    """Send requests on background threads; the list fills with responses (or the exception each raised)."""
    results: list[Any] = []

    def one(item: Any) -> None:
        try:
            session = requests.Session()
            if method == "POST":
                results.append(session.post(manager.url + "/v1/containers", json=item, timeout=90))
            else:
                results.append(session.delete(manager.url + item, timeout=90))
        except requests.RequestException as exc:
            results.append(exc)

    def all_of() -> None:
        with ThreadPoolExecutor(len(paths_or_bodies)) as pool:
            list(pool.map(one, paths_or_bodies))

    thread = threading.Thread(target=all_of)
    thread.start()
    return results, thread


def agent_again(tmp_path: Path, manager: ManagerProc, agent: AgentProc, **kw: Any) -> AgentProc:
    """The same node's agent started again from its state directory (no token needed)."""
    return AgentProc(tmp_path, manager, agent.node, gpus="sim:2x24GiB", state_dir=agent.state_dir, join=False, **kw)


@pytest.fixture
def cluster(tmp_path, test_image, docker_client, cleanup_containers) -> Iterator[dict[str, Any]]:
    """A manager and one Docker agent (2 × 24 GiB simulated); the test may replace either."""
    procs: dict[str, Any] = {"manager": ManagerProc(tmp_path)}
    procs["agent"] = AgentProc(tmp_path, procs["manager"], "fault-a", gpus="sim:2x24GiB")
    yield procs
    for name in ("agent", "manager"):
        with contextlib.suppress(Exception):
            procs[name].stop(signal.SIGKILL if name == "agent" else signal.SIGTERM)


def test_manager_killed_during_creates_loses_and_doubles_nothing(tmp_path, cluster, docker_client, test_image):
    first = cluster["manager"]
    results, thread = fire(first, "POST", [job(test_image, "4GiB") for _ in range(8)])
    wait_for(lambda: len(docker_client.api.containers(all=True, filters={"label": "gpumgr.node=fault-a"})) >= 2,
             30, what="creates under way")
    first.stop(signal.SIGKILL)
    thread.join(120)
    cluster["manager"] = second = ManagerProc(tmp_path, api_port=first.api_port, agent_port=first.agent_port)
    cluster["agent"].wait_ready(READY)
    settles(second, docker_client, {"fault-a"})
    running = second.get("/v1/containers", params={"state": "running"}).json()["containers"]
    assert running, "the containers the agent finished creating were re-adopted"
    answered = [r.json() for r in results if isinstance(r, requests.Response) and r.status_code == 201]
    assert {r["id"] for r in answered} <= {r["id"] for r in running}, "a create answered 201 lost its grant"
    assert sum(g["memory_reserved"] for g in second.node("fault-a")["gpus"]) == 4 * GiB * len(running)


def test_manager_killed_during_deletes(tmp_path, cluster, docker_client, test_image):
    first = cluster["manager"]
    records = [first.post("/v1/containers", json=job(test_image, "3GiB")).json() for _ in range(4)]
    results, thread = fire(first, "DELETE", [f"/v1/containers/{r['id']}" for r in records])
    time.sleep(0.3)
    first.stop(signal.SIGKILL)
    thread.join(120)
    cluster["manager"] = second = ManagerProc(tmp_path, api_port=first.api_port, agent_port=first.agent_port)
    cluster["agent"].wait_ready(READY)
    settles(second, docker_client, {"fault-a"})
    # what the engine still runs is held again; what it removed holds nothing
    running = docker_client.api.containers(filters={"label": "gpumgr.node=fault-a"})
    alive = {c["Labels"]["gpumgr.grant"] for c in running}
    live = {r["id"] for r in second.get("/v1/containers").json()["containers"] if r["state"] == "running"}
    assert alive == live
    removed = {r.json()["id"] for r in results if isinstance(r, requests.Response) and r.status_code == 200}
    assert not removed & alive, "a DELETE answered 200 left its container running"


def test_agent_killed_during_creates(tmp_path, cluster, docker_client, test_image):
    manager, agent = cluster["manager"], cluster["agent"]
    results, thread = fire(manager, "POST", [job(test_image, "4GiB") for _ in range(8)])
    wait_for(lambda: len(docker_client.api.containers(all=True, filters={"label": "gpumgr.node=fault-a"})) >= 2,
             30, what="creates under way")
    agent.stop(signal.SIGKILL)
    cluster["agent"] = agent_again(tmp_path, manager, agent, wait=False)
    cluster["agent"].wait_ready(READY)
    thread.join(120)
    codes = sorted(r.status_code for r in results)
    # each create either ran (201) or failed with the agent's restart as its reason (502): none waited out a timeout
    assert set(codes) <= {201, 502}, [r.text for r in results if r.status_code != 201]
    settles(manager, docker_client, {"fault-a"})


def test_agent_killed_while_its_container_overruns(tmp_path, cluster, docker_client, test_image):
    manager, agent = cluster["manager"], cluster["agent"]
    greedy = manager.post("/v1/containers", json=job(test_image, "2GiB", GiB)).json()
    calm = manager.post("/v1/containers", json=job(test_image, "2GiB", GiB)).json()
    agent.stop(signal.SIGKILL)
    docker_client.containers.get(greedy["container_id"]).exec_run(["sh", "-c", f"echo {3 * GiB} > {USAGE}"])
    cluster["agent"] = agent_again(tmp_path, manager, agent)
    killed = wait_for(lambda: (r := manager.get(f"/v1/containers/{greedy['id']}").json())["state"] == "killed" and r,
                      READY, what="the overrun to be killed by the restarted agent")
    assert killed["reason"] == "gpu_memory_exceeded" and killed["exit_code"] is not None
    assert manager.get(f"/v1/containers/{calm['id']}").json()["state"] == "running"
    settles(manager, docker_client, {"fault-a"})


def test_agent_stopped_past_the_down_threshold_keeps_intent(tmp_path, cluster, docker_client, test_image):
    manager, agent = cluster["manager"], cluster["agent"]
    keep = manager.post("/v1/containers", json=job(test_image, "5GiB")).json()
    drop = manager.post("/v1/containers", json=job(test_image, "5GiB")).json()
    os.kill(agent.popen.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: manager.node("fault-a")["state"] == "down", 15, what="the node marked down")
        assert manager.post("/v1/containers", json=job(test_image, "1GiB")).status_code == 503
        accepted = manager.delete(f"/v1/containers/{drop['id']}")
        assert accepted.status_code == 202, accepted.text
        # the container may still run on the silent node: its grant stays until the node confirms
        assert sum(g["memory_reserved"] for g in manager.node("fault-a")["gpus"]) == 10 * GiB
    finally:
        os.kill(agent.popen.pid, signal.SIGCONT)
    wait_for(lambda: manager.get(f"/v1/containers/{drop['id']}").json()["state"] == "removed", READY,
             what="the kept DELETE to be carried out")
    assert manager.get(f"/v1/containers/{keep['id']}").json()["state"] == "running"
    assert not docker_client.api.containers(all=True, filters={"label": f"gpumgr.grant={drop['id']}"})
    settles(manager, docker_client, {"fault-a"})


@pytest.fixture
def own_engine(tmp_path, test_image) -> Iterator[dict[str, Any]]:
    """A manager and one agent driving a throw-away dockerd that the test may kill -9."""
    engine = ThrowawayEngine(busybox_tar(shutil.which("busybox") or "/bin/busybox"))
    manager = ManagerProc(tmp_path)
    agent = AgentProc(tmp_path, manager, "fault-d", gpus="sim:2x24GiB", env=engine.env)
    yield {"engine": engine, "manager": manager, "agent": agent}
    agent.stop(signal.SIGKILL)
    manager.stop()
    engine.stop()


def _engine_crash(own_engine: dict[str, Any]) -> None:
    """kill -9 the engine, leave it down over two heartbeats, start it again; the agent lives through it."""
    own_engine["engine"].kill9()
    time.sleep(2.0)
    own_engine["engine"].start()
    wait_for(lambda: own_engine["manager"].node("fault-d")["state"] == "ready", READY, what="the node ready again")


def _settles_after_engine_crash(own_engine: dict[str, Any], image: str) -> None:
    manager, client = own_engine["manager"], own_engine["engine"].client
    settles(manager, client, {"fault-d"})  # within two heartbeats of the engine answering again
    after = manager.post("/v1/containers", json=job(image, "3GiB"))
    assert after.status_code == 201, after.text  # the agent drives the restarted engine
    settles(manager, client, {"fault-d"})


def test_dockerd_killed_under_running_containers(own_engine, test_image):
    manager = own_engine["manager"]
    records = [manager.post("/v1/containers", json=job(test_image, "3GiB")).json() for _ in range(3)]
    assert all(r["state"] == "running" for r in records), records
    _engine_crash(own_engine)
    _settles_after_engine_crash(own_engine, test_image)


def test_dockerd_killed_during_creates(own_engine, test_image):
    manager, client = own_engine["manager"], own_engine["engine"].client
    results, thread = fire(manager, "POST", [job(test_image, "3GiB") for _ in range(6)])
    wait_for(lambda: client.api.containers(all=True), 30, what="creates under way")
    _engine_crash(own_engine)
    thread.join(120)
    assert all(isinstance(r, requests.Response) and r.status_code in (201, 502) for r in results), results
    _settles_after_engine_crash(own_engine, test_image)


def test_dockerd_killed_during_deletes(own_engine, test_image):
    manager = own_engine["manager"]
    records = [manager.post("/v1/containers", json=job(test_image, "3GiB")).json() for _ in range(3)]
    results, thread = fire(manager, "DELETE", [f"/v1/containers/{r['id']}" for r in records])
    time.sleep(0.3)
    _engine_crash(own_engine)
    thread.join(120)
    # done (200), or refused at once because the engine was gone (502): never a hang
    assert all(isinstance(r, requests.Response) and r.status_code in (200, 502) for r in results), results
    _settles_after_engine_crash(own_engine, test_image)


def test_dockerd_killed_during_an_overrun(own_engine, test_image):
    manager, client = own_engine["manager"], own_engine["engine"].client
    greedy = manager.post("/v1/containers", json=job(test_image, "2GiB", GiB)).json()
    client.containers.get(greedy["container_id"]).exec_run(["sh", "-c", f"echo {3 * GiB} > {USAGE}"])
    _engine_crash(own_engine)
    ended = wait_for(lambda: (r := manager.get(f"/v1/containers/{greedy['id']}").json())["state"] != "running"
                     and r, READY, what="the overrunning container's end on the map")
    assert ended["state"] in ("killed", "exited") and ended["reason"], ended
    _settles_after_engine_crash(own_engine, test_image)


def test_manager_killed_during_an_overrun_records_the_kill_on_its_return(tmp_path, cluster, docker_client,
                                                                          test_image):
    first = cluster["manager"]
    greedy = first.post("/v1/containers", json=job(test_image, "2GiB", GiB)).json()
    first.stop(signal.SIGKILL)
    docker_client.containers.get(greedy["container_id"]).exec_run(["sh", "-c", f"echo {3 * GiB} > {USAGE}"])
    wait_for(lambda: not docker_client.containers.get(greedy["container_id"]).attrs["State"]["Running"]
             or docker_client.containers.get(greedy["container_id"]).reload(), 15, what="the agent's kill")
    cluster["manager"] = second = ManagerProc(tmp_path, api_port=first.api_port, agent_port=first.agent_port)
    cluster["agent"].wait_ready(READY)
    record = wait_for(lambda: (r := second.get(f"/v1/containers/{greedy['id']}")).ok and r.json(), 10,
                      what="the kill to be recorded")
    assert record["state"] == "killed" and record["reason"] == "gpu_memory_exceeded", record
    assert record["finished_at"] and record["exit_code"] is not None
    settles(second, docker_client, {"fault-a"})


def test_agent_killed_during_deletes(tmp_path, cluster, docker_client, test_image):
    manager, agent = cluster["manager"], cluster["agent"]
    records = [manager.post("/v1/containers", json=job(test_image, "3GiB")).json() for _ in range(4)]
    results, thread = fire(manager, "DELETE", [f"/v1/containers/{r['id']}" for r in records])
    time.sleep(0.3)
    agent.stop(signal.SIGKILL)
    cluster["agent"] = agent_again(tmp_path, manager, agent)
    thread.join(120)
    # each DELETE was done (200), or kept (202: its removal's answer died with the agent; the intent is in the state
    # directory and the restarted agent's report carries it out)
    assert all(isinstance(r, requests.Response) and r.status_code in (200, 202) for r in results), results
    wait_for(lambda: all(manager.get(f"/v1/containers/{r['id']}").json()["state"] == "removed" for r in records), 30,
             what="every DELETE'd container to be removed")
    assert not [c for c in docker_client.api.containers(all=True, filters={"label": "gpumgr.node=fault-a"})
                if c["Labels"].get("gpumgr.grant") in {r["id"] for r in records}], "a DELETE'd container stayed"
    settles(manager, docker_client, {"fault-a"})


def test_a_burst_of_placements_on_a_nearly_full_cluster(tmp_path, cluster, docker_client, test_image):
    manager = cluster["manager"]
    for _ in range(2):  # 2 × 22 GiB of 2 × 24 GiB taken: 4 GiB free in all
        assert manager.post("/v1/containers", json=job(test_image, "22GiB")).status_code == 201
    body = job(test_image, "1GiB")
    local = threading.local()

    def place(_: int) -> int:
        local.session = getattr(local, "session", None) or requests.Session()
        return int(local.session.post(manager.url + "/v1/containers", json=body, timeout=120).status_code)

    with ThreadPoolExecutor(32) as pool:
        codes = list(pool.map(place, range(1000)))
    assert codes.count(201) == 4 and codes.count(409) == 996, sorted(set(codes))
    containers = manager.get("/v1/containers", params={"state": "running"}).json()["containers"]
    assert len({c["container_id"] for c in containers}) == len(containers) == 6
    settles(manager, docker_client, {"fault-a"})
