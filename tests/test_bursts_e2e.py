"""Burstable grants end to end: ``gpumgr manager`` and ``gpumgr agent`` processes, the real engine, one simulated
24 GiB GPU. A burster (4 GiB request, 12 GiB limit) runs above its request; a request that needs its bytes
reclaims it; one back under its request is left alone; one past its limit, or whose processes together pass
it, is killed; the agent stops one that grew into bytes just granted to another. Each test ends with the
invariant (tests/invariant.py), which includes: reserved bytes plus bursts fit every GPU."""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from gpumgr.plugin import docker_gpu
from tests.invariant import settles
from tests.procs import AgentProc, ManagerProc, remove_containers_of, wait_for
from tests.test_stats import columns

GiB = 1 << 30
USAGE = "/tmp/use"
NODE = "node-burst"


@pytest.fixture(scope="module")
def stack(tmp_path_factory, test_image, docker_client) -> Iterator[list]:
    """One manager (bursters reclaimable after 0.2 s) and one agent with a single 24 GiB simulated GPU, and
    their folder: ``[manager, agent, tmp]`` (a test may restart the agent in place)."""
    tmp = tmp_path_factory.mktemp("bursts")
    manager = ManagerProc(tmp, env={**os.environ, "GPUMGR_BURST_MIN_RUNTIME": "0.2"})
    procs = [manager, AgentProc(tmp, manager, NODE, gpus="sim:1x24GiB"), tmp]
    yield procs
    procs[1].stop()
    manager.stop()
    remove_containers_of(docker_client, NODE)


@pytest.fixture
def bursts(stack, docker_client) -> Iterator[tuple[ManagerProc, AgentProc]]:
    """The stack, emptied after each test once the invariant holds."""
    manager, agent, _ = stack
    yield manager, agent
    settles(manager, docker_client, {NODE})
    records = manager.get("/v1/containers").json()["containers"]
    live = [r["id"] for r in records if r["state"] in ("creating", "running")]
    with ThreadPoolExecutor(4) as pool:  # each waits out its stop's grace: side by side
        list(pool.map(lambda cid: manager.delete(f"/v1/containers/{cid}"), live))


def job(image: str, memory: str, use: int, limit: str | None = None, **extra) -> dict:
    """A container that declares ``use`` bytes of simulated GPU memory and sleeps (a DELETE's SIGTERM ends it)."""
    body = {"image": image, "gpu_memory": memory, "env": {"GPUMGR_SIM_USAGE_FILE": USAGE},
            "command": ["sh", "-c", f"trap 'exit 0' TERM; echo {use} > {USAGE}; sleep 300 & wait"], **extra}
    return body | ({"gpu_memory_limit": limit} if limit else {})


def write_usage(docker_client, container_id: str, value: int, path: str = USAGE) -> None:
    """Set a running container's simulated use from the host, in one write."""
    pid = docker_client.containers.get(container_id).attrs["State"]["Pid"]
    fd = os.open(f"/proc/{pid}/root{path}", os.O_WRONLY | os.O_TRUNC)
    try:
        os.write(fd, f"{value}\n".encode())
    finally:
        os.close(fd)


def record_of(manager: ManagerProc, cid: str) -> dict:
    return manager.get(f"/v1/containers/{cid}").json()


def ended(manager: ManagerProc, cid: str, what: str) -> dict:
    return wait_for(lambda: (r := record_of(manager, cid))["state"] not in ("creating", "running") and r, 10,
                    what=what)


def burster(manager: ManagerProc, image: str, use: int, limit: str = "12GiB") -> tuple[dict, str]:
    """A running burster of 4 GiB up to ``limit`` using ``use`` bytes, seen on the map: (record, GPU uuid)."""
    response = manager.post("/v1/containers", json=job(image, "4GiB", use, limit))
    assert response.status_code == 201, response.text
    record = response.json()
    uuid = record["gpus"][0]["uuid"]
    wait_for(lambda: record_of(manager, record["id"])["gpu_memory_used"] == use, 10, what="its use on the map")
    return record, uuid


