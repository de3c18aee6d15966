"""``gpumgr plugin install`` / ``uninstall`` / ``status`` on temporary folders: never /etc/docker, never a real engine.

The same on a real (private) engine: tests/test_install_engine.py.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest

from gpumgr.cli import main
from gpumgr.wire import envelope

#: An original daemon.json in a layout install would never write: restoring it must give these bytes.
ORIGINAL = (b'{ "log-level":"warn",\n\t"runtimes": {"nvidia": {"path": "nvidia-container-runtime",'
            b' "runtimeArgs": []}}}\n')
NVIDIA_DEFAULT = (b'{"default-runtime": "nvidia",\n "runtimes": {"nvidia": {"path": "nvidia-container-runtime"}},'
                  b' "debug": false}')
#: What uninstall leaves where install created daemon.json: dockerd keeps its old default on a reload
#: when the file names none, so the file must name runc (and the runtimes, even none) outright.
RUNC_EXPLICIT = b'{\n  "default-runtime": "runc",\n  "runtimes": {}\n}\n'
GRANT_ENV = {"NVIDIA_VISIBLE_DEVICES": "GPU-1111-2222", "GPUMGR_GPU_MEMORY": "1073741824", "GPUMGR_GRANT": "g-1"}


class Host:
    """A fake host under ``tmp_path``: its daemon.json, install folders and two fake runtimes that log their calls."""

    def __init__(self, root: Path, capsys: pytest.CaptureFixture[str]) -> None:
        self.root = root
        self.capsys = capsys
        self.daemon = root / "etc-docker" / "daemon.json"
        self.backup = root / "etc-docker" / "daemon.json.before-gpumgr"
        self.bin = root / "bin"
        self.plugins = root / "cli-plugins"
        self.config = root / "etc-gpumgr" / "runtime.json"
        self.hook = self.bin / "gpumgr-runtime"
        self.cli = self.plugins / "docker-gpu"
        self.calls = root / "runtime-calls"
        tools = root / "runtimes"
        tools.mkdir()
        self.nvidia = self._fake_runtime(tools / "nvidia-container-runtime", "nvidia")
        self.runc = self._fake_runtime(tools / "runc", "runc")

    def _fake_runtime(self, path: Path, name: str) -> Path:
        path.write_text(f'#!/bin/sh\necho "{name} $*" >> {self.calls}\n')
        path.chmod(0o755)
        return path

    def paths(self) -> list[str]:
        return ["--daemon-config", str(self.daemon), "--bin-dir", str(self.bin), "--cli-plugins-dir", str(self.plugins),
                "--runtime-config", str(self.config)]

    def install(self, *extra: str) -> tuple[int, str, str]:
        return self._run("install", "--runtime", str(self.nvidia), "--plain-runtime", str(self.runc), *extra)

    def uninstall(self, *extra: str) -> tuple[int, str, str]:
        return self._run("uninstall", *extra)

    def _run(self, action: str, *extra: str) -> tuple[int, str, str]:
        self.capsys.readouterr()
        code = main(["plugin", action, *self.paths(), *extra])
        out, err = self.capsys.readouterr()
        return code, out, err

    def tree(self) -> dict[str, bytes]:
        """Every file under the host's folders (not the fake runtimes) and its bytes."""
        return {str(p.relative_to(self.root)): p.read_bytes() for p in sorted(self.root.rglob("*"))
                if p.is_file() and p.parent.name != "runtimes" and p != self.calls}

    def daemon_json(self) -> dict[str, Any]:
        return json.loads(self.daemon.read_text())

    def runtime_calls(self) -> list[str]:
        return self.calls.read_text().splitlines() if self.calls.exists() else []


