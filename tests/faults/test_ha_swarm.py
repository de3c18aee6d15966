"""A Swarm service whose replicas are being created while the leading manager is killed (issue 21).

Every replica's container asks the agent's runtime hook for its grant as the engine creates it, and
the agent asks the leader. Killing the leader with -9 while the replicas start must leave each one
either running with its grant, adopted by the next leader, or failed once (its hook refused, no
container runs) and started again by Swarm with a grant from the next leader: never running without
one, and never two grants for one container. Real parts: a throw-away engine in swarm mode with the
gpumgr runtime installed (``tests/swarm.py``), a three-member etcd, three managers, one agent given
all three; only the GPUs are simulated; loopback only. It ends with the invariant on the new leader.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import pytest

from tests.etcd import EtcdCluster
from tests.ha_procs import HaManager, HaManagers
from tests.images import busybox_tar
from tests.invariant import settles
from tests.procs import wait_for
from tests.swarm import SwarmEngine

GiB = 1 << 30
IMAGE = "gpumgr-test/busybox:latest"
SERVICE = "ha-infer"
NODE = "ha-swarm-node"
REPLICAS = 4  # 2 GPUs of 13 GiB hold exactly four 6 GiB grants: a double booking leaves one pending


@pytest.fixture
def swarm_plane(tmp_path, docker_client) -> Iterator[dict[str, Any]]:
    if shutil.which("dockerd") is None:
        pytest.fail("dockerd is needed for the swarm tests")
    engine = SwarmEngine(busybox_tar(shutil.which("busybox") or "/bin/busybox"))
    etcd = ha = agent = None
    try:
        etcd = EtcdCluster(tmp_path / "etcd", size=3)
        ha = HaManagers(tmp_path, etcd.endpoints, prefix="ha-swarm")
        agent = ha.agent(NODE, ha.leader(), gpus="sim:2x13GiB",
                         env={"DOCKER_HOST": engine.env["DOCKER_HOST"], "GPUMGR_HOOK_SOCKET": engine.hook_socket})
        yield {"engine": engine, "ha": ha, "agent": agent}
    finally:
        if agent is not None:
            with contextlib.suppress(Exception):
                agent.stop(signal.SIGKILL)
        if ha is not None:
            ha.stop()
        if etcd is not None:
            etcd.stop()
        engine.stop()


def grant_of(pid: int) -> str | None:
    """The grant the runtime hook put in a task container's environment (None: it holds none)."""
    with contextlib.suppress(OSError):
        raw = Path(f"/proc/{pid}/environ").read_bytes().decode()
        return dict(i.split("=", 1) for i in raw.split("\0") if "=" in i).get("GPUMGR_GRANT")
    return None


def running_tasks(engine: SwarmEngine) -> dict[str, str | None]:
    """Each running task container of the service and the grant in its environment."""
    return {c["Id"]: grant_of(c["State"]["Pid"]) for c in engine.containers(SERVICE) if c["State"]["Running"]}


def live_grants(manager: HaManager) -> dict[str, dict[str, Any]]:
    records = manager.get("/v1/containers", params={"service": SERVICE}).json()["containers"]
    return {r["id"]: r for r in records if r["state"] in ("creating", "running")}


def test_a_swarm_service_created_across_a_leader_kill_runs_every_replica_with_one_grant(swarm_plane) -> None:
    engine, ha, agent = swarm_plane["engine"], swarm_plane["ha"], swarm_plane["agent"]
    first = ha.leader()
    urls = ",".join(m.url for m in ha.managers)
    seen: dict[str, str | None] = {}  # every task container seen running, and its grant
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            with contextlib.suppress(Exception):
                seen.update(running_tasks(engine))
            stop.wait(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    created = engine.docker("gpu", "--manager", urls, "service", "create", "--detach", "--gpu-memory", "6GiB",
                            "--replicas", str(REPLICAS), "--name", SERVICE, "--stop-grace-period", "1s",
                            IMAGE, "sh", "-c", "exec sleep 3600", check=False)
    assert created.returncode == 0, created.stderr
    watcher.start()
    try:
        # the first replicas are asking for grants (or have them): the leader dies now
        wait_for(lambda: live_grants(first) or running_tasks(engine), 60, interval=0.1,
                 what="the service's first replica to ask for its grant")
        first.stop(signal.SIGKILL)
        second = ha.leader(besides=first)
        agent.manager = second
        agent.wait_ready(30)

        def settled() -> bool:
            tasks, grants = running_tasks(engine), live_grants(second)
            return len(tasks) == REPLICAS and all(g["state"] == "running" for g in grants.values()) and \
                {g["container_id"] for g in grants.values()} == set(tasks)

        wait_for(settled, 120, what=f"{REPLICAS} replicas running, each with one grant of the new leader:\n"
                                    f"{agent.output()[-3000:]}")
    finally:
        stop.set()
        watcher.join(5)
    history = engine.docker("service", "ps", SERVICE, "--no-trunc", "--format", "{{.CurrentState}} | {{.Error}}")
    print(f"tasks across the failover:\n{history.stdout}")  # a refused hook shows as a failed task, retried
    tasks, grants = running_tasks(engine), live_grants(second)
    for container, grant in tasks.items():  # each runs on the grant the new leader holds for it
        assert grant in grants and grants[grant]["container_id"] == container, (container, grant, grants)
    assert all(grant for grant in seen.values()), f"a replica ran without a grant: {seen}"
    reserved = sorted(g["memory_reserved"] for g in second.node(NODE)["gpus"])
    assert reserved == [12 * GiB, 12 * GiB], reserved
    client = docker.DockerClient(base_url=engine.env["DOCKER_HOST"])
    try:
        settles(second, client, {NODE})
    finally:
        client.close()
