"""``docker gpu run`` as a drop-in ``docker run``, and ``docker gpu logs``, ``wait``, ``rm`` (issue 19).

The plugin runs as its own process (``python -m gpumgr.plugin.docker_gpu``) against real ``gpumgr
manager`` and ``gpumgr agent`` processes, a real Docker engine and simulated GPUs; what it creates is
checked with ``docker inspect``. Flag parsing is also checked on its own, without an engine.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from gpumgr.plugin import run_flags
from gpumgr.plugin.docker_gpu import PluginError
from tests.procs import AgentProc, ManagerProc, remove_containers_of, wait_for

GiB = 1 << 30
NODE = f"cli-{os.getpid()}"


@pytest.fixture
def own_containers(docker_client):
    """Remove what this module's nodes leave in the engine, and only that (the engine is shared)."""
    yield
    remove_containers_of(docker_client, NODE, NODE + "-strict")
OPERATOR = "operator-token-0123456789"
ALICE = "alice-token-0123456789abcdef"


@pytest.fixture
def stack(tmp_path, test_image, own_containers):
    """A manager with one tenant (no policy of its own: the default refuses every host path) and one agent."""
    config = tmp_path / "manager.yaml"
    config.write_text(yaml.safe_dump({"token": OPERATOR, "tenants": {"alice": {"token": ALICE}}}))
    manager = ManagerProc(tmp_path, "--config", str(config), env={"GPUMGR_TOKEN": OPERATOR})
    manager.http.headers["Authorization"] = f"Bearer {OPERATOR}"
    agent = AgentProc(tmp_path, manager, NODE)
    yield manager
    agent.stop()
    manager.stop()


def gpu(manager: ManagerProc, *args: str, token: str = OPERATOR, timeout: float = 60,
        **kw) -> subprocess.CompletedProcess:
    """``docker gpu ARGS`` as its own process."""
    env = {**os.environ, "GPUMGR_TOKEN": token}
    return subprocess.run([sys.executable, "-m", "gpumgr.plugin.docker_gpu", "gpu", "--manager", manager.url, *args],
                          capture_output=True, timeout=timeout, env=env, **kw)


def run(manager: ManagerProc, *args: str, **kw) -> subprocess.CompletedProcess:
    return gpu(manager, "run", "--gpu-memory", "1GiB", *args, **kw)


def test_attached_output_streams_by_stream_and_the_exit_code_is_the_containers(stack, test_image) -> None:
    done = run(stack, "--name", "three", test_image, "sh", "-c", "echo to-out; echo to-err >&2; exit 3")
    assert done.returncode == 3, done.stderr
    assert done.stdout == b"to-out\n" and done.stderr == b"to-err\n"
    assert gpu(stack, "wait", "three").stdout == b"3\n"
    logs = gpu(stack, "logs", "three")
    assert logs.stdout == b"to-out\n" and logs.stderr == b"to-err\n"
    assert run(stack, test_image, "true").returncode == 0


def test_a_bind_mount_is_readable_and_not_writable_inside(stack, test_image, tmp_path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "f").write_text("from the host\n")
    done = run(stack, "-v", f"{data}:/data:ro", test_image, "sh", "-c", "cat /data/f; touch /data/g || exit 9")
    assert done.returncode == 9 and b"from the host" in done.stdout and b"Read-only" in done.stderr
    assert not (data / "g").exists()


