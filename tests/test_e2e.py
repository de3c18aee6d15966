"""End to end: ``gpumgr manager`` and ``gpumgr agent`` as processes, a real Docker engine, simulated GPUs."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.procs import AgentProc, ManagerProc, process_gone, wait_for

GiB = 1 << 30
USAGE = "/tmp/use"


def sim_job(image: str, memory: str, use_bytes: int, **extra):
    """A container that declares ``use_bytes`` of simulated GPU memory and then sleeps."""
    return {"image": image, "gpu_memory": memory, "env": {"GPUMGR_SIM_USAGE_FILE": USAGE},
            "command": ["sh", "-c", f"echo {use_bytes} > {USAGE}; exec sleep 300"], **extra}


def test_a_request_becomes_a_pinned_labelled_container_on_the_map(manager, docker_agent, docker_client, test_image):
    response = manager.post("/v1/containers", json=sim_job(test_image, "6GiB", 3 * GiB, labels={"team": "ml"}))
    assert response.status_code == 201, response.text
    record = response.json()
    uuid = record["gpus"][0]["uuid"]
    assert record["state"] == "running" and record["node"] == "node-a"

    container = docker_client.containers.get(record["container_id"])
    env = dict(e.split("=", 1) for e in container.attrs["Config"]["Env"])
    assert env["NVIDIA_VISIBLE_DEVICES"] == uuid and env["GPUMGR_GPU_MEMORY"] == str(6 * GiB)
    labels = container.labels
    assert labels["gpumgr.grant"] == record["id"] and labels["gpumgr.gpu"] == uuid
    assert labels["gpumgr.memory"] == str(6 * GiB) and labels["team"] == "ml"
    assert container.attrs["HostConfig"]["NetworkMode"] == "none"

    gpu = wait_for(lambda: (g := manager.gpu(uuid))["memory_used"] == 3 * GiB and g, 10, what="usage on the map")
    assert gpu["memory_reserved"] == 6 * GiB and gpu["memory_unmanaged"] == 0
    assert gpu["memory_free"] == 18 * GiB and gpu["containers"] == [record["id"]]
    wait_for(lambda: manager.get(f"/v1/containers/{record['id']}").json()["gpu_memory_used"] == 3 * GiB, 5,
             what="per-container usage")

    assert manager.delete(f"/v1/containers/{record['id']}").json()["state"] == "removed"
    assert not docker_client.containers.list(all=True, filters={"label": f"gpumgr.grant={record['id']}"})
    assert manager.gpu(uuid)["memory_reserved"] == 0
    kinds = [e["type"] for e in manager.events() if e["container"] == record["id"]]
    assert kinds == ["placed", "started", "removed"]


def test_spread_and_binpack_follow_free_memory(manager, docker_agent, test_image):
    first = manager.post("/v1/containers", json=sim_job(test_image, "10GiB", 0)).json()
    second = manager.post("/v1/containers", json=sim_job(test_image, "4GiB", 0)).json()
    assert first["gpus"][0]["uuid"] != second["gpus"][0]["uuid"]  # spread: the emptier GPU
    third = manager.post("/v1/containers", json=sim_job(test_image, "4GiB", 0, placement="binpack")).json()
    assert third["gpus"][0]["uuid"] == first["gpus"][0]["uuid"]  # binpack: the fuller GPU that fits
    too_big = manager.post("/v1/containers", json=sim_job(test_image, "21GiB", 0))
    assert too_big.status_code == 409 and "20GiB" in too_big.json()["error"]["message"]


def test_missing_image_is_a_400_with_dockers_reason_and_leaves_nothing(manager, docker_agent, docker_client):
    """An unknown image is the caller's mistake: a 4xx with the engine's words, never a 502."""
    response = manager.post("/v1/containers", json={"image": "gpumgr-test/absent:1", "gpu_memory": "1GiB"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "image_not_found"
    assert "absent" in response.json()["error"]["message"]
    assert all(g["memory_reserved"] == 0 for g in manager.node("node-a")["gpus"])
    assert not docker_client.containers.list(all=True, filters={"label": "gpumgr.node=node-a"})
    assert manager.get("/v1/containers", params={"state": "failed"}).json()["containers"]


def test_an_image_reference_the_engine_rejects_is_a_400_with_its_words(manager, docker_agent, docker_client):
    """Found by schemathesis: a 300-character reference was a 502 agent_failed."""
    response = manager.post("/v1/containers", json={"image": "a" * 300, "gpu_memory": "1GiB"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "invalid_request"
    assert all(g["memory_reserved"] == 0 for g in manager.node("node-a")["gpus"])


def test_failed_start_releases_the_grant_and_removes_the_container(manager, docker_agent, docker_client, test_image):
    response = manager.post("/v1/containers", json={"image": test_image, "gpu_memory": "1GiB",
                                                    "command": ["/no/such/binary"]})
    assert response.status_code == 400 and response.json()["error"]["code"] == "bad_command", response.text
    assert all(g["memory_reserved"] == 0 for g in manager.node("node-a")["gpus"])
    assert not docker_client.containers.list(all=True, filters={"label": "gpumgr.node=node-a"})


def test_exits_are_reported_promptly_and_free_the_grant(manager, docker_agent, test_image):
    record = manager.post("/v1/containers", json={"image": test_image, "gpu_memory": "2GiB",
                                                  "command": ["sh", "-c", "sleep 0.5; exit 3"]}).json()
    done = wait_for(lambda: (r := manager.get(f"/v1/containers/{record['id']}").json())["state"] == "exited" and r,
                    5, what="the exit to be reported")
    assert done["exit_code"] == 3
    assert manager.gpu(record["gpus"][0]["uuid"])["memory_reserved"] == 0
    assert any(e["type"] == "exited" and e["container"] == record["id"] for e in manager.events())


def test_concurrent_requests_never_share_bytes(manager, docker_agent, test_image):
    with ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(lambda _: manager.post("/v1/containers", json=sim_job(test_image, "5GiB", 0)),
                                  range(10)))
    codes = sorted(r.status_code for r in responses)
    assert codes == [201] * 8 + [409] * 2, [r.text for r in responses]
    for gpu in manager.node("node-a")["gpus"]:
        assert gpu["memory_reserved"] == 20 * GiB and len(gpu["containers"]) == 4


def test_agent_restart_readopts_its_containers(tmp_path, manager, docker_agent, test_image):
    record = manager.post("/v1/containers", json=sim_job(test_image, "7GiB", GiB)).json()
    docker_agent.stop()
    wait_for(lambda: manager.node("node-a")["state"] == "down", 10, what="node down after missed heartbeats")
    assert manager.post("/v1/containers", json=sim_job(test_image, "1GiB", 0)).status_code == 503
    again = AgentProc(tmp_path, manager, "node-a")
    try:
        assert manager.get(f"/v1/containers/{record['id']}").json()["state"] == "running"
        assert manager.gpu(record["gpus"][0]["uuid"])["memory_reserved"] == 7 * GiB
        kinds = [e["type"] for e in manager.events()]
        assert kinds.count("node_down") == 1 and kinds.count("node_up") == 2
    finally:
        again.stop()


def test_manager_restart_rebuilds_every_grant_from_the_agents(tmp_path, test_image, cleanup_containers):
    first = ManagerProc(tmp_path)
    agent = AgentProc(tmp_path, first, "node-r", gpus="sim:1x16GiB")
    try:
        record = first.post("/v1/containers", json=sim_job(test_image, "12GiB", GiB)).json()
        first.stop()
        second = ManagerProc(tmp_path, api_port=first.api_port, agent_port=first.agent_port)
        try:
            agent.wait_ready()
            adopted = second.get(f"/v1/containers/{record['id']}").json()
            assert adopted["state"] == "running" and adopted["gpu_memory"] == 12 * GiB
            assert adopted["container_id"] == record["container_id"]
            assert second.gpu(record["gpus"][0]["uuid"])["memory_reserved"] == 12 * GiB
            # the rebuilt grant is respected: 12 of 16 GiB are taken
            assert second.post("/v1/containers", json=sim_job(test_image, "5GiB", 0)).status_code == 409
            assert second.delete(f"/v1/containers/{record['id']}").json()["state"] == "removed"
        finally:
            second.stop()
    finally:
        agent.stop()


def test_process_runtime_pins_host_processes(tmp_path, manager):
    agent = AgentProc(tmp_path, manager, "node-p", gpus="sim:1x8GiB", runtime="process")
    usage = tmp_path / "use"
    try:
        record = manager.post("/v1/containers", json={
            "gpu_memory": "2GiB", "env": {"GPUMGR_SIM_USAGE_FILE": str(usage)},
            "command": ["sh", "-c", f"echo {GiB} > {usage}; exec sleep 300"]}).json()
        assert record["state"] == "running", record
        pid = int(record["container_id"])
        environ = dict(e.split("=", 1) for e in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in e)
        uuid = record["gpus"][0]["uuid"]
        assert environ["NVIDIA_VISIBLE_DEVICES"] == uuid and environ["CUDA_VISIBLE_DEVICES"] == uuid
        assert os.getpgid(pid) == pid
        wait_for(lambda: manager.get(f"/v1/containers/{record['id']}").json()["gpu_memory_used"] == GiB, 10,
                 what="process usage")
        assert manager.delete(f"/v1/containers/{record['id']}").json()["state"] == "removed"
        wait_for(lambda: process_gone(pid), 5, what="the process group to be gone")
    finally:
        agent.stop()


@pytest.mark.parametrize("argv, words", [
    (["manager", "--api", "0.0.0.0:0"], "set a non-empty token"),
    (["manager", "--api", "0.0.0.0:0", "--token", ""], "set a non-empty token"),
    (["agent", "--gpus", "sim:banana"], "spec"),
    (["manager", "--config", "/no/such.yaml"], "does not exist"),
])
def test_cli_refuses_bad_settings_clearly(argv, words):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "gpumgr", *argv], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and words in result.stderr, result.stderr


def test_several_agents_place_by_free_memory_across_nodes(tmp_path, manager, test_image, docker_client,
                                                          cleanup_containers):
    small = AgentProc(tmp_path, manager, "node-small", gpus="sim:1x8GiB")
    large = AgentProc(tmp_path, manager, "node-large", gpus="sim:2x24GiB")
    try:
        first = manager.post("/v1/containers", json=sim_job(test_image, "7GiB", 0)).json()
        assert first["node"] == "node-large"  # spread: most free memory
        packed = manager.post("/v1/containers", json=sim_job(test_image, "7GiB", 0, placement="binpack")).json()
        assert packed["node"] == "node-small"  # binpack: least free memory that fits
        pair = manager.post("/v1/containers", json=sim_job(test_image, "10GiB", 0, gpus=2)).json()
        assert pair["node"] == "node-large" and len({g["uuid"] for g in pair["gpus"]}) == 2
        assert manager.post("/v1/containers", json=sim_job(test_image, "2GiB", 0, node="node-small")).status_code == 409
        exact = manager.post("/v1/containers", json=sim_job(test_image, "1GiB", 0, node="node-small")).json()
        assert exact["node"] == "node-small"  # 7 of 8 GiB granted: exactly 1 GiB still fits
    finally:
        small.stop()
        large.stop()
    labels = {c.labels["gpumgr.node"] for c in docker_client.containers.list(filters={"label": "gpumgr.grant"})}
    assert {"node-small", "node-large"} <= labels


def test_a_container_restarted_behind_gpumgr_after_its_exit_is_stopped(manager, docker_agent, docker_client,
                                                                        test_image):
    """``docker restart`` of an exited container once ran it on with no live grant, forever (found by the chaos
    suite): its agent ignored a start of an ended grant's container, and never reported it again."""
    # exits at once the first time; run again, it would run for an hour
    once = "if [ -f /tmp/ran ]; then sleep 3600; fi; touch /tmp/ran"
    body = {"gpu_memory": "1GiB", "image": test_image, "command": ["sh", "-c", once]}
    record = manager.post("/v1/containers", json=body).json()
    wait_for(lambda: manager.get(f"/v1/containers/{record['id']}").json()["state"] == "exited", 20,
             what="the container's exit")
    docker_client.api.restart(record["container_id"], timeout=1)
    running = {"label": f"gpumgr.grant={record['id']}", "status": "running"}
    wait_for(lambda: not docker_client.containers.list(filters=running), 10,
             what="the restarted container to be stopped")
    assert manager.get(f"/v1/containers/{record['id']}").json()["state"] == "exited"
    assert docker_client.containers.list(all=True, filters={"label": f"gpumgr.grant={record['id']}"})  # kept
