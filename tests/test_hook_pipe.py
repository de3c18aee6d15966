"""The shell launcher's way to the agent: the hook pipe, with no Python started per GPU task.

The launcher is the one ``gpumgr plugin install`` writes, run as the engine would run it, with fake
runtimes that record their calls. Its Python is made unreachable (the path in the script is
replaced), so a create that fell back to the Python hook would fail with 127: every grant here
went through the pipe. The agent is a real ``gpumgr agent`` with its manager and the real engine;
the pipe's own edge cases (an agent that dies or is stuck) use the agent's :class:`HookFifo` in
this process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpumgr.agent.hook.hookfifo import HookFifo
from gpumgr.cli import main
from gpumgr.wire.engine import hookpipe
from gpumgr.wire.names import Env, Label
from tests.procs import AgentProc


class Launcher:
    """``gpumgr-runtime`` installed under a temporary root for the hook socket ``socket_path``, without its Python."""

    def __init__(self, root: Path, socket_path: str, capsys: pytest.CaptureFixture[str]) -> None:
        self.root = root
        self.calls = root / "runtime-calls"
        tools = root / "runtimes"
        tools.mkdir()
        self.gpu = self._fake(tools / "nvidia-container-runtime", "gpu")
        self.plain = self._fake(tools / "runc", "plain")
        code = main(["plugin", "install", "--daemon-config", str(root / "daemon.json"), "--bin-dir", str(root / "bin"),
                     "--cli-plugins-dir", str(root / "plugins"), "--runtime-config", str(root / "runtime.json"),
                     "--runtime", str(self.gpu), "--plain-runtime", str(self.plain), "--hook-socket", socket_path])
        capsys.readouterr()
        assert code == 0
        self.path = root / "bin" / "gpumgr-runtime"
        text = self.path.read_text()
        assert sys.executable in text
        self.path.write_text(text.replace(sys.executable, str(root / "no-python-here")))
        self.log = root / "runc-log.json"

    def _fake(self, path: Path, name: str) -> Path:
        path.write_text(f'#!/bin/sh\necho "{name} $*" >> {self.calls}\n')
        path.chmod(0o755)
        return path

    def bundle(self, env: list[str], **extra: Any) -> Path:
        bundle = Path(tempfile.mkdtemp(prefix="bundle-", dir=self.root))
        (bundle / "config.json").write_text(json.dumps({"process": {"env": env, "args": ["sh"]}, **extra}))
        return bundle

    def create(self, bundle: Path, container_id: str, wait: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(bundle, container_id), env=self.env(**env), capture_output=True, text=True,
                              timeout=wait)

    def argv(self, bundle: Path, container_id: str) -> list[str]:
        return [str(self.path), "--root", "/r", "--log", str(self.log), "--log-format", "json", "create", "--bundle",
                str(bundle), "--pid-file", str(bundle / "pid"), container_id]

    @staticmethod
    def env(**extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMGR_")}
        return {**env, "PATH": "/usr/bin:/bin", **extra}

    def runtime_calls(self) -> list[str]:
        return self.calls.read_text().splitlines() if self.calls.exists() else []

    def logged(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.log.read_text().splitlines()] if self.log.exists() else []


@pytest.fixture
def root() -> Iterator[Path]:
    folder = Path(tempfile.mkdtemp(prefix="gp-", dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _spec(bundle: Path) -> dict[str, Any]:
    spec: dict[str, Any] = json.loads((bundle / "config.json").read_text())
    return spec


# --- on a real agent ------------------------------------------------------------------------------

@pytest.mark.docker
def test_a_gpu_task_is_granted_and_pinned_through_the_pipe_without_python(docker_agent, docker_client, test_image,
                                                                          root, capsys):
    launcher = Launcher(root, docker_agent.hook_socket, capsys)
    assert hookpipe.fifo_path(docker_agent.hook_socket).is_fifo()
    task = docker_client.containers.create(test_image, ["true"], network_mode="none",
                                           environment={Env.REQUEST_MEMORY: str(3 << 30)},
                                           labels={"gpumgr.node": docker_agent.node})
    try:
        bundle = launcher.bundle(["PATH=/bin", f"{Env.REQUEST_MEMORY}={3 << 30}", "NVIDIA_VISIBLE_DEVICES=all"])
        result = launcher.create(bundle, task.id)
        assert result.returncode == 0, (result.stderr, launcher.logged())
        assert launcher.runtime_calls() == [f"gpu {' '.join(launcher.argv(bundle, task.id)[1:])}"]
        records = docker_agent.manager.get("/v1/containers").json()["containers"]
        assert [(r["container_id"], r["gpu_memory"]) for r in records] == [(task.id, 3 << 30)]
        spec = _spec(bundle)
        env = dict(item.split("=", 1) for item in spec["process"]["env"])
        assert env["NVIDIA_VISIBLE_DEVICES"] == records[0]["gpus"][0]["uuid"]  # pinned to the grant, not "all"
        assert spec["annotations"][Label.GRANT] == records[0]["id"]
        assert not list(Path(docker_agent.hook_socket).parent.glob("*.r.*"))  # no reply pipe left behind
    finally:
        task.remove(force=True)


@pytest.mark.docker
def test_a_task_on_an_mps_node_joins_the_daemon_through_its_bundle(tmp_path, manager, docker_client, test_image,
                                                                    cleanup_containers, root, capsys):
    """On an ``mps: true`` node the agent's grant names the daemon's pipe directory, and the bundle gets what
    ``--ipc=host -v PIPE:PIPE`` gives a plain container: the pipe bound, the host's IPC and /dev/shm, the share."""
    pipe = tmp_path / "nvidia-mps"
    pipe.mkdir()
    config = tmp_path / "mps-agent.yaml"
    config.write_text(json.dumps({"mps": True, "mps_pipe_directory": str(pipe)}))
    agent = AgentProc(tmp_path, manager, "hookmps", gpus="sim:1x24GiB", extra=["--config", str(config)])
    env = {Env.REQUEST_MEMORY: str(2 << 30), Env.REQUEST_COMPUTE_SHARE: "30"}
    task = docker_client.containers.create(test_image, ["true"], network_mode="none", environment=env,
                                           labels={"gpumgr.node": agent.node})
    try:
        launcher = Launcher(root, agent.hook_socket, capsys)
        private_shm = {"destination": "/dev/shm", "type": "bind", "source": "/var/lib/docker/x/shm",
                       "options": ["rbind"]}
        bundle = launcher.bundle([f"{k}={v}" for k, v in env.items()], mounts=[private_shm],
                                 linux={"namespaces": [{"type": "pid"}, {"type": "ipc"}, {"type": "mount"}]})
        result = launcher.create(bundle, task.id)
        assert result.returncode == 0, (result.stderr, launcher.logged())
        spec = _spec(bundle)
        pinned = dict(item.split("=", 1) for item in spec["process"]["env"])
        assert pinned["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
        assert pinned["CUDA_MPS_PIPE_DIRECTORY"] == str(pipe)
        assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" in pinned
        assert [n["type"] for n in spec["linux"]["namespaces"]] == ["pid", "mount"]  # the host's IPC
        assert sorted((m["destination"], m["source"]) for m in spec["mounts"]) == [
            ("/dev/shm", "/dev/shm"), (str(pipe), str(pipe))]
    finally:
        task.remove(force=True)
        agent.stop()


@pytest.mark.docker
def test_refusals_through_the_pipe_reach_runc_s_log_and_nothing_runs(docker_agent, docker_client, test_image, root,
                                                                    capsys):
    launcher = Launcher(root, docker_agent.hook_socket, capsys)
    huge = docker_client.containers.create(test_image, ["true"], network_mode="none",
                                           environment={Env.REQUEST_MEMORY: str(1 << 50)},
                                           labels={"gpumgr.node": docker_agent.node})
    try:
        asks = launcher.bundle([f"{Env.REQUEST_MEMORY}=1"])  # what the bundle claims counts for nothing
        assert launcher.create(asks, huge.id).returncode == 1
        assert launcher.create(asks, "d" * 64).returncode == 1  # a container the engine does not know
        carries = launcher.bundle(["PATH=/bin"], linux={"devices": [{"path": "/dev/nvidia0", "major": 195}]})
        assert launcher.create(carries, "e" * 64).returncode == 1  # a GPU device and no grant
        messages = [line["msg"] for line in launcher.logged()]
        assert len(messages) == 3 and all(line["level"] == "error" for line in launcher.logged())
        assert "no GPU could ever hold this: 1024TiB" in messages[0]
        assert "no container" in messages[1]
        assert "it carries the GPU device /dev/nvidia0 but holds no gpumgr grant" in messages[2]
        assert launcher.runtime_calls() == []
        assert docker_agent.manager.get("/v1/containers").json()["containers"] == []
    finally:
        huge.remove(force=True)


@pytest.mark.docker
def test_a_bundle_that_only_mentions_the_request_goes_to_the_plain_runtime(docker_agent, root, capsys):
    """The launcher's grep also matches a command naming the variable; the agent reads the bundle: plain."""
    launcher = Launcher(root, docker_agent.hook_socket, capsys)
    bundle = launcher.bundle(["PATH=/bin"])
    spec = _spec(bundle)
    spec["process"]["args"] = ["echo", f"{Env.REQUEST_MEMORY}=1GiB"]
    (bundle / "config.json").write_text(json.dumps(spec))
    before = (bundle / "config.json").read_bytes()
    result = launcher.create(bundle, "f" * 64)
    assert result.returncode == 0, launcher.logged()
    assert [call.split()[0] for call in launcher.runtime_calls()] == ["plain"]
    assert (bundle / "config.json").read_bytes() == before


@pytest.mark.docker
def test_the_agent_drops_bad_lines_on_its_pipe_and_keeps_serving(docker_agent, docker_client, test_image, root,
                                                                 capsys):
    """Whoever can write the pipe is root, but a broken or hostile line must still cost nothing but a log line."""
    fifo = hookpipe.fifo_path(docker_agent.hook_socket)
    outside = root / "agent.r.1"
    os.mkfifo(outside)
    lines = [b"one-field\n", b"four fields in all\n", b"\xff\xfe not utf-8 at all\n",
             f"{outside} /b {'a' * 64}\n".encode(),  # a reply pipe outside the agent's folder
             f"{hookpipe.reply_prefix(docker_agent.hook_socket)}999999 /b {'a' * 64}\n".encode(),  # no such pipe
             b"x" * 10000 + b"\n"]
    with open(fifo, "wb", buffering=0) as pipe:
        for line in lines:
            pipe.write(line)
    launcher = Launcher(root, docker_agent.hook_socket, capsys)
    task = docker_client.containers.create(test_image, ["true"], network_mode="none",
                                           environment={Env.REQUEST_MEMORY: str(1 << 30)},
                                           labels={"gpumgr.node": docker_agent.node})
    try:
        result = launcher.create(launcher.bundle([f"{Env.REQUEST_MEMORY}={1 << 30}"]), task.id)
        assert result.returncode == 0, launcher.logged()
    finally:
        task.remove(force=True)
    assert docker_agent.popen.poll() is None
    log = docker_agent.output()
    assert log.count("dropped a malformed line on the runtime hook's pipe") == 4
    assert "is not one of this agent's" in log and "its reply pipe cannot be opened" in log


# --- the pipe's edges, with the agent's own HookFifo in this process ----------------------------------

def _request_taken(fifo: HookFifo, deadline: float = 20.0) -> Any:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        requests = fifo.ready()
        if requests:
            return requests[0]
        time.sleep(0.01)
    raise AssertionError("the launcher sent no request")


def test_an_agent_that_dies_after_taking_the_request_is_an_end_of_file_at_once(root, capsys):
    socket_path = str(root / "run" / "agent.sock")
    fifo = HookFifo(socket_path)
    launcher = Launcher(root, socket_path, capsys)
    bundle = launcher.bundle([f"{Env.REQUEST_MEMORY}=1GiB"])
    proc = subprocess.Popen(launcher.argv(bundle, "a" * 64), env=launcher.env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        request = _request_taken(fifo)
        assert (request.bundle, request.container_id) == (str(bundle), "a" * 64)
        started = time.monotonic()
        fifo.close()  # as the kernel does for an agent killed with -9: its end of the reply pipe closes
        assert proc.wait(timeout=10) == 1
        assert time.monotonic() - started < 5  # not the 20 s watchdog: the end of file itself
    finally:
        proc.kill()
        proc.communicate()
    assert "the agent ended before it answered" in launcher.logged()[-1]["msg"]
    assert launcher.runtime_calls() == []


def test_a_stuck_agent_fails_the_create_after_the_wait_and_leaves_no_pipe(root, capsys):
    socket_path = str(root / "run" / "agent.sock")
    fifo = HookFifo(socket_path)  # never read: a stuck agent
    launcher = Launcher(root, socket_path, capsys)
    try:
        result = launcher.create(launcher.bundle([f"{Env.REQUEST_MEMORY}=1GiB"]), "b" * 64, wait=20,
                                 **{Env.HOOK_PIPE_WAIT: "1"})
    finally:
        fifo.close()
    assert result.returncode == -9
    assert "took no request off" in launcher.logged()[-1]["msg"]
    assert launcher.runtime_calls() == [] and not list((root / "run").glob("*.r.*"))


def test_each_answer_word_runs_what_it_says(root, capsys):
    """``python`` falls back to the Python hook (here: gone, so 127 and its message); ``ok`` and ``plain`` exec."""
    socket_path = str(root / "run" / "agent.sock")
    fifo = HookFifo(socket_path)
    launcher = Launcher(root, socket_path, capsys)
    bundle = launcher.bundle([f"{Env.REQUEST_MEMORY}=1GiB"])
    try:
        outcomes = {}
        for word in (hookpipe.OK, hookpipe.PLAIN, hookpipe.PYTHON):
            proc = subprocess.Popen(launcher.argv(bundle, "c" * 64), env=launcher.env(), stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
            fifo.answer(_request_taken(fifo), word)
            proc.communicate(timeout=10)
            outcomes[word] = proc.returncode
    finally:
        fifo.close()
    assert outcomes == {hookpipe.OK: 0, hookpipe.PLAIN: 0, hookpipe.PYTHON: 127}
    assert [call.split()[0] for call in launcher.runtime_calls()] == ["gpu", "plain"]
    assert "is not there any more" in launcher.logged()[-1]["msg"]


def test_without_a_live_agent_behind_the_pipe_the_launcher_uses_the_socket_path(root, capsys):
    """A pipe and PID file left by an agent killed with -9: no wait on a pipe nobody reads."""
    socket_path = str(root / "run" / "agent.sock")
    fifo = HookFifo(socket_path)
    fifo.pid_file.write_text("2147483646\n")  # no such process
    launcher = Launcher(root, socket_path, capsys)
    try:
        result = launcher.create(launcher.bundle([f"{Env.REQUEST_MEMORY}=1GiB"]), "d" * 64, wait=10)
    finally:
        fifo.close()
    assert result.returncode == 127  # the Python hook's path (its Python is gone here), not a hang
    assert fifo.path.exists() is False


def test_the_pid_file_names_the_agent_as_the_host_sees_it(root, monkeypatch):
    """In a container the agent reads the host's /proc (``proc_root``): its own getpid() means another process there."""
    from gpumgr.agent import procmap
    from gpumgr.agent.hook import hookfifo
    assert hookfifo.host_pid() == os.getpid()
    host_proc = root / "host-proc"
    host_proc.mkdir()
    (host_proc / "self").symlink_to("424242")  # what the host's /proc/self says to this process
    monkeypatch.setattr(procmap, "_root", str(host_proc))
    fifo = HookFifo(str(root / "run" / "agent.sock"))
    try:
        assert fifo.pid_file.read_text() == "424242\n"
    finally:
        fifo.close()
    assert not fifo.pid_file.exists() and not fifo.path.exists()


class _FailingEngine:
    """A Docker runtime whose engine fails mid-request (its API gone, say): only what the relay calls."""

    mps = False

    def holder_of(self, container_id: str) -> None:
        return None

    def engine_request(self, message: Any) -> Any:
        raise ConnectionError("the engine's API socket is gone")

    def track_task(self, *args: Any) -> Any:
        raise AssertionError("nothing is granted")


def test_a_request_that_fails_inside_the_agent_is_still_answered(root, capsys):
    """Work runs on the agent's pool: an exception there must reach the launcher as a refusal, never a hang."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from gpumgr.agent.hook.hooklink import HookListener
    from gpumgr.agent.hook.hookrelay import HookRelay

    socket_path = str(root / "run" / "agent.sock")
    registered = threading.Event()
    registered.set()
    pool = ThreadPoolExecutor(2)
    relay = HookRelay(HookListener(socket_path, 5.0), link=None, runtime=_FailingEngine(),  # type: ignore[arg-type]
                      node="n1", registered=registered, fifo=HookFifo(socket_path), pool=pool)
    launcher = Launcher(root, socket_path, capsys)
    proc = subprocess.Popen(launcher.argv(launcher.bundle([f"{Env.REQUEST_MEMORY}=1GiB"]), "a" * 64),
                            env=launcher.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while proc.poll() is None and time.monotonic() < deadline:
            relay.on_ready(relay.descriptors())
            time.sleep(0.01)
        assert proc.wait(timeout=5) == 1
    finally:
        proc.kill()
        proc.communicate()
        relay.close()
        pool.shutdown()
    assert "the agent failed to serve the request: the engine's API socket is gone" in launcher.logged()[-1]["msg"]
    assert launcher.runtime_calls() == []


@pytest.mark.parametrize("shape", ["a space", "long"])
def test_a_bundle_path_the_line_cannot_carry_takes_the_python_way(root, capsys, shape):
    """The line is space-separated and must be one write under PIPE_BUF: such a path never reaches the pipe."""
    socket_path = str(root / "run" / "agent.sock")
    fifo = HookFifo(socket_path)
    launcher = Launcher(root, socket_path, capsys)
    # 13 folders of 250 characters: over 3,250 characters in all
    bundle = root.joinpath(*["d" * 250] * 13) if shape == "long" else root / "with a space"
    bundle.mkdir(parents=True)
    (bundle / "config.json").write_text(json.dumps({"process": {"env": [f"{Env.REQUEST_MEMORY}=1GiB"]}}))
    try:
        result = launcher.create(bundle, "e" * 64, wait=10)
        assert fifo.ready() == []  # nothing was written to the pipe
    finally:
        fifo.close()
    assert result.returncode == 127  # the Python hook's path (its Python is gone here)
