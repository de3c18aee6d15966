"""Docker Swarm on a real one-node swarm: `docker gpu service ...` gives every replica its own grant."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.images import busybox_tar
from tests.procs import AgentProc, ManagerProc, wait_for
from tests.swarm import SwarmEngine

GiB = 1 << 30
IMAGE = "gpumgr-test/busybox:latest"
SERVICE = "infer"


@pytest.fixture(scope="module")
def engine(docker_client):
    if shutil.which("dockerd") is None:
        pytest.fail("dockerd is needed for the swarm tests")
    busybox = shutil.which("busybox") or "/bin/busybox"
    swarm = SwarmEngine(busybox_tar(busybox))
    yield swarm
    swarm.stop()


@pytest.fixture(scope="module")
def cluster(engine, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("swarm")
    manager = ManagerProc(tmp)
    agent = AgentProc(tmp, manager, "swarm-node", gpus="sim:2x13GiB",
                      env={"DOCKER_HOST": engine.env["DOCKER_HOST"], "GPUMGR_HOOK_SOCKET": engine.hook_socket})
    yield manager, agent
    agent.stop()
    manager.stop()


def docker_gpu(engine: SwarmEngine, manager: ManagerProc, *args: str) -> subprocess.CompletedProcess:
    return engine.docker("gpu", "--manager", manager.url, *args, check=False)


def live_grants(manager: ManagerProc) -> list[dict]:
    records = manager.get("/v1/containers", params={"service": SERVICE}).json()["containers"]
    return [r for r in records if r["state"] in ("creating", "running")]


def grants_match_tasks(engine: SwarmEngine, manager: ManagerProc, expected: int) -> bool:
    """Exactly one live grant per running task container, and ``expected`` of them."""
    running = {c["Id"] for c in engine.containers(SERVICE) if c["State"]["Running"]}
    grants = live_grants(manager)
    return len(running) == expected and {g["container_id"] for g in grants} == running and all(
        g["state"] == "running" for g in grants)


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode()
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


def test_install_says_the_engine_must_reload(engine):
    assert "must reload" in engine.install_output and "systemctl reload docker" in engine.install_output
    assert engine.docker("info", "--format", "{{.DefaultRuntime}}").stdout.strip() == "gpumgr"
    metadata = engine.docker("gpu", "--help").stdout
    assert "service create" in metadata


def test_bad_requests_create_nothing(engine, cluster):
    manager, _ = cluster
    bad = docker_gpu(engine, manager, "service", "create", "--gpu-memory", "lots", "--name", "bad", IMAGE, "true")
    assert bad.returncode == 1 and "invalid --gpu-memory" in bad.stderr
    huge = docker_gpu(engine, manager, "service", "create", "--gpu-memory", "100GiB", "--name", "bad", IMAGE)
    assert huge.returncode == 1 and "largest that could ever hold this is 13GiB" in huge.stderr
    gone = engine.docker("gpu", "--manager", "http://127.0.0.1:1", "service", "create", "--gpu-memory", "1GiB",
                         "--name", "bad", IMAGE, check=False)
    assert gone.returncode == 1 and "cannot reach the gpumgr manager" in gone.stderr
    assert "bad" not in engine.docker("service", "ls", "--format", "{{.Name}}").stdout.split()


def test_replicas_get_exact_grants_through_their_whole_life(engine, cluster):
    manager, _ = cluster
    created = docker_gpu(engine, manager, "service", "create", "--detach", "--gpu-memory", "6GiB", "--replicas", "3",
                         "--name", SERVICE, "--stop-grace-period", "1s", "--env", "GPUMGR_SIM_USAGE_FILE=/tmp/use",
                         IMAGE, "sh", "-c", f"echo {GiB} > /tmp/use; exec sleep 3600")
    assert created.returncode == 0, created.stderr
    try:
        _three_pinned_replicas(engine, manager)
        _scaling_past_capacity_starts_only_what_fits(engine, manager)
        _scaling_down_frees_grants(engine, manager)
        _a_killed_task_is_replaced_with_exact_grants(engine, manager)
        _an_overrunning_replica_is_killed_and_replaced(engine, manager)
    finally:
        removed = docker_gpu(engine, manager, "service", "rm", SERVICE)
    assert removed.returncode == 0
    wait_for(lambda: not live_grants(manager), 30, what="every grant to be freed after rm")
    assert all(g["memory_reserved"] == 0 for g in manager.node("swarm-node")["gpus"])


def _three_pinned_replicas(engine, manager):
    wait_for(lambda: grants_match_tasks(engine, manager, 3), 60, what="3 running replicas with 3 grants")
    gpus = {g["uuid"] for g in manager.node("swarm-node")["gpus"]}
    for container in engine.containers(SERVICE):
        env = environ(container["State"]["Pid"])
        assert env["NVIDIA_VISIBLE_DEVICES"] in gpus and env["GPUMGR_GPU_MEMORY"] == str(6 * GiB)
        assert env["GPUMGR_GRANT"] in {g["id"] for g in live_grants(manager)}
    reserved = sorted(g["memory_reserved"] for g in manager.node("swarm-node")["gpus"])
    assert reserved == [6 * GiB, 12 * GiB]
    wait_for(lambda: all(g["gpu_memory_used"] == GiB for g in live_grants(manager)), 10, what="usage per replica")
    table = docker_gpu(engine, manager, "service", "ps", SERVICE).stdout
    assert table.count("6GiB") == 3 and table.count("1GiB") == 3, table


def _scaling_past_capacity_starts_only_what_fits(engine, manager):
    engine.docker("service", "scale", "--detach", f"{SERVICE}=6")
    wait_for(lambda: grants_match_tasks(engine, manager, 4), 60, what="4 of 6 replicas running (2 per GPU)")
    table = wait_for(lambda: (t := docker_gpu(engine, manager, "service", "ps", SERVICE).stdout).count(
        "no GPU") >= 1 and t, 60, what="the waiting replicas to say why")
    assert "can hold 6GiB" in table, table
    assert sorted(g["memory_reserved"] for g in manager.node("swarm-node")["gpus"]) == [12 * GiB, 12 * GiB]


def _scaling_down_frees_grants(engine, manager):
    engine.docker("service", "scale", "--detach", f"{SERVICE}=2")
    wait_for(lambda: grants_match_tasks(engine, manager, 2), 60, what="2 replicas and 2 grants")
    assert sum(g["memory_reserved"] for g in manager.node("swarm-node")["gpus"]) == 12 * GiB


def _a_killed_task_is_replaced_with_exact_grants(engine, manager):
    victim = engine.containers(SERVICE)[0]["Id"]
    engine.docker("kill", victim)
    wait_for(lambda: grants_match_tasks(engine, manager, 2) and victim not in
             {c["Id"] for c in engine.containers(SERVICE)}, 60, what="swarm to replace the killed task")
    assert sum(g["memory_reserved"] for g in manager.node("swarm-node")["gpus"]) == 12 * GiB


def _an_overrunning_replica_is_killed_and_replaced(engine, manager):
    target = engine.containers(SERVICE)[0]
    Path(f"/proc/{target['State']['Pid']}/root/tmp/use").write_text(str(7 * GiB))
    record = wait_for(lambda: next((r for r in manager.get("/v1/containers", params={"service": SERVICE}).json()[
        "containers"] if r["container_id"] == target["Id"] and r["state"] == "killed"), None), 15,
        what="the overrunning replica to be killed")
    assert record["reason"] == "gpu_memory_exceeded" and record["detail"]["overrun"]["observed"] == 7 * GiB
    wait_for(lambda: grants_match_tasks(engine, manager, 2) and target["Id"] not in
             {c["Id"] for c in engine.containers(SERVICE)}, 60, what="swarm to replace the killed replica")


def test_a_replica_that_must_wait_is_pending_in_the_queue_not_a_failed_task_loop(engine, cluster):
    """Issue "Tenants and a priority queue": ``--queue`` makes a replica wait for room, shown as pending."""
    manager, _ = cluster
    hog = docker_gpu(engine, manager, "service", "create", "--detach", "--gpu-memory", "12GiB", "--replicas", "2",
                     "--name", "hog", "--stop-grace-period", "1s", IMAGE, "sleep", "3600")
    assert hog.returncode == 0, hog.stderr
    try:
        wait_for(lambda: sum(g["memory_reserved"] for g in manager.node("swarm-node")["gpus"]) == 24 * GiB, 60,
                 what="both GPUs held by the hog")
        waiter = docker_gpu(engine, manager, "service", "create", "--detach", "--gpu-memory", "6GiB", "--queue",
                            "--priority", "7", "--preemptible", "--name", "waiter", "--stop-grace-period", "1s",
                            IMAGE, "sleep", "3600")
        assert waiter.returncode == 0, waiter.stderr

        def queued() -> dict | None:
            records = manager.get("/v1/containers", params={"service": "waiter"}).json()["containers"]
            return next((r for r in records if r["state"] == "queued"), None)

        record = wait_for(queued, 60, what="the replica's request to wait in the queue")
        assert record["priority"] == 7 and record["preemptible"] and record["queue"]["position"] == 1
        table = wait_for(lambda: (t := docker_gpu(engine, manager, "service", "ps", "waiter").stdout).count(
            "Pending (queued for room)") == 1 and t, 30, what="the replica shown as pending")
        assert "queued at position 1" in table, table
        time.sleep(3.0)  # no failed-task loop: still one task, still the same request
        tasks = engine.docker("service", "ps", "--format", "{{.ID}}", "waiter").stdout.split()
        assert len(tasks) == 1, tasks
        assert queued() is not None and queued()["id"] == record["id"]
        engine.docker("service", "scale", "--detach", "hog=1")
        running = wait_for(lambda: next((r for r in manager.get("/v1/containers", params={"service": "waiter"}).json()[
            "containers"] if r["state"] == "running"), None), 60, what="the waiting replica to run once room freed")
        assert running["id"] == record["id"] and running["gpu_memory"] == 6 * GiB
        container = next(c for c in engine.containers("waiter") if c["State"]["Running"])
        assert environ(container["State"]["Pid"])["GPUMGR_GRANT"] == record["id"]
    finally:
        docker_gpu(engine, manager, "service", "rm", "hog", "waiter")
    wait_for(lambda: all(g["memory_reserved"] == 0 for g in manager.node("swarm-node")["gpus"]), 30,
             what="every grant freed after rm")


def test_a_plain_docker_run_through_the_hook_is_confirmed_running(engine, cluster):
    """Issue item 4: a hook grant of a plain ``docker run`` became ``running``, not ``creating`` for life."""
    manager, _ = cluster
    cid = engine.docker("run", "-d", "--network", "none", "-e", "GPUMGR_REQUEST_MEMORY=1GiB", IMAGE,
                        "sleep", "300").stdout.strip()
    try:
        record = wait_for(lambda: next((r for r in manager.get("/v1/containers").json()["containers"]
                                        if r["container_id"] == cid and r["state"] == "running"), None), 15,
                          what="the hook grant confirmed running")
        assert record["gpu_memory"] == GiB and record["confirm_by"] is None
    finally:
        engine.docker("rm", "-f", cid, check=False)
    wait_for(lambda: manager.get(f"/v1/containers/{record['id']}").json()["state"] not in ("creating", "running"),
             15, what="the grant freed after docker rm")


def test_a_hook_grant_whose_container_never_starts_is_released(engine, cluster):
    """Issue item 4: a container that never started (bad command) kept its hook grant ``creating`` forever."""
    manager, _ = cluster
    failed = engine.docker("run", "-d", "--network", "none", "-e", "GPUMGR_REQUEST_MEMORY=2GiB", IMAGE,
                           "/no/such/binary", check=False)
    assert failed.returncode != 0
    wait_for(lambda: all(g["memory_reserved"] == 0 for g in manager.node("swarm-node")["gpus"]), 40,
             what="the grant of the container that never started to be released")
    ended = [r for r in manager.get("/v1/containers").json()["containers"] if r["gpu_memory"] == 2 * GiB]
    assert ended and all(r["state"] not in ("creating", "running") and r["reason"] for r in ended), ended
    engine.docker("container", "prune", "-f", check=False)


def test_an_image_asking_for_memory_does_not_get_a_second_grant(engine, cluster):
    """Review finding: a REST container whose image sets GPUMGR_REQUEST_MEMORY got a second grant from the hook."""
    manager, _ = cluster
    busybox = shutil.which("busybox") or "/bin/busybox"
    subprocess.run(["docker", "import", "--change", "ENV GPUMGR_REQUEST_MEMORY=3GiB", "-", "gpumgr-test/asks:1"],
                   input=busybox_tar(busybox), env=engine.env, check=True, capture_output=True)
    response = manager.post("/v1/containers", json={"image": "gpumgr-test/asks:1", "gpu_memory": "2GiB",
                                                    "command": ["sleep", "300"]})
    assert response.status_code == 201, response.text
    record = response.json()
    try:
        live = [r for r in manager.get("/v1/containers").json()["containers"] if r["state"] in ("creating", "running")]
        assert [r["id"] for r in live] == [record["id"]]
        assert sum(g["memory_reserved"] for g in manager.node("swarm-node")["gpus"]) == 2 * GiB
        env = environ(engine.docker("inspect", "--format", "{{.State.Pid}}", record["container_id"]).stdout.strip()
                      and int(engine.docker("inspect", "--format", "{{.State.Pid}}", record["container_id"])
                              .stdout.strip()))
        assert env["GPUMGR_GRANT"] == record["id"] and env["NVIDIA_VISIBLE_DEVICES"] == record["gpus"][0]["uuid"]
    finally:
        manager.delete(f"/v1/containers/{record['id']}")


# --- constraints (issue 23) ----------------------------------------------------------------------
def test_the_agent_labels_its_swarm_node_with_its_gpus(engine, cluster):
    labels = wait_for(lambda: (found := json.loads(engine.docker("node", "inspect", "self", "--format",
                                                                  "{{json .Spec.Labels}}").stdout) or {})
                      .get("gpumgr.gpu.model") and found, 20, what="the agent's labels on its Swarm node")
    assert labels["gpumgr.gpu.model"] == "Simulated GPU" and labels["gpumgr.gpu.count"] == "2"
    assert labels["gpumgr.gpu.memory"] == str(13 * GiB)


def test_gpu_constraints_pick_the_gpu_and_a_task_that_violates_them_is_refused(engine, cluster):
    manager, _ = cluster
    none = docker_gpu(engine, manager, "service", "create", "--gpu-memory", "1GiB", "--constraint",
                      "gpu.model==*H100*", "--name", "p23-none", IMAGE, "sleep", "60")
    assert none.returncode == 1 and "gpu.model==*H100*" in none.stderr, none.stderr
    bad = docker_gpu(engine, manager, "service", "create", "--gpu-memory", "1GiB", "--constraint", "gpu.index>>1",
                     "--name", "p23-bad", IMAGE, "sleep", "60")
    assert bad.returncode == 1 and "gpu.index>>1" in bad.stderr
    created = docker_gpu(engine, manager, "service", "create", "--detach", "--gpu-memory", "1GiB", "--replicas", "2",
                         "--constraint", "gpu.index==1", "--constraint", "gpu.model==Simulated GPU",
                         "--constraint", "node.labels.gpumgr.gpu.count==2", "--name", "p23-one",
                         "--stop-grace-period", "1s", IMAGE, "sleep", "3600")
    assert created.returncode == 0, created.stderr
    try:
        spec = json.loads(engine.docker("service", "inspect", "p23-one").stdout)[0]["Spec"]["TaskTemplate"]
        assert set(spec["Placement"]["Constraints"]) == {"node.labels.gpumgr.gpu.count==2",
                                                         "node.labels.gpumgr.gpu.model==Simulated GPU"}
        gpu_one = manager.node("swarm-node")["gpus"][1]["uuid"]
        grants = wait_for(lambda: len(g := [r for r in manager.get("/v1/containers", params={"service": "p23-one"})
                                            .json()["containers"] if r["state"] == "running"]) == 2 and g, 60,
                          what="two running replicas")
        assert all(r["gpus"][0]["uuid"] == gpu_one and r["constraints"] == ["gpu.index==1", "gpu.model==Simulated GPU"]
                   for r in grants)
    finally:
        docker_gpu(engine, manager, "service", "rm", "p23-one")
    live = lambda: [r for r in manager.get("/v1/containers").json()["containers"]  # noqa: E731
                    if r["state"] in ("running", "creating")]
    wait_for(lambda: not live(), 30, what="the replicas' grants to end")
    # a task built without docker gpu's check, whose gpu.* constraint this node cannot meet: the hook refuses it
    engine.docker("service", "create", "--detach", "--name", "p23-refused", "--env", f"GPUMGR_REQUEST_MEMORY={GiB}",
                  "--env", 'GPUMGR_REQUEST_CONSTRAINTS=["gpu.index==5"]', IMAGE, "sleep", "60")
    try:
        error = wait_for(lambda: next((t["Error"] for t in map(json.loads, engine.docker(
            "service", "ps", "--no-trunc", "--format", "{{json .}}", "p23-refused").stdout.splitlines())
            if t.get("Error")), None), 60, what="the task to be refused")
        assert "gpu.index==5" in error, error
        assert not live()
    finally:
        engine.docker("service", "rm", "p23-refused", check=False)


def test_swarm_tasks_are_readopted_after_an_agent_restart(engine, cluster, tmp_path):
    """Issue item 6: Swarm task containers were not re-adopted after an agent restart (last: it stops the agent)."""
    manager, agent = cluster
    created = docker_gpu(engine, manager, "service", "create", "--detach", "--gpu-memory", "4GiB", "--replicas", "2",
                         "--name", "again", "--stop-grace-period", "1s", IMAGE, "sleep", "3600")
    assert created.returncode == 0, created.stderr
    again = None
    try:
        grants = wait_for(lambda: (g := [r for r in manager.get("/v1/containers", params={"service": "again"}).json()[
            "containers"] if r["state"] == "running"]) and len(g) == 2 and g, 60, what="2 running replicas")
        agent.stop()
        again = AgentProc(tmp_path, manager, "swarm-node", gpus="sim:2x13GiB", state_dir=agent.state_dir, join=False,
                          env={"DOCKER_HOST": engine.env["DOCKER_HOST"], "GPUMGR_HOOK_SOCKET": engine.hook_socket})
        after = {r["id"]: r for r in manager.get("/v1/containers", params={"service": "again"}).json()["containers"]}
        for grant in grants:  # the same grants, still running, on the same containers
            assert after[grant["id"]]["state"] == "running"
            assert after[grant["id"]]["container_id"] == grant["container_id"]
        assert sum(g["memory_reserved"] for g in manager.node("swarm-node")["gpus"]) == 8 * GiB
        assert "not adopted" not in " ".join(e["message"] for e in manager.events())
    finally:
        docker_gpu(engine, manager, "service", "rm", "again")
        wait_for(lambda: all(g["memory_reserved"] == 0 for g in manager.node("swarm-node")["gpus"]), 30,
                 what="every grant freed after rm")
        if again is not None:
            again.stop()

