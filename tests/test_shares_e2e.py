"""Compute shares end to end (issue 36): a real manager, agents and engine, simulated GPUs.

One node runs with ``mps: true`` (one 24 GiB GPU, its MPS pipe directory a temporary folder, and a node
policy that forbids host IPC), one without. A share request goes only to the MPS node, at most 100
percent per GPU: a second share of 60 waits in the queue and runs once the first is deleted. The
container gets its percentage, the pipe directory and the host's IPC namespace (read back with docker
inspect) although the node's policy forbids host IPC to requests; a restarted manager re-adopts the share.
"""

from __future__ import annotations

import pytest
import yaml

from gpumgr.plugin import docker_gpu
from tests.invariant import settles
from tests.procs import AgentProc, ManagerProc, wait_for

pytestmark = pytest.mark.docker
MPS, PLAIN = "s36-mps", "s36-plain"
SHARE_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"


def job(image: str, memory: str = "4GiB", **extra) -> dict:
    # SIGKILL: busybox's sleep as PID 1 ignores SIGTERM, and each removal would wait out the stop grace
    return {"image": image, "gpu_memory": memory, "command": ["sleep", "300"], "stop_signal": "SIGKILL", **extra}


def mps_agent(tmp_path, manager: ManagerProc) -> AgentProc:
    pipes = tmp_path / "nvidia-mps"
    pipes.mkdir()
    config = tmp_path / "mps-agent.yaml"
    config.write_text(yaml.safe_dump({"mps": True, "mps_pipe_directory": str(pipes), "policy": {"host_ipc": False}}))
    return AgentProc(tmp_path, manager, MPS, gpus="sim:1x24GiB", extra=["--config", str(config)])


def env_of(docker_client, container_id: str) -> dict[str, str]:
    attrs = docker_client.api.inspect_container(container_id)
    return dict(item.split("=", 1) for item in attrs["Config"]["Env"])


def gpu_of(manager: ManagerProc, node: str) -> dict:
    found = manager.node(node)
    assert found is not None
    return found["gpus"][0]


