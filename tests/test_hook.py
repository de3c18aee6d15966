"""The OCI runtime hook: argument parsing, pass-through, and refusals written where Docker reads them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gpumgr.plugin.hook import split_command
from tests.procs import ROOT


@pytest.mark.parametrize("argv, expected", [
    (["--root", "/r", "--log", "/l.json", "--log-format", "json", "create", "--bundle", "/b", "id"],
     ("create", 6, "/l.json")),
    (["--log=/x.json", "--systemd-cgroup", "start", "id"], ("start", 2, "/x.json")),
    (["--version"], (None, 1, None)),
    (["delete", "--force", "id"], ("delete", 0, None)),
])
def test_split_command_skips_global_options(argv, expected):
    assert split_command(argv) == expected


def run_hook(tmp_path, env_list: list[str], socket: str) -> tuple[subprocess.CompletedProcess, str]:
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "config.json").write_text(json.dumps({"process": {"env": env_list}}))
    log = tmp_path / "log.json"
    marker = tmp_path / "handed-over"
    fake_runc = tmp_path / "runc"
    fake_runc.write_text(f"#!/bin/sh\necho \"$@\" > {marker}\n")
    fake_runc.chmod(0o755)
    env = {**os.environ, "GPUMGR_RUNC": str(fake_runc), "GPUMGR_HOOK_SOCKET": socket,
           "GPUMGR_RUNTIME_CONFIG": str(tmp_path / "none.json")}
    result = subprocess.run([sys.executable, "-m", "gpumgr.plugin.hook", "--root", "/r", "--log", str(log), "create",
                             "--bundle", str(bundle), "c" * 64], env=env, cwd=ROOT, capture_output=True, text=True)
    return result, (marker.read_text() if marker.exists() else "")


def test_containers_that_ask_for_nothing_pass_straight_through(tmp_path):
    result, handed = run_hook(tmp_path, ["PATH=/bin"], str(tmp_path / "no-agent.sock"))
    assert result.returncode == 0 and result.stdout == "" and result.stderr == ""
    assert handed.startswith("--root /r --log") and "create --bundle" in handed


def test_a_refusal_goes_to_the_runtime_log_and_nothing_starts(tmp_path):
    result, handed = run_hook(tmp_path, ["GPUMGR_REQUEST_MEMORY=1073741824"], str(tmp_path / "no-agent.sock"))
    assert result.returncode == 1 and result.stdout == "" and result.stderr == "" and handed == ""
    line = json.loads((tmp_path / "log.json").read_text().splitlines()[-1])
    assert line["level"] == "error" and "no gpumgr agent listens" in line["msg"]


def test_a_bad_request_in_the_environment_is_refused_clearly(tmp_path):
    socket = tmp_path / "fake.sock"
    socket.write_text("")  # exists, so the hook gets as far as reading the request
    result, handed = run_hook(tmp_path, ["GPUMGR_REQUEST_MEMORY=lots"], str(socket))
    assert result.returncode == 1 and handed == ""
    assert "bad GPU request" in (tmp_path / "log.json").read_text()


# --- the hook's socket on a real agent ------------------------------------------------------------

def _raw_exchange(path: str, payload: bytes, wait: float = 5.0) -> bytes:
    """Send ``payload`` as is on the hook socket and return everything the agent sends back before closing."""
    import socket as sockets

    with sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM) as sock:
        sock.settimeout(wait)
        sock.connect(path)
        sock.sendall(payload)
        received = b""
        while chunk := sock.recv(4096):
            received += chunk
        return received


@pytest.mark.docker
def test_the_agent_drops_bad_hook_requests_and_keeps_serving(docker_agent):
    from gpumgr.plugin.hook import Refused, ask_agent
    from gpumgr.wire import envelope

    path = docker_agent.hook_socket
    assert _raw_exchange(path, envelope.frame(b"\xc1 not msgpack")) == b""  # undecodable: closed, no answer
    assert _raw_exchange(path, envelope.FRAME_HEADER.pack(64 * 1024 * 1024)) == b""  # over the size bound
    wrong_type = envelope.frame(envelope.pack("heartbeat", {"node": "x", "gpus": [], "containers": []}))
    reply = envelope.unpack(_raw_exchange(path, wrong_type)[envelope.FRAME_HEADER.size:])
    assert reply["body"]["ok"] is False and reply["body"]["error"]["code"] == "protocol_error"
    with pytest.raises(Refused, match="no container"):  # a container the engine does not know gets nothing
        ask_agent(_reserve("c" * 64, 1 << 30), path)
    assert docker_agent.popen.poll() is None
    log = docker_agent.output()
    assert "dropped a malformed message from the runtime hook" in log and "over the" in log


def _reserve(container_id: str, memory: int) -> dict:
    return {"container_id": container_id, "gpu_memory": memory, "gpus": 1, "name": "", "image": "",
            "labels": {}, "on_overrun": None, "node": ""}


@pytest.mark.docker
def test_the_agent_takes_the_request_from_the_engine_not_from_the_hook(docker_agent, docker_client, test_image):
    """What a hook request claims counts for nothing: the grant follows the container's own configuration."""
    from gpumgr.plugin.hook import Refused, ask_agent

    huge = docker_client.containers.create(test_image, ["true"], network_mode="none",
                                           environment={"GPUMGR_REQUEST_MEMORY": str(1 << 50)},
                                           labels={"gpumgr.node": docker_agent.node})
    plain = docker_client.containers.create(test_image, ["true"], network_mode="none",
                                            labels={"gpumgr.node": docker_agent.node})
    try:
        with pytest.raises(Refused, match="no GPU could ever hold this: 1024TiB"):  # the engine's 1 PiB counts
            ask_agent(_reserve(huge.id, 1), docker_agent.hook_socket)
        with pytest.raises(Refused, match="asks for no valid GPU memory"):  # no request in its configuration
            ask_agent(_reserve(plain.id, 1 << 30), docker_agent.hook_socket)
        nodes = docker_agent.manager.get("/v1/containers").json()["containers"]
        assert nodes == []  # nothing was reserved for either
    finally:
        huge.remove(force=True)
        plain.remove(force=True)


