"""The guard against a real engine: a private dockerd started with ``--authorization-plugin`` and the guard.

Every GPU request is refused with the guard's own message (a 403 from the engine, not a driver or
runtime error from later); plain containers and the engine's everyday calls pass; gpumgr's own
creates (REST, ``docker gpu run``) pass with their ticket; hand-made bodies the engine would read
differently from a plain JSON parser are refused; and with the guard stopped the engine refuses
every call, then works again once the guard is back, without an engine restart.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys

import docker
import pytest
from docker.types import DeviceRequest

from tests.guard_dockerd import GuardEngine
from tests.guardproc import GuardProc
from tests.images import IMAGE, busybox_tar
from tests.procs import ROOT, AgentProc, ManagerProc, wait_for

pytestmark = pytest.mark.usefixtures("docker_client")
DENIED = "gpumgr guard:"


@pytest.fixture(scope="module")
def guard(tmp_path_factory):
    proc = GuardProc(tmp_path_factory.mktemp("guard"))
    yield proc
    proc.remove()


@pytest.fixture(scope="module")
def engine(guard):
    engine = GuardEngine(busybox_tar(), guard.name)
    yield engine
    engine.stop()


def run(engine: GuardEngine, *args: str) -> subprocess.CompletedProcess:
    return engine.docker("run", "--rm", "--network", "none", *args, check=False)


@pytest.mark.parametrize("args, field", [
    (["--gpus", "all"], "DeviceRequests"),
    (["--gpus", "\"device=0,1\",capabilities=compute"], "DeviceRequests"),
    (["--runtime", "nvidia"], "Runtime"),
    (["--device", "/dev/nvidia0"], "Devices"),
    (["--device", "/dev/dri/card0"], "Devices"),
    (["-v", "/dev:/dev"], "Binds"),
    (["--mount", "type=bind,source=/dev,target=/host-dev"], "Mounts"),
    (["-v", "/:/host"], "Binds"),
    (["-v", "/run/docker/plugins:/p"], "Binds"),
    (["--privileged"], "Privileged"),
    (["--device-cgroup-rule", "c 195:* rwm"], "DeviceCgroupRules"),
    (["--device-cgroup-rule", "a *:* rwm"], "DeviceCgroupRules"),
    (["-e", "NVIDIA_VISIBLE_DEVICES=all"], "NVIDIA_VISIBLE_DEVICES"),
    (["-e", "NVIDIA_DRIVER_CAPABILITIES=compute"], "NVIDIA_DRIVER_CAPABILITIES"),
    (["-e", "GPUMGR_REQUEST_MEMORY=80GiB", "-e", "GPUMGR_REQUEST_PRIORITY=1000000"], "GPUMGR_REQUEST_PRIORITY"),
    (["--label", "gpumgr.grant=forged"], "gpumgr.grant"),
])
def test_every_gpu_request_through_the_cli_is_denied_by_the_guard(engine, guard, args, field):
    result = run(engine, *args, IMAGE, "true")
    assert result.returncode != 0
    assert f"authorization denied by plugin {guard.name}: {DENIED}" in result.stderr, result.stderr
    assert field in result.stderr and "docker gpu run --gpu-memory" in result.stderr


@pytest.mark.parametrize("kwargs", [
    {"device_requests": [DeviceRequest(count=-1, capabilities=[["gpu"]])]},
    {"device_requests": [DeviceRequest(driver="cdi", device_ids=["nvidia.com/gpu=all"])]},
    {"devices": ["nvidia.com/gpu=0"]},
    {"privileged": True},
    {"environment": {"NVIDIA_VISIBLE_DEVICES": "0"}},
    {"volumes": {"/etc/docker": {"bind": "/x", "mode": "ro"}}},
])
def test_the_sdk_gets_a_403(engine, kwargs):
    with pytest.raises(docker.errors.APIError) as caught:
        engine.client.containers.create(IMAGE, "true", network_mode="none", **kwargs)
    assert caught.value.status_code == 403 and DENIED in str(caught.value)


def test_plain_containers_and_everyday_calls_pass(engine):
    assert run(engine, "-v", "/tmp:/hosttmp:ro", "--device", "/dev/null:/dev/x", IMAGE, "echo", "hi").stdout == "hi\n"
    container = engine.client.containers.run(IMAGE, ["sh", "-c", "echo started; sleep 60"], detach=True,
                                             network_mode="none", environment={"CUDA_VISIBLE_DEVICES": "0"})
    try:
        wait_for(lambda: "started" in container.logs().decode(), 10, what="the container's log")
        assert engine.docker("exec", container.id, "echo", "in").stdout == "in\n"
        assert container.id[:12] in engine.docker("ps").stdout
        container.update(cpu_shares=512)  # an update with no devices passes
        privileged = engine.docker("exec", "--privileged", container.id, "true", check=False)
        assert privileged.returncode != 0 and DENIED in privileged.stderr
    finally:
        container.remove(force=True)


def test_plugin_changes_are_denied(engine):
    for args in (["plugin", "install", "--grant-all-permissions", "example/authz"], ["plugin", "rm", "any"],
                 ["plugin", "disable", "any"]):
        result = engine.docker(*args, check=False)
        assert result.returncode != 0 and DENIED in result.stderr, args
    assert engine.docker("plugin", "ls").returncode == 0


def test_volumes_binding_a_gpu_path_are_denied(engine):
    result = engine.docker("volume", "create", "--opt", "type=none", "--opt", "o=bind", "--opt", "device=/dev",
                           check=False)
    assert result.returncode != 0 and DENIED in result.stderr


def raw_post(engine: GuardEngine, path: str, body: bytes, *, headers: dict[str, str] | None = None,
             chunked: bool = False) -> tuple[int, str]:
    """POST ``body`` to the engine's socket exactly as given; ``(status, response body)``."""
    headers = {"Host": "docker", "Content-Type": "application/json", **(headers or {})}
    if chunked:
        headers["Transfer-Encoding"] = "chunked"
        payload = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    else:
        headers.setdefault("Content-Length", str(len(body)))
        payload = body
    head = f"POST {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + \
        "Connection: close\r\n\r\n"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(60)
        sock.connect(str(engine.socket))
        with contextlib.suppress(BrokenPipeError):  # the engine may answer before it reads the whole body
            sock.sendall(head.encode() + payload)
        data = b""
        with contextlib.suppress(ConnectionResetError):  # it closes once answered, the rest unread
            while chunk := sock.recv(65536):
                data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, data.split(b"\r\n\r\n", 1)[1].decode(errors="replace")