def stats_lines(manager: ManagerProc, capsys: pytest.CaptureFixture[str], *args: str) -> list[str]:
    """``docker gpu ARGS`` against ``manager`` in this process, its output's lines (a table, piped)."""
    assert docker_gpu.main(["gpu", "--manager", manager.url, *args]) == 0
    return capsys.readouterr().out.splitlines()


def test_a_burster_runs_above_its_request_and_is_reclaimed_for_a_request_that_needs_its_bytes(
        bursts, test_image, docker_client, capsys):
    manager, _ = bursts
    record, uuid = burster(manager, test_image, 10 * GiB)
    assert record["gpu_memory"] == 4 * GiB and record["gpu_memory_limit"] == 12 * GiB
    container = docker_client.containers.get(record["container_id"])
    env = dict(e.split("=", 1) for e in container.attrs["Config"]["Env"])
    assert env["GPUMGR_GPU_MEMORY"] == str(4 * GiB) and env["GPUMGR_GPU_MEMORY_LIMIT"] == str(12 * GiB)
    assert container.labels["gpumgr.memory_limit"] == str(12 * GiB)
    gpu = manager.gpu(uuid)  # the map reserves the request; the burst is taken from what is free
    assert (gpu["memory_reserved"], gpu["memory_burst"], gpu["memory_free"]) == (4 * GiB, 6 * GiB, 14 * GiB)
    gauge = next(line for line in manager.get("/metrics").text.splitlines()
                 if line.startswith("gpumgr_gpu_memory_burst_bytes{") and uuid in line)
    assert float(gauge.rsplit(" ", 1)[1]) == 6 * GiB
    shown = stats_lines(manager, capsys, "stats", "--no-stream")  # docker gpu shows the limit and the burst
    assert any(record["container_id"][:12] in line and "4GiB/12GiB" in line for line in shown), shown
    nodes = {columns(line)[2]: columns(line) for line in stats_lines(manager, capsys, "nodes")[1:]
             if line.startswith(NODE)}
    assert nodes["0"][6:8] == ["4GiB", "6GiB"] and "▚" in nodes["0"][4]  # RESERVED, BURST; the bar's burst cells

    placed = manager.post("/v1/containers", json=job(test_image, "16GiB", 0))  # fits only once the burst is back
    assert placed.status_code == 201, placed.text
    assert placed.json()["state"] == "running" and placed.json()["gpus"][0]["uuid"] == uuid
    victim = record_of(manager, record["id"])
    assert (victim["state"], victim["reason"]) == ("preempted", "burst_reclaimed")
    assert victim["preempted_for"] == placed.json()["id"]
    assert any(e["type"] == "preempted" and e["container"] == record["id"] for e in manager.events())


def test_a_burster_back_under_its_request_is_not_reclaimed(bursts, test_image, docker_client):
    manager, _ = bursts
    record, uuid = burster(manager, test_image, 10 * GiB)
    write_usage(docker_client, record["container_id"], 3 * GiB)
    wait_for(lambda: manager.gpu(uuid)["memory_burst"] == 0, 10, what="the burst to end")
    placed = manager.post("/v1/containers", json=job(test_image, "16GiB", 0))
    assert placed.status_code == 201, placed.text
    assert record_of(manager, record["id"])["state"] == "running"
    settles(manager, docker_client, {NODE})  # a sample later it still runs beside the new grant
    assert record_of(manager, record["id"])["state"] == "running"


def test_a_burster_past_its_limit_is_killed_and_its_limit_can_be_changed(bursts, test_image, docker_client):
    manager, _ = bursts
    record, _ = burster(manager, test_image, 10 * GiB)
    refused = manager.http.patch(f"{manager.url}/v1/containers/{record['id']}", json={"gpu_memory_limit": "2GiB"})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "limit_below_request"
    grown = manager.http.patch(f"{manager.url}/v1/containers/{record['id']}", json={"gpu_memory_limit": "16GiB"})
    assert grown.status_code == 200 and grown.json()["gpu_memory_limit"] == 16 * GiB, grown.text
    write_usage(docker_client, record["container_id"], 14 * GiB)  # under the new limit: it runs
    wait_for(lambda: record_of(manager, record["id"])["gpu_memory_used"] == 14 * GiB, 10, what="the new use")
    assert record_of(manager, record["id"])["state"] == "running"
    write_usage(docker_client, record["container_id"], 17 * GiB)
    done = ended(manager, record["id"], "the kill above the limit")
    assert (done["state"], done["reason"]) == ("killed", "gpu_memory_exceeded")
    assert done["detail"]["overrun"]["grant_bytes"] == 16 * GiB