@pytest.fixture
def host(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Host:
    return Host(tmp_path, capsys)


def write_daemon(host: Host, data: bytes) -> None:
    host.daemon.parent.mkdir(parents=True, exist_ok=True)
    host.daemon.write_bytes(data)


# --- daemon.json -------------------------------------------------------------------------------------

def test_install_on_an_empty_host_and_uninstall_leaves_only_the_default_runtime(host: Host) -> None:
    code, out, _ = host.install()
    assert code == 0 and "must reload" in out and "systemctl reload docker" in out
    assert f"gpumgr plugin install changes {host.daemon}:" in out  # said before it was written
    assert 'default-runtime: (not set) -> "gpumgr"' in out and "EVERY container this engine creates" in out
    assert host.daemon_json() == {"runtimes": {"gpumgr": {"path": str(host.hook.resolve())}},
                                  "default-runtime": "gpumgr"}
    assert not host.backup.exists()  # there was nothing to back up
    for launcher in (host.hook, host.cli):
        assert stat.S_IMODE(launcher.stat().st_mode) == 0o755
        assert launcher.read_text().splitlines()[1].startswith("# installed by 'gpumgr plugin install'")
    settings = json.loads(host.config.read_text())
    assert settings["runtime"] == str(host.nvidia) and settings["plain_runtime"] == str(host.runc)
    metadata = subprocess.run([str(host.cli), "docker-cli-plugin-metadata"], capture_output=True, text=True)
    assert json.loads(metadata.stdout)["SchemaVersion"] == "0.1.0"

    code, out, _ = host.uninstall()
    assert code == 0 and "must reload" in out and 'default-runtime: "gpumgr" -> "runc"' in out
    # launchers and settings are gone; daemon.json names runc outright, or a reload would keep gpumgr the default
    assert host.tree() == {"etc-docker/daemon.json": RUNC_EXPLICIT}


def test_other_settings_are_kept_and_uninstall_restores_them_naming_the_default_runtime(host: Host) -> None:
    write_daemon(host, ORIGINAL)
    host.daemon.chmod(0o600)
    assert host.install()[0] == 0
    config = host.daemon_json()
    assert config["log-level"] == "warn" and config["default-runtime"] == "gpumgr"
    assert config["runtimes"]["nvidia"] == {"path": "nvidia-container-runtime", "runtimeArgs": []}
    assert host.backup.read_bytes() == ORIGINAL
    assert stat.S_IMODE(host.daemon.stat().st_mode) == 0o600  # the file's mode is kept

    code, out, _ = host.uninstall()
    assert code == 0 and f"put {host.daemon} back as it was before install" in out and "must reload" in out
    assert host.daemon_json() == {**json.loads(ORIGINAL), "default-runtime": "runc"}
    assert stat.S_IMODE(host.daemon.stat().st_mode) == 0o600
    assert set(host.tree()) == {"etc-docker/daemon.json"}  # the backup went with the rest


@pytest.mark.parametrize("bad", [b'{"runtimes": {', b"[1, 2]", b'{"runtimes": ["runc"]}', b'{"default-runtime": 1}',
                                 b"\xff\xfe"])
def test_a_malformed_daemon_json_stops_install_before_anything_is_written(host: Host, bad: bytes) -> None:
    write_daemon(host, bad)
    code, _, err = host.install()
    assert code != 0 and str(host.daemon) in err and "nothing was written" in err
    assert host.tree() == {"etc-docker/daemon.json": bad}
    assert not host.bin.exists() and not host.plugins.exists() and not host.config.parent.exists()


def test_another_default_runtime_is_not_replaced_without_force(host: Host) -> None:
    write_daemon(host, NVIDIA_DEFAULT)
    code, out, err = host.install()
    assert code != 0 and "'nvidia'" in err and "--force" in err and "nothing was written" in err
    assert host.tree() == {"etc-docker/daemon.json": NVIDIA_DEFAULT}

    code, out, _ = host.install("--force")
    assert code == 0 and "replaced default runtime 'nvidia'" in out
    assert host.daemon_json()["default-runtime"] == "gpumgr" and "nvidia" in host.daemon_json()["runtimes"]
    assert host.install()[0] == 0  # gpumgr is the default now: a re-install needs no --force
    assert host.uninstall()[0] == 0
    assert host.daemon.read_bytes() == NVIDIA_DEFAULT and not host.backup.exists()


def test_no_default_runtime_registers_beside_another_default(host: Host) -> None:
    write_daemon(host, NVIDIA_DEFAULT)
    assert host.install("--no-default-runtime")[0] == 0
    assert host.daemon_json()["default-runtime"] == "nvidia" and "gpumgr" in host.daemon_json()["runtimes"]
    assert host.uninstall()[0] == 0 and host.daemon.read_bytes() == NVIDIA_DEFAULT


def test_runc_as_the_default_is_replaced_without_force_and_put_back(host: Host) -> None:
    original = b'{"default-runtime": "runc", "runtimes": {}}'
    write_daemon(host, original)
    assert host.install()[0] == 0 and host.daemon_json()["default-runtime"] == "gpumgr"
    assert host.uninstall()[0] == 0 and host.daemon.read_bytes() == original  # it names both: byte for byte


def test_uninstall_after_the_file_was_edited_takes_out_only_what_install_added(host: Host) -> None:
    write_daemon(host, NVIDIA_DEFAULT)
    assert host.install("--force")[0] == 0
    edited = {**host.daemon_json(), "debug": True, "max-concurrent-downloads": 5}  # someone's edits since
    host.daemon.write_text(json.dumps(edited))
    code, out, _ = host.uninstall()
    assert code == 0 and "not as install left it" in out and 'default-runtime: "gpumgr" -> "nvidia"' in out
    assert host.daemon_json() == {"default-runtime": "nvidia", "debug": True, "max-concurrent-downloads": 5,
                                  "runtimes": {"nvidia": {"path": "nvidia-container-runtime"}}}
    assert host.backup.read_bytes() == NVIDIA_DEFAULT  # kept, to compare with
    assert not host.hook.exists() and not host.cli.exists() and not host.config.exists()


def test_reinstall_is_idempotent_and_keeps_the_first_backup(host: Host) -> None:
    write_daemon(host, ORIGINAL)
    assert host.install()[0] == 0
    installed = host.tree()
    code, out, _ = host.install()
    assert code == 0 and "nothing to reload" in out and host.tree() == installed

    code, out, _ = host.install("--hook-socket", "/run/other.sock")  # only the settings change
    assert code == 0 and "nothing to reload" in out and host.backup.read_bytes() == ORIGINAL
    moved = str(host.root / "bin2")
    code, out, _ = host.install("--bin-dir", moved)  # daemon.json changes again: the backup stays the original
    assert code == 0 and "must reload" in out and host.backup.read_bytes() == ORIGINAL
    assert host.daemon_json()["runtimes"]["gpumgr"]["path"] == str(Path(moved, "gpumgr-runtime").resolve())
    assert host.uninstall("--bin-dir", moved)[0] == 0
    assert host.daemon_json() == {**json.loads(ORIGINAL), "default-runtime": "runc"}
    assert not Path(moved, "gpumgr-runtime").exists()


def test_uninstall_is_idempotent_and_refuses_a_malformed_daemon_json(host: Host) -> None:
    write_daemon(host, ORIGINAL)
    assert host.install()[0] == 0
    assert host.uninstall()[0] == 0
    after = host.tree()
    code, out, _ = host.uninstall()
    assert code == 0 and "nothing to uninstall" in out and "nothing to reload" in out and host.tree() == after

    assert host.install()[0] == 0
    host.daemon.write_text('{"runtimes": ')
    installed = host.tree()
    code, _, err = host.uninstall()
    assert code != 0 and "not valid JSON" in err and host.tree() == installed


def test_uninstall_leaves_a_launcher_it_did_not_write(host: Host) -> None:
    host.bin.mkdir()
    host.hook.write_text("#!/bin/sh\nexec runc \"$@\"\n")
    code, out, _ = host.uninstall()
    assert code == 0 and "did not write it" in out and host.hook.exists()


# --- crash safety ------------------------------------------------------------------------------------

def test_a_failed_write_leaves_the_original_daemon_json_whole_and_undoes_the_rest(
        host: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    write_daemon(host, ORIGINAL)
    real_replace = os.replace

    def crash_on_daemon_json(src: Any, dst: Any) -> None:
        if Path(dst).name == "daemon.json":
            raise OSError(28, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_daemon_json)
    code, _, err = host.install()
    assert code != 0 and "No space left" in err
    assert host.tree() == {"etc-docker/daemon.json": ORIGINAL}  # no launcher, settings, backup or temporary file
    assert not host.bin.exists() and not host.config.parent.exists()


def test_files_are_replaced_by_rename_never_rewritten_in_place(host: Host) -> None:
    """A runtime call executing the launcher keeps reading the old file while a re-install replaces it."""
    write_daemon(host, ORIGINAL)
    daemon_inode = host.daemon.stat().st_ino
    assert host.install()[0] == 0 and host.daemon.stat().st_ino != daemon_inode
    hook_inode = host.hook.stat().st_ino
    assert host.install("--plain-runtime", str(host.nvidia))[0] == 0  # the launcher's text changes
    assert host.hook.stat().st_ino != hook_inode


# --- the installed launcher: which runtime, which settings -------------------------------------------

def _bundle(root: Path, env: list[str]) -> Path:
    bundle = root / "bundle"
    bundle.mkdir(exist_ok=True)
    (bundle / "config.json").write_text(json.dumps({"process": {"env": env, "args": ["sh"]}}))
    return bundle


def _run_launcher(host: Host, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMGR_")}
    env["PATH"] = "/usr/bin:/bin"
    return subprocess.run([str(host.hook), *argv], env=env, capture_output=True, text=True, timeout=30)


@pytest.fixture
def short_dir() -> Any:
    """A folder with a short path: a Unix socket's path must fit in 108 bytes."""
    folder = tempfile.mkdtemp(prefix="gi-", dir="/tmp")
    yield Path(folder)
    shutil.rmtree(folder, ignore_errors=True)


def test_containers_that_ask_gpumgr_for_nothing_run_under_plain_runc(host: Host) -> None:
    """A CUDA image's NVIDIA_VISIBLE_DEVICES=all must not reach the NVIDIA runtime: that would expose every GPU."""
    assert host.install()[0] == 0
    bundle = _bundle(host.root, ["PATH=/bin", "NVIDIA_VISIBLE_DEVICES=all"])
    log = host.root / "log.json"
    result = _run_launcher(host, "--root", "/r", "--log", str(log), "create", "--bundle", str(bundle), "c1")
    assert result.returncode == 0, result.stderr
    assert _run_launcher(host, "--root", "/r", "start", "c1").returncode == 0
    assert _run_launcher(host, "--root", "/r", "delete", "--force", "c1").returncode == 0
    assert host.runtime_calls() == [f"runc --root /r --log {log} create --bundle {bundle} c1",
                                    "runc --root /r start c1", "runc --root /r delete --force c1"]


def test_the_installed_hook_uses_the_runtime_config_and_hook_socket_it_was_installed_with(
        host: Host, short_dir: Path) -> None:
    socket_path = short_dir / "agent.sock"
    host.config = host.root / "elsewhere" / "gpumgr-runtime.json"
    assert host.install("--hook-socket", str(socket_path))[0] == 0
    assert json.loads(host.config.read_text())["hook_socket"] == str(socket_path)
    bundle = _bundle(host.root, ["PATH=/bin", "GPUMGR_REQUEST_MEMORY=1073741824", "NVIDIA_VISIBLE_DEVICES=all"])
    log = host.root / "log.json"
    argv = ("--root", "/r", "--log", str(log), "create", "--bundle", str(bundle), "c" * 64)

    refused = _run_launcher(host, *argv)  # no agent yet: the refusal names the socket the settings file gives
    assert refused.returncode == 1 and host.runtime_calls() == []
    assert f"no gpumgr agent listens on {socket_path}" in log.read_text()

    requests: list[dict[str, Any]] = []
    agent = _fake_agent(socket_path, requests)
    granted = _run_launcher(host, *argv)
    agent.join(10)
    assert granted.returncode == 0, granted.stderr
    assert requests and requests[0]["body"]["gpu_memory"] == 1 << 30
    assert host.runtime_calls() == [f"nvidia {' '.join(argv)}"]  # a granted container goes to the GPU runtime
    spec = json.loads((bundle / "config.json").read_text())
    assert "NVIDIA_VISIBLE_DEVICES=GPU-1111-2222" in spec["process"]["env"]  # pinned to its grant, not "all"
    assert "NVIDIA_VISIBLE_DEVICES=all" not in spec["process"]["env"]


def _fake_agent(path: Path, requests: list[dict[str, Any]]) -> threading.Thread:
    """Answer one ``reserve`` on the hook socket ``path`` with a grant of GPU-1111-2222."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)

    def receive(conn: socket.socket, size: int) -> bytes:
        data = b""
        while len(data) < size:
            chunk = conn.recv(size - len(data))
            if not chunk:
                raise ConnectionError("closed")
            data += chunk
        return data

    def serve() -> None:
        with server:
            server.settimeout(20)
            conn, _ = server.accept()
            with conn:
                (size,) = envelope.FRAME_HEADER.unpack(receive(conn, envelope.FRAME_HEADER.size))
                request = envelope.unpack(receive(conn, size))
                requests.append(request)
                body = {"ok": True, "result": {"env": GRANT_ENV, "grant": "g-1"}}
                conn.sendall(envelope.frame(envelope.pack("reply", body, reply_to=request["id"])))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def test_a_runtime_that_is_not_there_is_refused(host: Host) -> None:
    code, _, err = host._run("install", "--runtime", str(host.root / "missing"), "--plain-runtime", str(host.runc))
    assert code != 0 and "no such executable" in err and host.tree() == {}


# --- launchers whose Python is gone ------------------------------------------------------------------

def test_launchers_whose_python_is_gone_fail_with_127_and_say_which(
        host: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    """A virtual environment moved or deleted after install: the launchers say so instead of a bare 'not found'."""
    gone = host.root / "moved-venv" / "bin" / "python3"
    monkeypatch.setattr(sys, "executable", str(gone))
    assert host.install()[0] == 0
    cli = subprocess.run([str(host.cli), "nodes"], capture_output=True, text=True, timeout=30)
    assert cli.returncode == 127 and str(gone) in cli.stderr and "gpumgr plugin install" in cli.stderr
    metadata = subprocess.run([str(host.cli), "docker-cli-plugin-metadata"], capture_output=True, text=True)
    assert metadata.returncode == 0  # docker asks every plugin for this: it needs no Python

    bundle = _bundle(host.root, ["PATH=/bin", "GPUMGR_REQUEST_MEMORY=1GiB"])
    log = host.root / "log.json"
    created = _run_launcher(host, "--root", "/r", "--log", str(log), "create", "--bundle", str(bundle), "c1")
    assert created.returncode == 127 and str(gone) in created.stderr
    assert str(gone) in json.loads(log.read_text())["msg"]  # where dockerd reads a runtime's error from
    assert host.runtime_calls() == []  # the GPU container was not started unpinned
    plain = _run_launcher(host, "--root", "/r", "--log=" + str(log), "start", "c2")
    assert plain.returncode == 0 and host.runtime_calls() == ["runc --root /r --log=" + str(log) + " start c2"]


def test_status_names_a_launcher_whose_python_is_gone(host: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "executable", str(host.root / "gone" / "python3"))
    assert host.install()[0] == 0
    monkeypatch.undo()
    code, out, _ = host._run("status", "--docker-host", "unix:///nonexistent/docker.sock")
    assert code == 1 and f"runs {host.root / 'gone' / 'python3'} (NOT THERE)" in out
    assert "no Docker engine answers at unix:///nonexistent/docker.sock" in out
    assert "3 problem(s)" in out  # two launchers, one engine


def test_a_launcher_whose_python_no_longer_has_gpumgr_says_so(host: Host, tmp_path: Path) -> None:
    """The interpreter is there, gpumgr is not (uninstalled from it): exit 127 naming the missing module."""
    venv = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    assert host.install()[0] == 0
    text = host.cli.read_text().replace(shlex.quote(sys.executable), shlex.quote(str(venv / "bin" / "python")))
    text = text.replace(str(Path(sys.modules["gpumgr.plugin"].__path__[0])), str(tmp_path / "gone"))
    host.cli.write_text(text)
    result = subprocess.run([str(host.cli), "nodes"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 127 and "gpumgr is not installed for this Python" in result.stderr, result.stderr