def test_the_hook_socket_is_for_root_only(tmp_path):
    import os
    import stat

    from gpumgr.agent.hook.hooklink import HookListener

    path = tmp_path / "run" / "agent.sock"
    listener = HookListener(str(path), 1.0)
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    finally:
        listener.close()


@pytest.mark.docker
def test_the_agent_refuses_hook_connections_from_other_users_even_if_the_mode_is_loosened(docker_agent):
    import os

    if os.geteuid() != 0:
        pytest.skip("needs root to act as another user")
    os.chmod(docker_agent.hook_socket, 0o666)
    os.chmod(os.path.dirname(docker_agent.hook_socket), 0o755)
    assert _recv_as_nobody(docker_agent.hook_socket) == b""  # accepted by the kernel, closed by the agent at once
    assert "refused a runtime hook connection" in docker_agent.output()


def _recv_as_nobody(path: str) -> bytes:
    """Connect to ``path`` from a child process running as user ``nobody``; what it read before the close."""
    import os
    import pwd
    import socket as sockets

    nobody = pwd.getpwnam("nobody")
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to nobody, connect, report what came back
        try:
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            with sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM) as sock:
                sock.settimeout(5)
                sock.connect(path)
                os.write(write_end, b"ok:" + sock.recv(100))
        except BaseException as exc:
            os.write(write_end, f"error:{exc}".encode())
        finally:
            os._exit(0)
    os.close(write_end)
    os.waitpid(pid, 0)
    with os.fdopen(read_end, "rb") as pipe:
        result = pipe.read()
    assert result.startswith(b"ok:"), result
    return result[3:]


@pytest.mark.docker
def test_a_task_asks_for_a_burst_limit_in_its_configuration(docker_agent, docker_client, test_image):
    """``GPUMGR_REQUEST_MEMORY_LIMIT`` (``docker gpu service create --gpu-memory-limit``) reaches the grant; one
    below the request is refused."""
    from gpumgr.plugin.hook import Refused, ask_agent

    def task(limit: str):
        return docker_client.containers.create(test_image, ["true"], network_mode="none", labels={
            "gpumgr.node": docker_agent.node}, environment={"GPUMGR_REQUEST_MEMORY": "4GiB",
                                                            "GPUMGR_REQUEST_MEMORY_LIMIT": limit})

    burstable, below = task("12GiB"), task("2GiB")
    try:
        grant = ask_agent(_reserve(burstable.id, 1), docker_agent.hook_socket)
        env = grant["env"]  # what the hook writes into the task's environment
        assert (env["GPUMGR_GPU_MEMORY"], env["GPUMGR_GPU_MEMORY_LIMIT"]) == (str(4 << 30), str(12 << 30))
        record = docker_agent.manager.get(f"/v1/containers/{grant['grant']}").json()
        assert (record["gpu_memory"], record["gpu_memory_limit"]) == (4 << 30, 12 << 30)
        with pytest.raises(Refused, match="below gpu_memory"):
            ask_agent(_reserve(below.id, 1), docker_agent.hook_socket)
    finally:
        burstable.remove(force=True)
        below.remove(force=True)