HIDDEN = [
    b'{"Image": "%s", "hostconfig": {"pRIVILEGED": true}}',
    b'{"Image": "%s", "HostConfig": {"DeviceRequests": [{"Count": -1, "Capabilities": [["gpu"]]}]},'
    b' "HOSTCONFIG": {"NetworkMode": "none"}}',
    b'{"Image": "%s", "HostConfig": {"Bind\xc5\xbf": ["/dev:/dev"]}}',
    b'{"Image": "%s", "Privileged": true}',
    b'{"Image": "%s", "HostConfig": null, "DeviceCgroupRules": ["c 195:* rwm"]}',
    b'{"Image": "%s", "env": ["NVIDIA_VISIBLE_DEVICES=all"]}',
]


@pytest.mark.parametrize("template", HIDDEN)
def test_hand_made_bodies_hiding_a_gpu_are_denied(engine, template):
    status, body = raw_post(engine, "/v1.41/containers/create", template % IMAGE.encode())
    assert status == 403 and DENIED in body, body


@pytest.mark.parametrize("case", ["empty", "chunked", "trailing", "oversize", "not-json-type", "old-api"])
def test_bodies_the_guard_cannot_read_are_denied(engine, case):
    body = json.dumps({"Image": IMAGE, "HostConfig": {"Privileged": True}}).encode()
    path, headers, chunked = "/v1.41/containers/create", {}, False
    if case == "empty":
        body = b""
    elif case == "chunked":
        chunked = True
    elif case == "trailing":
        body += b' {"Image": "x"}'  # the engine reads the first value and ignores the rest
    elif case == "oversize":  # over the 1 MiB the engine forwards to plugins
        body = json.dumps({"Image": IMAGE, "Labels": {"pad": "x" * (1 << 20)}, "HostConfig": {"Privileged": True}}
                          ).encode()
    elif case == "not-json-type":
        headers = {"Content-Type": ""}
    elif case == "old-api":
        path = "/v1.23/containers/create"
    status, answer = raw_post(engine, path, body, headers=headers, chunked=chunked)
    assert status == 403 and DENIED in answer, answer
    assert engine.client.containers.list(all=True) == []


