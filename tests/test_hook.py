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
    with pytest.raises(Refused, match="no GPU on node"):  # a real request still gets a real answer
        ask_agent({"container_id": "c" * 64, "gpu_memory": 1 << 50, "gpus": 1, "name": "", "image": "",
                   "labels": {}, "on_overrun": None, "node": ""}, path)
    assert docker_agent.popen.poll() is None
    log = docker_agent.output()
    assert "dropped a malformed message from the runtime hook" in log and "over the" in log