def test_flags_reach_the_engine_as_docker_inspect_shows_them(stack, test_image, docker_client, tmp_path) -> None:
    env_file = tmp_path / "env"
    env_file.write_text("# a comment\nFROM_FILE=1\n")
    started = time.monotonic()
    done = run(stack, "-d", "--shm-size", "1g", "-w", "/tmp", "-u", "1000:1000", "--entrypoint", "sleep",
               "--cpus", "1.5", "-m", "256m", "-e", "A=b", "--env-file", str(env_file), "-l", "team=ml",
               "--ulimit", "nofile=512:1024", "--cap-add", "SYS_PTRACE", "--stop-signal", "SIGINT",
               "--tmpfs", "/scratch", "-p", "127.0.0.1:18081:8080", "--mount", "type=volume,source=gpumgr-cli-test,"
               "target=/v", "--name", "inspected", test_image, "300")
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - started < 30  # -d returns once it runs, without waiting for it to end
    grant = done.stdout.decode().strip()
    record = stack.get(f"/v1/containers/{grant}").json()
    assert record["state"] == "running" and record["name"] == "inspected"
    attrs = docker_client.api.inspect_container(record["container_id"])
    host, config = attrs["HostConfig"], attrs["Config"]
    assert host["ShmSize"] == 2**30 and config["WorkingDir"] == "/tmp" and config["User"] == "1000:1000"
    assert config["Entrypoint"] == ["sleep"] and config["Cmd"] == ["300"]
    assert host["NanoCpus"] == 1_500_000_000 and host["Memory"] == 256 * 2**20
    assert {"A=b", "FROM_FILE=1"} <= set(config["Env"]) and config["Labels"]["team"] == "ml"
    assert host["Ulimits"] == [{"Name": "nofile", "Soft": 512, "Hard": 1024}] and host["CapAdd"] == ["SYS_PTRACE"]
    assert host["PortBindings"]["8080/tcp"] == [{"HostIp": "127.0.0.1", "HostPort": "18081"}]
    assert {m["Destination"]: m["Type"] for m in attrs["Mounts"]} == {"/scratch": "tmpfs", "/v": "volume"}
    refused = gpu(stack, "rm", "inspected")
    assert refused.returncode == 1 and b"running" in refused.stderr
    assert gpu(stack, "rm", "-f", "inspected").returncode == 0
    assert not docker_client.containers.list(all=True, filters={"id": record["container_id"]})
    docker_client.volumes.get("gpumgr-cli-test").remove()


def test_rm_leaves_nothing_in_the_engine_and_frees_the_grant(stack, test_image, docker_client) -> None:
    done = run(stack, "--rm", "--name", "gone", test_image, "sh", "-c", "echo bye; exit 2")
    assert done.returncode == 2 and done.stdout == b"bye\n"
    assert not docker_client.containers.list(all=True, filters={"label": f"gpumgr.node={NODE}"})
    assert stack.get("/v1/containers/gone").json()["state"] == "removed"
    assert all(g["memory_reserved"] == 0 for g in stack.node(NODE)["gpus"])


def test_an_overrun_exits_137_with_the_reason(stack, test_image) -> None:
    script = f"echo {2 * GiB} > /tmp/use; exec sleep 300"
    done = run(stack, "-e", "GPUMGR_SIM_USAGE_FILE=/tmp/use", test_image, "sh", "-c", script)
    assert done.returncode == 137, done.stderr
    assert b"killed: gpu_memory_exceeded (its GPU memory use reached 2GiB, over its grant of 1GiB)" in done.stderr, \
        done.stderr


