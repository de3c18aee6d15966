"""examples/swarm/stack-ha.yml deployed for real: the image examples/swarm/build-image makes (no registry),
a one-node swarm on a throw-away engine, three etcd members and three managers on three loopback
addresses (the stack binds each to its node's address, so one node can carry all three), and the
agent as the stack's global service with simulated GPUs.

It checks what a user of the stack relies on: the members form one etcd, one manager leads, a
follower forwards a placement, and after the leader's container is killed another manager leads and
places while the first container keeps its grant.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from tests.faults.engine import ThrowawayEngine
from tests.images import busybox_tar
from tests.procs import ROOT, free_port, wait_for

#: building the image on a cold cache (debootstrap) and a stack's teardown outlast the default per-test limit
pytestmark = pytest.mark.timeout(900)

GiB = 1 << 30
STACK = "ha"
IMAGE = "gpumgr-test/gpumgr:latest"
HOSTS = ("127.0.0.21", "127.0.0.22", "127.0.0.23")
TOKEN = "stack-ha-test-token"
NODE = "ha-swarm-node"
#: The bootstrapped Debian root keeps between runs here (the image build then takes seconds, not a minute).
IMAGE_CACHE = os.environ.get("GPUMGR_IMAGE_CACHE", "/var/cache/gpumgr-image")


def _need(tool: str) -> None:
    if shutil.which(tool) is None:
        message = f"{tool} is needed to build the gpumgr image (apt-get install {tool})"
        if os.environ.get("GPUMGR_REQUIRE_DOCKER") == "1":
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="module")
def engine(docker_client):
    for tool in ("dockerd", "debootstrap"):
        _need(tool)
    if os.geteuid() != 0:
        pytest.skip("debootstrap needs root")
    engine = ThrowawayEngine(busybox_tar(shutil.which("busybox") or "/bin/busybox"))
    try:
        built = subprocess.run([str(ROOT / "examples" / "swarm" / "build-image"), IMAGE], capture_output=True,
                               text=True, timeout=900,
                               env={**os.environ, **engine.env, "PIP": f"{sys.executable} -m pip",
                                    "GPUMGR_IMAGE_CACHE": IMAGE_CACHE})
        assert built.returncode == 0, built.stdout + built.stderr
        docker(engine, "swarm", "init", "--advertise-addr", "127.0.0.1", "--listen-addr", f"127.0.0.1:{free_port()}")
        yield engine
    finally:
        docker(engine, "stack", "rm", STACK, check=False)
        # leaving while the stack's containers are still going can hang the 20.10 engine for good (its
        # network store retries one endpoint's delete forever): wait for them, and never let leave block
        with contextlib.suppress(AssertionError):
            wait_for(lambda: not docker(engine, "ps", "-aq", "--filter", f"label=com.docker.stack.namespace={STACK}",
                                        check=False).stdout.strip(), 60, interval=1.0,
                     what="the stack's containers to go")
        with contextlib.suppress(subprocess.TimeoutExpired):
            docker(engine, "swarm", "leave", "--force", check=False, timeout=30)
        engine.stop()  # kills the engine if it did not stop


def docker(engine: ThrowawayEngine, *args: str, check: bool = True, env: dict[str, str] | None = None,
           timeout: float = 180) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, **engine.env, **(env or {})})
    if check:
        assert result.returncode == 0, f"docker {' '.join(args)}: {result.stderr}"
    return result


def health(host: str) -> dict | None:
    try:
        return requests.get(f"http://{host}:9400/healthz", timeout=2).json()
    except (requests.RequestException, ValueError):
        return None


def leader(among: tuple[str, ...] = HOSTS) -> str | None:
    """The host whose manager says it leads, if one does."""
    return next((h for h in among if (health(h) or {}).get("role") == "leader"), None)


def api(host: str, method: str, path: str, **kw) -> requests.Response:
    return requests.request(method, f"http://{host}:9400{path}", headers={"Authorization": f"Bearer {TOKEN}"},
                            timeout=60, **kw)


def job() -> dict:
    return {"image": "gpumgr-test/busybox:latest", "gpu_memory": "1GiB", "command": ["sleep", "600"]}


def test_the_ha_stack_elects_forwards_and_fails_over_on_one_node(engine, tmp_path: Path):
    node_id = docker(engine, "info", "--format", "{{.Swarm.NodeID}}").stdout.strip()
    docker(engine, "node", "update", *[a for i in (1, 2, 3) for a in ("--label-add", f"gpumgr.ha{i}=true")], node_id)
    keys = tmp_path / "keys"
    subprocess.run([sys.executable, "-m", "gpumgr", "join-token", "--state-dir", str(keys)], check=True,
                   capture_output=True, cwd=ROOT)
    docker(engine, "secret", "create", "gpumgr-manager-key", str(keys / "manager_key.json"))
    for folder in ("agent-state", "run"):
        (tmp_path / folder).mkdir()
    # what differs on this test machine: simulated GPUs, the throw-away engine's socket and records
    override = tmp_path / "test-override.yml"
    override.write_text(json.dumps({"version": "3.8", "services": {"agent": {
        "environment": {"GPUMGR_GPUS": "sim:2x16GiB", "GPUMGR_NODE": NODE, "GPUMGR_NETWORK_MODE": "none"},
        "volumes": [f"{engine.socket}:/var/run/docker.sock", f"{tmp_path / 'agent-state'}:/var/lib/gpumgr",
                    f"{tmp_path / 'run'}:/run/gpumgr",
                    f"{engine.dir / 'data' / 'containers'}:/var/lib/docker/containers:ro"]}}}))
    env = {"GPUMGR_HA1": HOSTS[0], "GPUMGR_HA2": HOSTS[1], "GPUMGR_HA3": HOSTS[2], "GPUMGR_TOKEN": TOKEN,
           "GPUMGR_JOIN_TOKEN": "none", "GPUMGR_IMAGE": IMAGE}
    stack = str(ROOT / "examples" / "swarm" / "stack-ha.yml")
    docker(engine, "stack", "deploy", "-c", stack, "-c", str(override), "--resolve-image", "never", STACK, env=env)

    first = wait_for(leader, 180, interval=1.0, what="one manager of the stack to lead")
    store = "etcd://" + ",".join(f"{h}:2379" for h in HOSTS) + "/gpumgr"
    token = subprocess.run([sys.executable, "-m", "gpumgr", "join-token", "--store", store, "--state-dir", str(keys)],
                           check=True, capture_output=True, text=True, cwd=ROOT).stdout.split()[-1]
    docker(engine, "service", "update", "--detach", "--env-add", f"GPUMGR_JOIN_TOKEN={token}", f"{STACK}_agent")

    def node_ready() -> bool:
        answer = api(first, "GET", "/v1/nodes")
        return answer.ok and any(n["name"] == NODE and n["state"] == "ready" for n in answer.json()["nodes"])

    wait_for(node_ready, 180, interval=1.0, what="the stack's agent to join and register with the leader")
    follower = next(h for h in HOSTS if h != first)
    placed = api(follower, "POST", "/v1/containers", json=job())  # forwarded to the leader
    assert placed.status_code == 201, placed.text
    one = placed.json()
    assert one["state"] == "running" and one["node"] == NODE
    engine_view = docker(engine, "inspect", one["container_id"]).stdout
    assert json.loads(engine_view)[0]["Config"]["Labels"]["gpumgr.grant"] == one["id"]

    # the leader's container dies; Swarm restarts it, and meanwhile another manager leads
    task = docker(engine, "ps", "-q", "--filter", f"label=com.docker.swarm.service.name={STACK}_manager"
                  f"{HOSTS.index(first) + 1}").stdout.split()
    assert task, "the leader's task container"
    docker(engine, "kill", *task)
    others = tuple(h for h in HOSTS if h != first)
    second = wait_for(lambda: leader(others), 60, interval=0.5, what="another manager to lead")

    def placed_again() -> requests.Response | None:
        answer = api(second, "POST", "/v1/containers", json=job())
        return answer if answer.status_code == 201 else None

    two = wait_for(placed_again, 60, interval=1.0, what="a placement through the new leader").json()
    records = {r["id"]: r for r in api(second, "GET", "/v1/containers").json()["containers"]}
    assert records[one["id"]]["state"] == "running", "the first container kept its grant across the failover"
    assert records[two["id"]]["state"] == "running"
    reserved = sum(g["memory_reserved"] for n in api(second, "GET", "/v1/nodes").json()["nodes"] for g in n["gpus"])
    assert reserved == 2 * GiB, "each running container holds its grant once"
    for record in (one, two):
        assert api(second, "DELETE", f"/v1/containers/{record['id']}").status_code in (200, 202)
