"""Enforcement end to end: real Docker containers and host processes on simulated GPUs."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.procs import AgentProc, process_gone, wait_for

GiB = 1 << 30
USAGE = "/tmp/use"


def job(image: str, memory: str, use: int, **extra) -> dict:
    return {"image": image, "gpu_memory": memory, "env": {"GPUMGR_SIM_USAGE_FILE": USAGE},
            "command": ["sh", "-c", f"echo {use} > {USAGE}; exec sleep 300"], **extra}


def set_usage(docker_client, record: dict, use: int | str, path: str = USAGE) -> None:
    docker_client.containers.get(record["container_id"]).exec_run(["sh", "-c", f"echo {use} > {path}"])


def state_of(manager, record: dict) -> dict:
    return manager.get(f"/v1/containers/{record['id']}").json()


@pytest.fixture
def one_gpu_agent(tmp_path, manager, test_image, cleanup_containers):
    proc = AgentProc(tmp_path, manager, "node-e", gpus="sim:1x24GiB")
    yield proc
    proc.stop()


def test_overrun_kills_only_the_offender_and_frees_its_grant(manager, one_gpu_agent, docker_client, test_image):
    greedy = manager.post("/v1/containers", json=job(test_image, "8GiB", GiB)).json()
    neighbour = manager.post("/v1/containers", json=job(test_image, "8GiB", 6 * GiB)).json()
    assert greedy["gpus"] == neighbour["gpus"]
    wait_for(lambda: state_of(manager, greedy)["gpu_memory_used"] == GiB, 10, what="usage seen")

    set_usage(docker_client, greedy, 9 * GiB)
    killed = wait_for(lambda: (r := state_of(manager, greedy))["state"] == "killed" and r, 10, what="the kill")
    assert killed["reason"] == "gpu_memory_exceeded"
    overrun = killed["detail"]["overrun"]
    assert overrun["observed"] == 9 * GiB and overrun["grant_bytes"] == 8 * GiB
    assert overrun["gpu"] == greedy["gpus"][0]["uuid"] and overrun["action"] == "kill" and overrun["at"] > 0
    wait_for(lambda: not docker_client.containers.get(greedy["container_id"]).attrs["State"]["Running"]
             or docker_client.containers.get(greedy["container_id"]).reload(), 5, what="container stopped")
    assert not docker_client.containers.get(greedy["container_id"]).attrs["State"]["Running"]

    gpu = manager.gpu(greedy["gpus"][0]["uuid"])
    assert gpu["memory_reserved"] == 8 * GiB and gpu["containers"] == [neighbour["id"]]
    assert state_of(manager, neighbour)["state"] == "running"
    assert docker_client.containers.get(neighbour["container_id"]).attrs["State"]["Running"]
    events = [e for e in manager.events("killed") if e["container"] == greedy["id"]]
    assert len(events) == 1 and events[0]["reason"] == "gpu_memory_exceeded" and events[0]["observed"] == 9 * GiB


def test_usage_just_under_the_grant_is_never_killed(manager, one_gpu_agent, docker_client, test_image):
    record = manager.post("/v1/containers", json=job(test_image, "4GiB", GiB)).json()
    deadline = time.monotonic() + 8
    step = 0
    while time.monotonic() < deadline:  # move around just under the grant, touching it exactly
        set_usage(docker_client, record, 4 * GiB - (step % 3) * 1024 if step % 5 else 4 * GiB)
        step += 1
        time.sleep(0.2)
    assert state_of(manager, record)["state"] == "running"
    assert state_of(manager, record)["gpu_memory_used"] <= 4 * GiB
    assert not [e for e in manager.events() if e["type"] in ("killed", "overrun")]


def test_stop_policy_terminates_gracefully(manager, one_gpu_agent, docker_client, test_image):
    body = job(test_image, "2GiB", 0, on_overrun="stop")
    body["command"] = ["sh", "-c", f"trap 'echo 0 > {USAGE}; exit 7' TERM; echo 0 > {USAGE}; "
                                   "while true; do sleep 0.1; done"]
    record = manager.post("/v1/containers", json=body).json()
    set_usage(docker_client, record, 3 * GiB)
    done = wait_for(lambda: (r := state_of(manager, record))["state"] == "killed" and r["exit_code"] is not None
                    and r, 15, what="the graceful stop")
    assert done["exit_code"] == 7  # it ran its TERM handler: a stop, not a kill
    assert done["detail"]["overrun"]["action"] == "stop"


def test_report_policy_only_records(manager, one_gpu_agent, docker_client, test_image):
    record = manager.post("/v1/containers", json=job(test_image, "2GiB", 0, on_overrun="report")).json()
    set_usage(docker_client, record, 3 * GiB)
    event = wait_for(lambda: [e for e in manager.events("overrun") if e["container"] == record["id"]], 10,
                     what="the overrun event")[0]
    assert event["observed"] == 3 * GiB and event["action"] == "report"
    time.sleep(1.5)
    current = state_of(manager, record)
    assert current["state"] == "running" and current["detail"]["overrun"]["observed"] == 3 * GiB
    assert docker_client.containers.get(record["container_id"]).attrs["State"]["Running"]
    assert len([e for e in manager.events("overrun") if e["container"] == record["id"]]) == 1


def test_using_a_gpu_that_was_not_granted_is_killed(tmp_path, manager, docker_client, test_image, cleanup_containers):
    agent = AgentProc(tmp_path, manager, "node-two", gpus="sim:2x24GiB")
    try:
        gpus = [g["uuid"] for g in manager.node("node-two")["gpus"]]
        record = manager.post("/v1/containers", json=job(test_image, "2GiB", 0, node="node-two")).json()
        other = next(u for u in gpus if u != record["gpus"][0]["uuid"])
        docker_client.containers.get(record["container_id"]).exec_run(
            ["sh", "-c", f"echo {GiB} > /tmp/other; exec sleep 300"], detach=True,
            environment={"NVIDIA_VISIBLE_DEVICES": other, "GPUMGR_SIM_USAGE_FILE": "/tmp/other"})
        killed = wait_for(lambda: (r := state_of(manager, record))["state"] == "killed" and r, 10, what="the kill")
        assert killed["reason"] == "gpu_not_granted" and killed["detail"]["overrun"]["gpu"] == other
    finally:
        agent.stop()


def test_unmanaged_processes_are_never_killed_and_not_schedulable(tmp_path, manager, one_gpu_agent):
    usage = tmp_path / "stranger"
    usage.write_text(str(10 * GiB))
    uuid = manager.node("node-e")["gpus"][0]["uuid"]
    stranger = subprocess.Popen(["sleep", "60"], env={"GPUMGR_SIM_USAGE_FILE": str(usage),
                                                      "NVIDIA_VISIBLE_DEVICES": uuid, "PATH": "/usr/bin:/bin"})
    try:
        gpu = wait_for(lambda: (g := manager.gpu(uuid))["memory_unmanaged"] == 10 * GiB and g, 10, what="unmanaged")
        assert gpu["memory_free"] == 14 * GiB
        assert manager.post("/v1/containers", json={"image": "x", "gpu_memory": "15GiB"}).status_code == 409
        time.sleep(1.5)
        assert stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()


def test_process_runtime_is_enforced_the_same_way(tmp_path, manager):
    agent = AgentProc(tmp_path, manager, "node-proc", gpus="sim:1x8GiB", runtime="process")
    usage = tmp_path / "use"
    try:
        record = manager.post("/v1/containers", json={
            "gpu_memory": "1GiB", "env": {"GPUMGR_SIM_USAGE_FILE": str(usage)},
            "command": ["sh", "-c", f"echo 0 > {usage}; sleep 300 & wait"]}).json()
        pid = int(record["container_id"])
        usage.write_text(str(2 * GiB))
        killed = wait_for(lambda: (r := state_of(manager, record))["state"] == "killed" and r, 10, what="the kill")
        assert killed["reason"] == "gpu_memory_exceeded" and killed["detail"]["overrun"]["observed"] == 2 * GiB
        wait_for(lambda: process_gone(pid), 5, what="the process group to be gone")
        assert manager.gpu(record["gpus"][0]["uuid"])["memory_reserved"] == 0
    finally:
        agent.stop()


@pytest.mark.gpu
def test_real_cuda_process_past_its_grant_is_killed(tmp_path, manager):
    """On a real NVIDIA GPU: PyTorch allocates past its grant under the process runtime and NVML."""
    from gpumgr.agent.gpus.select import open_source
    from gpumgr.agent.gpus.source import NvmlUnavailable

    try:
        open_source("nvml", "probe").close()
    except NvmlUnavailable as exc:
        if __import__("os").environ.get("GPUMGR_REQUIRE_GPU") == "1":
            pytest.fail(f"no NVIDIA GPU answers ({exc}), and GPUMGR_REQUIRE_GPU=1 forbids skipping")
        pytest.skip(f"no NVIDIA GPU answers ({exc})")
    pytest.importorskip("torch")
    script = tmp_path / "grow.py"
    script.write_text(
        "import time, torch\n"
        "blocks = [torch.empty(256 << 20, dtype=torch.uint8, device='cuda')]\n"
        "time.sleep(3)\n"
        "while True:\n"
        "    blocks.append(torch.empty(256 << 20, dtype=torch.uint8, device='cuda'))\n"
        "    time.sleep(0.05)\n"
    )
    agent = AgentProc(tmp_path, manager, "node-gpu", gpus="nvml", runtime="process")
    try:
        record = manager.post("/v1/containers", json={"gpu_memory": "2GiB",
                                                      "command": [sys.executable, str(script)]}).json()
        assert record["state"] == "running", record
        killed = wait_for(lambda: (r := state_of(manager, record))["state"] == "killed" and r, 60, what="the kill")
        assert killed["reason"] == "gpu_memory_exceeded"
        assert killed["detail"]["overrun"]["observed"] > 2 * GiB
    finally:
        agent.stop()