def test_a_start_with_a_legacy_host_config_is_judged(engine):
    container = engine.client.containers.create(IMAGE, "true", network_mode="none")
    try:
        status, body = raw_post(engine, f"/v1.23/containers/{container.id}/start",
                                json.dumps({"Privileged": True}).encode())
        assert status == 403 and DENIED in body
    finally:
        container.remove(force=True)


def test_a_ticket_lets_one_create_through_and_the_container_starts_once(engine, guard):
    from gpumgr.agent.guard.guard_client import ticket_labels

    labels = ticket_labels(guard.control)
    assert labels, "the guard took no ticket"
    container = engine.client.containers.create(IMAGE, ["sleep", "0"], labels=labels, name="guard-ticketed",
                                                environment={"NVIDIA_VISIBLE_DEVICES": "GPU-x"}, network_mode="none")
    try:
        with pytest.raises(docker.errors.APIError, match="no ticket"):  # a ticket is used once
            engine.client.containers.create(IMAGE, "true", labels=labels, network_mode="none")
        container.start()
        container.wait(timeout=30)
        for ref in (container.id, container.id[:12], "guard-ticketed"):
            again = engine.docker("start", ref, check=False)
            assert again.returncode != 0 and "grant has ended" in again.stderr, again.stderr
        assert "grant has ended" in engine.docker("restart", container.id, check=False).stderr
        assert DENIED in engine.docker("rename", container.id, "escaped", check=False).stderr
    finally:
        container.remove(force=True)


def test_forged_tickets_are_refused(engine):
    with pytest.raises(docker.errors.APIError, match="no ticket"):
        engine.client.containers.create(IMAGE, "true", labels={"gpumgr.guard.ticket": "x" * 43},
                                        network_mode="none")


def test_gpumgr_places_through_the_guard(tmp_path, engine, guard):
    env = {"DOCKER_HOST": f"unix://{engine.socket}", "GPUMGR_GUARD_CONTROL": guard.control}
    manager = ManagerProc(tmp_path)
    agent = AgentProc(tmp_path, manager, "guard-node", env=env)
    try:
        created = manager.post("/v1/containers", json={"image": IMAGE, "command": ["sleep", "30"],
                                                       "gpu_memory": 1 << 30})
        assert created.status_code == 201, created.text
        inspected = engine.client.containers.get(created.json()["container_id"])
        assert inspected.status == "running" and "gpumgr.guard.ticket" in inspected.labels
        cli = subprocess.run([sys.executable, "-m", "gpumgr.plugin.docker_gpu", "gpu", "run", "-d", "--gpu-memory",
                              "1GiB", IMAGE, "sleep", "30"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                             env={**engine.env, "GPUMGR_MANAGER": manager.url})
        assert cli.returncode == 0, cli.stderr
        record = manager.get(f"/v1/containers/{cli.stdout.strip()}").json()  # -d prints the id, as docker run -d
        assert record["state"] == "running" and record["node"] == "guard-node", record
    finally:
        agent.stop()
        manager.stop()


def test_a_swarm_service_asking_for_a_gpu_is_denied(engine):
    engine.docker("swarm", "init", "--advertise-addr", "127.0.0.1", "--listen-addr", "127.0.0.1:0")
    try:
        result = engine.docker("service", "create", "--detach", "-e", "NVIDIA_VISIBLE_DEVICES=all", IMAGE,
                               "sleep", "60", check=False)
        assert result.returncode != 0 and DENIED in result.stderr, result.stderr
        assert engine.docker("service", "ls", "-q").stdout.strip() == ""
    finally:
        engine.docker("swarm", "leave", "--force", check=False)


def test_with_the_guard_stopped_the_engine_refuses_and_recovers_without_a_restart(engine, guard):
    pid = engine.proc.pid
    guard.stop()
    try:
        # the engine's own refusal, naming the plugin it cannot reach, for a GPU request and a plain call alike
        for call in (lambda: engine.client.containers.create(IMAGE, "true", privileged=True),
                     lambda: engine.client.containers.list()):
            with pytest.raises(docker.errors.APIError) as caught:
                call()
            assert guard.name in str(caught.value) and DENIED not in str(caught.value)
    finally:
        guard.start()
    assert engine.docker("ps").returncode == 0 and engine.proc.pid == pid and engine.proc.poll() is None
    assert DENIED in run(engine, "--gpus", "all", IMAGE, "true").stderr