def test_three_processes_that_together_pass_the_limit_are_killed(bursts, test_image):
    """Under MPS the driver caps each process at the limit, so several processes of one container can pass it
    together: here three use 5 GiB each (each under the 12 GiB cap, 15 GiB in all), and the kill is the fence."""
    manager, _ = bursts
    each = 5 * GiB
    script = " ".join(f"(echo {each} > /tmp/use{i}; GPUMGR_SIM_USAGE_FILE=/tmp/use{i} exec sleep 300) &"
                      for i in range(3)) + " wait"
    body = {"image": test_image, "gpu_memory": "4GiB", "gpu_memory_limit": "12GiB", "command": ["sh", "-c", script]}
    response = manager.post("/v1/containers", json=body)
    assert response.status_code == 201, response.text
    done = ended(manager, response.json()["id"], "the kill of three processes past the limit together")
    assert (done["state"], done["reason"]) == ("killed", "gpu_memory_exceeded")
    assert done["detail"]["overrun"]["observed"] == 3 * each and len(done["detail"]["overrun"]["pids"]) == 3


def test_the_agent_stops_a_burster_that_grows_into_just_granted_bytes(bursts, test_image, docker_client):
    manager, _ = bursts
    record, uuid = burster(manager, test_image, 4 * GiB, limit="20GiB")
    placed = manager.post("/v1/containers", json=job(test_image, "16GiB", 0))  # 20 GiB free: no reclaim needed
    assert placed.status_code == 201, placed.text
    write_usage(docker_client, record["container_id"], 12 * GiB)  # under its limit, into the new grant's bytes
    victim = ended(manager, record["id"], "the agent to stop the burster")
    assert (victim["state"], victim["reason"]) == ("preempted", "burst_reclaimed")
    assert record_of(manager, placed.json()["id"])["state"] == "running"
    assert manager.gpu(uuid)["memory_burst"] == 0


def test_a_limit_below_the_request_is_a_400(bursts, test_image):
    manager, _ = bursts
    response = manager.post("/v1/containers", json=job(test_image, "8GiB", 0, "4GiB"))
    assert response.status_code == 400 and response.json()["error"]["code"] == "limit_below_request"
    assert "gpu_memory_limit" in response.json()["error"]["message"]


def test_a_restarted_agent_readopts_the_limit(stack, bursts, test_image, docker_client):
    """From its label, or from its agent's record of a PATCH (a container's labels cannot change)."""
    manager, agent = bursts
    record, uuid = burster(manager, test_image, 10 * GiB)
    other, _ = burster(manager, test_image, 4 * GiB)
    patched = manager.http.patch(f"{manager.url}/v1/containers/{other['id']}", json={"gpu_memory_limit": "6GiB"})
    assert patched.status_code == 200, patched.text
    agent.stop()
    stack[1] = AgentProc(stack[2], manager, NODE, gpus="sim:1x24GiB")
    write_usage(docker_client, record["container_id"], 11 * GiB)  # within the 12 GiB its label says: it runs
    write_usage(docker_client, other["container_id"], 7 * GiB)  # past the 6 GiB its PATCH said: killed
    done = ended(manager, other["id"], "the kill above the PATCHed limit")
    assert (done["state"], done["reason"]) == ("killed", "gpu_memory_exceeded")
    wait_for(lambda: manager.gpu(uuid)["memory_burst"] == 7 * GiB, 10, what="the burst after the restart")
    assert record_of(manager, record["id"])["state"] == "running"
    assert record_of(manager, record["id"])["gpu_memory_limit"] == 12 * GiB
    write_usage(docker_client, record["container_id"], 13 * GiB)
    done = ended(manager, record["id"], "the kill above the re-adopted limit")
    assert (done["state"], done["reason"]) == ("killed", "gpu_memory_exceeded")
