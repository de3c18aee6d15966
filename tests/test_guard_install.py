"""``gpumgr plugin install --guard`` and ``uninstall`` against a private engine: in and out of its path, safely."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.guard_dockerd import GuardEngine
from tests.guardproc import GuardProc
from tests.images import IMAGE, busybox_tar
from tests.procs import ROOT

pytestmark = pytest.mark.usefixtures("docker_client")


def plugin_command(action: str, tmp, engine: GuardEngine, guard_socket: str, *extra: str):
    paths = ["--daemon-config", str(engine.dir / "daemon.json"), "--dockerd-pidfile", str(engine.dir / "docker.pid"),
             "--bin-dir", str(tmp / "bin"), "--cli-plugins-dir", str(tmp / "cli"),
             "--runtime-config", str(tmp / "runtime.json"), "--systemd-dir", str(tmp / "systemd"),
             "--guard-state", str(tmp / "guard-install.json"), "--guard-socket", guard_socket,
             "--docker-host", f"unix://{engine.socket}"]
    if action == "install":
        paths += ["--hook-socket", str(tmp / "hook.sock")]
    return subprocess.run([sys.executable, "-m", "gpumgr", "plugin", action, *paths, *extra], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def engine():
    engine = GuardEngine(busybox_tar(), plugin=None)
    yield engine
    engine.stop()


def test_install_puts_the_guard_in_force_and_uninstall_takes_it_out_before_stopping_it(tmp_path, engine):
    guard = GuardProc(tmp_path)
    before = (engine.dir / "daemon.json").read_bytes()
    try:
        done = plugin_command("install", tmp_path, engine, str(guard.socket), "--guard", "--reload")
        assert done.returncode == 0, done.stderr
        assert f"added {guard.name} to authorization-plugins" in done.stdout
        # the unit is the one 'gpumgr generate systemd guard' prints, on the socket this install was given
        unit = (tmp_path / "systemd" / "gpumgr-guard.service").read_text()
        (start,) = [line for line in unit.splitlines() if line.startswith("ExecStart=")]
        assert f"guard --socket {guard.socket} --state /var/lib/gpumgr-guard/guard-state.json --config" in start
        assert "WantedBy=multi-user.target docker.service" in unit and "Before=docker.service" in unit
        assert json.loads((engine.dir / "daemon.json").read_text())["authorization-plugins"] == [guard.name]
        denied = engine.docker("create", "--privileged", IMAGE, "true", check=False)
        assert "gpumgr guard:" in denied.stderr, denied.stderr
        removed = plugin_command("uninstall", tmp_path, engine, str(guard.socket))
        assert removed.returncode == 0, removed.stderr + removed.stdout
        assert f"the engine no longer uses {guard.name}" in removed.stdout
    finally:
        guard.remove()
    # the guard is gone and the engine does not miss it: same process, everything answers
    assert engine.proc.poll() is None and engine.docker("ps").returncode == 0
    assert engine.docker("create", "--privileged", IMAGE, "true").returncode == 0
    after = json.loads((engine.dir / "daemon.json").read_text())  # uninstall names the engine's runtimes explicitly
    assert "authorization-plugins" not in after
    assert all(after.get(key) == value for key, value in json.loads(before).items()), (before, after)
    assert not (tmp_path / "systemd" / "gpumgr-guard.service").exists()


def test_install_refuses_when_the_guard_does_not_answer(tmp_path, engine):
    before = (engine.dir / "daemon.json").read_bytes()
    done = plugin_command("install", tmp_path, engine, "/run/docker/plugins/gpumgr-guard-absent.sock", "--guard",
                          "--reload")
    assert done.returncode == 2 and "does not answer" in done.stderr
    assert (engine.dir / "daemon.json").read_bytes() == before
    assert engine.docker("ps").returncode == 0


def test_install_refuses_when_dockerd_names_a_plugin_by_flag(tmp_path):
    guard = GuardProc(tmp_path)
    flagged = GuardEngine(busybox_tar(), plugin=guard.name)
    try:
        before = (flagged.dir / "daemon.json").read_bytes()
        done = plugin_command("install", tmp_path, flagged, str(guard.socket), "--guard", "--reload")
        assert done.returncode == 2 and "--authorization-plugin" in done.stderr
        assert (flagged.dir / "daemon.json").read_bytes() == before
    finally:
        flagged.stop()
        guard.remove()


def test_install_refuses_to_guard_behind_the_nvidia_default_runtime(tmp_path, engine):
    daemon = engine.dir / "daemon.json"
    daemon.write_text(json.dumps({**json.loads(daemon.read_text()), "default-runtime": "nvidia"}))
    before = daemon.read_bytes()
    done = plugin_command("install", tmp_path, engine, "/run/docker/plugins/gpumgr-guard-unused.sock", "--guard",
                          "--no-default-runtime")
    assert done.returncode == 2 and "default runtime is 'nvidia'" in done.stderr
    assert daemon.read_bytes() == before