def test_ctrl_c_is_passed_to_the_container(stack, test_image) -> None:
    script = "trap 'echo got-int; exit 130' INT; echo ready; while :; do sleep 0.1; done"
    env = {**os.environ, "GPUMGR_TOKEN": OPERATOR}
    proc = subprocess.Popen([sys.executable, "-m", "gpumgr.plugin.docker_gpu", "gpu", "--manager", stack.url, "run",
                             "--gpu-memory", "1GiB", "--rm", test_image, "sh", "-c", script],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None
    assert proc.stdout.readline() == b"ready\n"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert out == b"got-int\n"
    assert all(g["memory_reserved"] == 0 for g in stack.node(NODE)["gpus"])


@pytest.mark.parametrize(("flags", "words"), [
    (["-it"], b"-i"), (["-t"], b"--tty"), (["--restart", "always"], b"--restart"), (["--gpus", "all"], b"'all'"),
    (["--security-opt", "seccomp=unconfined"], b"--security-opt"), (["--bogus"], b"--bogus"),
    (["-p", "8000-8010:8000-8010"], b"no ranges"),
])
def test_a_docker_flag_gpumgr_does_not_offer_is_refused_by_name(stack, test_image, flags, words) -> None:
    done = run(stack, *flags, test_image, "true")
    assert done.returncode == 125 and words in done.stderr, done.stderr
    assert stack.get("/v1/containers").json()["containers"] == []


def test_refusals_exit_125_and_say_what(stack, test_image, tmp_path) -> None:
    denied = run(stack, "-v", "/var/run/docker.sock:/s", test_image, "true", token=ALICE)
    assert denied.returncode == 125 and b"policy_denied" in denied.stderr and b"bind" in denied.stderr
    privileged = run(stack, "--privileged", test_image, "true", token=ALICE)
    assert privileged.returncode == 125 and b"privileged" in privileged.stderr
    full = gpu(stack, "run", "--gpu-memory", "20GiB", "-d", test_image, "sleep", "60")
    assert full.returncode == 0
    no_fit = gpu(stack, "run", "--gpu-memory", "20GiB", "--gpus", "2", test_image, "true")
    assert no_fit.returncode == 125 and b"--queue" in no_fit.stderr and b'"queue"' not in no_fit.stderr
    missing = run(stack, test_image, "/no/such/program")
    assert missing.returncode == 127, missing.stderr


def test_flags_become_the_request() -> None:
    args = run_flags.parser(PluginError).parse_args([
        "--gpu-memory", "2GiB", "--gpus", "2", "-v", "/a:/b:ro", "--mount", "type=bind,src=/c,dst=/d,readonly",
        "-p", "8080:80", "-p", "127.0.0.1::53/udp", "-p", "[::1]:9000:90", "-p", "81", "--net", "train",
        "--ipc", "host", "--pid", "host", "--ulimit", "memlock=-1", "--log-driver", "local", "--log-opt", "max-size=1m",
        "--entrypoint", "", "--rm", "img", "python", "-u", "train.py", "-v"])
    body = run_flags.build_request(args, PluginError)
    assert body["command"] == ["python", "-u", "train.py", "-v"]  # flags after the image belong to the command
    assert body["gpu_memory"] == 2 * GiB and body["gpus"] == 2 and body["volumes"] == ["/a:/b:ro"]
    assert body["mounts"] == [{"type": "bind", "source": "/c", "target": "/d", "read_only": True}]
    assert body["ports"] == {"80/tcp": 8080, "53/udp": ["127.0.0.1", None], "90/tcp": ["::1", 9000], "81/tcp": None}
    assert body["network"] == "train" and body["ipc_mode"] == "host" and body["pid_mode"] == "host"
    assert body["ulimits"] == [{"name": "memlock", "soft": -1}] and body["entrypoint"] == []
    assert body["log_config"] == {"type": "local", "config": {"max-size": "1m"}} and body["auto_remove"] is True


def test_a_burst_limit_becomes_the_requests_gpu_memory_limit() -> None:
    parse = run_flags.parser(PluginError).parse_args
    body = run_flags.build_request(parse(["--gpu-memory", "4GiB", "--gpu-memory-limit", "12GiB", "img"]), PluginError)
    assert (body["gpu_memory"], body["gpu_memory_limit"]) == (4 * GiB, 12 * GiB)
    assert "gpu_memory_limit" not in run_flags.build_request(parse(["--gpu-memory", "4GiB", "img"]), PluginError)


def test_a_bare_env_name_takes_its_value_from_here(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FROM_HERE", "yes")
    args = run_flags.parser(PluginError).parse_args(["--gpu-memory", "1GiB", "-e", "FROM_HERE", "-e", "UNSET_NAME_X",
                                                     "img"])
    assert run_flags.build_request(args, PluginError)["env"] == {"FROM_HERE": "yes"}
    with pytest.raises(PluginError, match="--cpus"):
        run_flags.build_request(run_flags.parser(PluginError).parse_args(["--gpu-memory", "1GiB", "--cpus", "x",
                                                                          "img"]), PluginError)


def test_wait_returns_the_exit_code_of_each(stack, test_image) -> None:
    for name, code in (("w1", 0), ("w2", 5)):
        assert run(stack, "-d", "--name", name, test_image, "sh", "-c", f"sleep 0.5; exit {code}").returncode == 0
    waited = gpu(stack, "wait", "w1", "w2")
    assert waited.returncode == 0 and waited.stdout == b"0\n5\n"
    wait_for(lambda: gpu(stack, "rm", "w1", "w2").returncode == 0, 10, what="both removed")