def test_shares_fill_an_mps_gpu_to_100_and_the_next_waits(tmp_path, manager, docker_client, test_image,
                                                           cleanup_containers, capsys):
    plain = AgentProc(tmp_path, manager, PLAIN, gpus="sim:1x24GiB")
    agents = [plain]
    try:
        # no MPS node on the map: a share can never be placed, queue or not
        never = manager.post("/v1/containers", json=job(test_image, compute_share=25, queue=True))
        assert never.status_code == 409 and never.json()["error"]["code"] == "never_fits", never.text
        assert "mps: true" in never.json()["error"]["message"]
        agents.append(mps_agent(tmp_path, manager))
        nodes = {n["name"]: n for n in manager.get("/v1/nodes").json()["nodes"]}
        assert nodes[MPS]["mps"] and nodes[MPS]["gpus"][0]["mps"] and not nodes[PLAIN]["gpus"][0]["mps"]
        assert nodes[MPS]["gpus"][0]["compute_shares"] == 0

        first = manager.post("/v1/containers", json=job(test_image, compute_share=60))
        assert first.status_code == 201, first.text
        first = first.json()
        assert first["node"] == MPS and first["compute_share"] == 60
        assert gpu_of(manager, MPS)["compute_shares"] == 60
        attrs = docker_client.api.inspect_container(first["container_id"])
        env = env_of(docker_client, first["container_id"])
        pipes = str(tmp_path / "nvidia-mps")
        assert env[SHARE_ENV] == "60" and env["CUDA_MPS_PIPE_DIRECTORY"] == pipes
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M"
        assert attrs["HostConfig"]["IpcMode"] == "host"  # the node's own addition, though its policy forbids it
        assert any(m["Type"] == "bind" and m["Source"] == pipes and m["Destination"] == pipes and m["RW"]
                   for m in attrs["Mounts"])
        assert attrs["Config"]["Labels"]["gpumgr.compute_share"] == "60"
        # a request may still not ask for host IPC itself where the node's policy forbids it
        asked = manager.post("/v1/containers", json=job(test_image, node=MPS, ipc_mode="host"))
        assert asked.status_code == 403 and "host_ipc" in asked.text, asked.text

        # without a share a request takes what is left: no percentage, nothing counted against the 100
        unshared = manager.post("/v1/containers", json=job(test_image, node=MPS)).json()
        assert unshared["state"] == "running" and unshared["compute_share"] == 0
        assert SHARE_ENV not in env_of(docker_client, unshared["container_id"])
        assert gpu_of(manager, MPS)["compute_shares"] == 60

        # 60 + 60 > 100: not now (memory is free: the share is what is missing), or wait in the queue
        refused = manager.post("/v1/containers", json=job(test_image, compute_share=60))
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "no_fit", refused.text
        assert "compute_share of 60%" in refused.json()["error"]["message"]
        waiting = manager.post("/v1/containers", json=job(test_image, compute_share=60, queue=True))
        assert waiting.status_code == 202 and waiting.json()["state"] == "queued", waiting.text
        fits = manager.post("/v1/containers", json=job(test_image, compute_share=40, queue=True))
        assert fits.status_code == 202, "nothing jumps the line: a share that fits waits behind the head"
        settles(manager, docker_client, {MPS, PLAIN})

        assert manager.delete(f"/v1/containers/{first['id']}").status_code in (200, 202)
        second = wait_for(lambda: (r := manager.get(f"/v1/containers/{waiting.json()['id']}").json())["state"]
                          == "running" and r, 30, what="the queued share to run")
        assert second["node"] == MPS and env_of(docker_client, second["container_id"])[SHARE_ENV] == "60"
        third = wait_for(lambda: (r := manager.get(f"/v1/containers/{fits.json()['id']}").json())["state"]
                         == "running" and r, 30, what="the share of 40 to run after it")
        assert third["node"] == MPS and gpu_of(manager, MPS)["compute_shares"] == 100
        gauges = [line for line in manager.get("/metrics").text.splitlines()
                  if line.startswith("gpumgr_gpu_compute_shares_percent{")]
        assert len(gauges) == 1 and MPS in gauges[0] and float(gauges[0].rsplit(" ", 1)[1]) == 100  # MPS GPUs only
        settles(manager, docker_client, {MPS, PLAIN})

        # gpu.mps picks nodes by whether they run MPS
        on_plain = manager.post("/v1/containers", json=job(test_image, constraints=["gpu.mps==false"])).json()
        on_mps = manager.post("/v1/containers", json=job(test_image, constraints=["gpu.mps!=false"])).json()
        assert (on_plain["node"], on_mps["node"]) == (PLAIN, MPS)

        # a restarted manager re-adopts the shares from the containers' labels
        manager.stop()
        again = ManagerProc(tmp_path, api_port=manager.api_port, agent_port=manager.agent_port)
        try:
            for agent in agents:
                agent.manager = again
                agent.wait_ready()
            assert again.get(f"/v1/containers/{second['id']}").json()["compute_share"] == 60
            assert gpu_of(again, MPS)["compute_shares"] == 100
            over = again.post("/v1/containers", json=job(test_image, compute_share=1))
            assert over.status_code == 409, over.text

            # docker gpu run --compute-share, and the SHARE column of docker gpu stats
            assert again.delete(f"/v1/containers/{third['id']}").status_code in (200, 202)
            status = docker_gpu.main(["gpu", "--manager", again.url, "run", "-d", "--compute-share", "25",
                                      "--gpu-memory", "1GiB", "--stop-signal", "SIGKILL", test_image, "sleep", "300"])
            assert status == 0, capsys.readouterr().err
            ran = again.get("/v1/containers", params={"state": "running"}).json()["containers"]
            by_share = {r["compute_share"]: r for r in ran if r["node"] == MPS}
            assert env_of(docker_client, by_share[25]["container_id"])[SHARE_ENV] == "25"
            capsys.readouterr()
            assert docker_gpu.main(["gpu", "--manager", again.url, "stats", "--no-stream"]) == 0
            shown = capsys.readouterr().out
            assert " 25% " in shown and " 60% " in shown, shown
            settles(again, docker_client, {MPS, PLAIN})
        finally:
            again.stop()
    finally:
        for agent in agents:
            agent.stop()


def test_bad_shares_are_400_and_shares_are_refused_in_gangs_and_a_requests_own_env(manager):
    for value in (0, 101, -5, "25", True, 2.5):  # 0 too: leave compute_share out (or null) for no share
        response = manager.post("/v1/containers", json={"gpu_memory": "1GiB", "compute_share": value})
        assert response.status_code == 400 and "compute_share" in response.json()["error"]["message"], response.text
    unset = manager.post("/v1/containers", json={"gpu_memory": "1GiB", "compute_share": None})
    assert unset.status_code == 503, unset.text  # null is no share: valid, and no agent is ready
    gang = manager.post("/v1/gangs", json={"gpu_memory": "1GiB", "replicas": 2, "compute_share": 10})
    assert gang.status_code == 400 and "not offered for gangs" in gang.json()["error"]["message"], gang.text
    own = manager.post("/v1/containers", json={"gpu_memory": "1GiB", "env": {SHARE_ENV: "100"}})
    assert own.status_code == 400 and SHARE_ENV in own.json()["error"]["message"], own.text
