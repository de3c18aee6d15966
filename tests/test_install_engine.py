"""Install, reload, uninstall, reload on a real engine (a private dockerd), then a plain ``docker run`` works.

The defect this guards against: uninstall used to take ``default-runtime`` out of daemon.json (or put
back a copy without it) and remove the launcher; dockerd keeps its old default runtime on SIGHUP when
the file names none, so every ``docker run`` then failed with ``fork/exec .../gpumgr-runtime: no such
file or directory`` until dockerd was restarted.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tests.dockerd import PrivateEngine
from tests.images import IMAGE, busybox_tar
from tests.procs import ROOT

pytestmark = pytest.mark.docker


@pytest.fixture
def engine_factory(docker_client) -> Iterator[Any]:
    """Start private engines with a given daemon.json; stop them all at the end."""
    if shutil.which("dockerd") is None:
        pytest.fail("dockerd is needed to test install on a real engine")
    started: list[PrivateEngine] = []

    def start(daemon_json: dict[str, Any] | None) -> PrivateEngine:
        started.append(PrivateEngine(busybox_tar(shutil.which("busybox") or "/bin/busybox"), daemon_json))
        return started[-1]

    yield start
    for engine in started:
        engine.stop()


def gpumgr_plugin(engine: PrivateEngine, action: str, *extra: str) -> subprocess.CompletedProcess[str]:
    """``gpumgr plugin ACTION`` with every path inside the engine's own folder."""
    paths = ["--daemon-config", str(engine.daemon_json), "--runtime-config", str(engine.dir / "runtime.json"),
             "--bin-dir", str(engine.dir / "bin"),
             "--cli-plugins-dir", str(engine.dir / "docker-config" / "cli-plugins")]
    if action != "status":
        paths += ["--dockerd-pidfile", str(engine.pidfile)]
    return subprocess.run([sys.executable, "-m", "gpumgr", "plugin", action, *paths, "--docker-host", engine.host,
                           *extra], cwd=ROOT, capture_output=True, text=True, timeout=120)


def runs_a_container(engine: PrivateEngine) -> str:
    return engine.docker("run", "--rm", "--network", "none", IMAGE, "echo", "container ran").stdout.strip()


@pytest.mark.parametrize("before", [None, {"log-level": "warn"}, {"default-runtime": "runc", "debug": False}],
                         ids=["no-daemon-json", "other-settings", "runc-named"])
def test_install_reload_uninstall_reload_leaves_an_engine_that_runs_containers(engine_factory, before) -> None:
    engine = engine_factory(before)
    assert engine.info()["DefaultRuntime"] == "runc"

    installed = gpumgr_plugin(engine, "install", "--reload")
    assert installed.returncode == 0, installed.stderr
    assert "becomes the default runtime of EVERY container" in installed.stdout
    assert "reloaded dockerd: it runs new containers under 'gpumgr'" in installed.stdout
    info = engine.info()
    assert info["DefaultRuntime"] == "gpumgr" and "gpumgr" in info["Runtimes"]
    assert runs_a_container(engine) == "container ran"  # through the hook's launcher, on to runc
    status = gpumgr_plugin(engine, "status")
    assert status.returncode == 0 and "engine        default runtime 'gpumgr'" in status.stdout, status.stdout

    removed = gpumgr_plugin(engine, "uninstall", "--reload")
    assert removed.returncode == 0, removed.stderr
    assert 'default-runtime: "gpumgr" -> "runc"' in removed.stdout
    assert ("reloaded dockerd: it runs new containers under 'runc' and no longer lists runtime 'gpumgr'"
            in removed.stdout)
    info = engine.info()
    assert info["DefaultRuntime"] == "runc" and "gpumgr" not in info["Runtimes"]
    assert not (engine.dir / "bin" / "gpumgr-runtime").exists()
    assert runs_a_container(engine) == "container ran"
    config = json.loads(engine.daemon_json.read_text())
    assert config["default-runtime"] == "runc" and all(config.get(k) == v for k, v in (before or {}).items())
    status = gpumgr_plugin(engine, "status")
    assert status.returncode == 0 and "not registered" in status.stdout, status.stdout


def test_uninstall_puts_back_the_default_runtime_install_replaced(engine_factory) -> None:
    runc = shutil.which("runc", path="/usr/sbin:/usr/bin:/sbin:/bin")
    engine = engine_factory({"default-runtime": "other", "runtimes": {"other": {"path": runc}}})
    assert gpumgr_plugin(engine, "install", "--reload").returncode == 2  # another default: --force needed
    assert gpumgr_plugin(engine, "install", "--reload", "--force").returncode == 0
    assert engine.info()["DefaultRuntime"] == "gpumgr"
    removed = gpumgr_plugin(engine, "uninstall", "--reload")
    assert removed.returncode == 0, removed.stderr
    info = engine.info()
    assert info["DefaultRuntime"] == "other" and "gpumgr" not in info["Runtimes"]
    assert runs_a_container(engine) == "container ran"


def test_dry_run_changes_nothing_and_status_finds_an_engine_that_did_not_reload(engine_factory) -> None:
    engine = engine_factory({"log-level": "warn"})
    before = engine.daemon_json.read_bytes()
    dry = gpumgr_plugin(engine, "install", "--dry-run")
    assert dry.returncode == 0 and 'default-runtime: (not set) -> "gpumgr"' in dry.stdout
    assert "nothing was written" in dry.stdout and engine.daemon_json.read_bytes() == before
    assert "would have: installed the OCI runtime hook" in dry.stdout
    assert not (engine.dir / "bin").exists()

    assert gpumgr_plugin(engine, "install").returncode == 0  # no --reload: the engine still runs runc
    status = gpumgr_plugin(engine, "status")
    assert status.returncode == 1 and "has not loaded daemon.json" in status.stdout, status.stdout
    dry = gpumgr_plugin(engine, "uninstall", "--dry-run")
    assert dry.returncode == 0 and "nothing was changed" in dry.stdout
    assert (engine.dir / "bin" / "gpumgr-runtime").exists() and json.loads(engine.daemon_json.read_text())[
        "default-runtime"] == "gpumgr"
