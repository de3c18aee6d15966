"""``gpumgr generate systemd manager|agent``: the units are valid, and what they run starts and stops cleanly.

Each unit's ``ExecStart`` is run as systemd runs it (its command line split as systemd splits it, its
``Environment=`` and ``EnvironmentFile=`` applied, ``KillSignal`` to stop it) against real processes.
"""

from __future__ import annotations

import configparser
import os
import shlex
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import requests

from gpumgr.cli import main
from gpumgr.systemd import PARTS, STOP_TIMEOUT
from tests.procs import ManagerProc, free_port, wait_for


def generate(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    capsys.readouterr()
    assert main(["generate", "systemd", *argv]) == 0
    return capsys.readouterr().out


def parse(text: str) -> configparser.ConfigParser:
    unit = configparser.ConfigParser(interpolation=None, strict=True)
    unit.optionxform = str  # type: ignore[assignment,method-assign]  # systemd's keys are case-sensitive
    unit.read_string(text)
    return unit


def run_exec_start(unit: configparser.ConfigParser, log: Path) -> subprocess.Popen[bytes]:
    """Start the unit's ExecStart with its environment, as systemd would (no shell)."""
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    for assignment in shlex.split(unit["Service"].get("Environment", "")):
        key, _, value = assignment.partition("=")
        env[key] = value
    env_file = unit["Service"].get("EnvironmentFile")
    if env_file:
        for line in Path(env_file).read_text().splitlines():
            key, _, value = line.partition("=")
            env[key.strip()] = value.strip()
    argv = shlex.split(unit["Service"]["ExecStart"])
    assert Path(argv[0]).is_absolute() and os.access(argv[0], os.X_OK), argv[0]
    return subprocess.Popen(argv, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT, cwd="/")


def stop_as_systemd(proc: subprocess.Popen[bytes], unit: configparser.ConfigParser) -> int:
    assert unit["Service"]["KillSignal"] == "SIGTERM"
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(int(unit["Service"]["TimeoutStopSec"]))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError("the part did not stop on SIGTERM within TimeoutStopSec") from None


@pytest.mark.parametrize("part", sorted(PARTS))
def test_the_unit_has_what_systemd_needs(capsys: pytest.CaptureFixture[str], part: str, tmp_path: Path) -> None:
    config = tmp_path / "settings.yaml"
    unit = parse(generate(capsys, part, "--config", str(config)))
    service = unit["Service"]
    argv = shlex.split(service["ExecStart"])
    assert Path(argv[0]).is_absolute() and PARTS[part].command[0] in argv
    assert argv[argv.index("--config") + 1] == str(config)
    assert ("--state" if PARTS[part].state_file else "--state-dir") in argv
    assert service["Restart"] == PARTS[part].restart and service["StateDirectory"] == PARTS[part].state_directory
    assert service["KillMode"] == "mixed" and int(service["TimeoutStopSec"]) == STOP_TIMEOUT
    assert unit["Install"]["WantedBy"].split()[0] == "multi-user.target"
    if part == "agent":
        assert "docker.service" in unit["Unit"]["After"].split()
    if part == "guard":  # the engine calls it on every request: it comes first and always comes back
        assert unit["Unit"]["Before"] == "docker.service" and service["Restart"] == "always"
        assert "docker.service" in unit["Install"]["WantedBy"].split()  # starting the engine starts the guard


@pytest.mark.parametrize("part", sorted(PARTS))
def test_systemd_analyze_accepts_the_unit(capsys: pytest.CaptureFixture[str], part: str, tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    path = tmp_path / f"gpumgr-{part}.service"
    path.write_text(generate(capsys, part))
    result = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and f"gpumgr-{part}.service" not in result.stderr, result.stderr


def test_the_manager_unit_runs_the_manager_and_sigterm_stops_it_cleanly(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    port = free_port()
    env_file = tmp_path / "manager.env"
    env_file.write_text(f"GPUMGR_API=127.0.0.1:{port}\nGPUMGR_AGENTS=tcp://127.0.0.1:{free_port()}\n")
    unit = parse(generate(capsys, "manager", "--state-dir", str(tmp_path / "state"), "--env-file", str(env_file)))
    assert "StateDirectory" not in unit["Service"]  # an explicit folder is not systemd's to create
    proc = run_exec_start(unit, tmp_path / "manager.log")
    try:
        wait_for(lambda: _answers(f"http://127.0.0.1:{port}/healthz"), 20, what="the unit's manager to answer")
        assert (tmp_path / "state").is_dir()
    finally:
        code = stop_as_systemd(proc, unit)
    assert code == 0, (tmp_path / "manager.log").read_text()


def test_the_agent_unit_joins_and_sigterm_stops_it_cleanly(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    manager = ManagerProc(tmp_path)
    try:
        env_file = tmp_path / "agent.env"
        env_file.write_text(f"GPUMGR_MANAGER={manager.endpoint}\nGPUMGR_JOIN_TOKEN={manager.token()}\n"
                            "GPUMGR_NODE=unit-node\nGPUMGR_GPUS=sim:1x8GiB\nGPUMGR_RUNTIME=process\n")
        unit = parse(generate(capsys, "agent", "--state-dir", str(tmp_path / "agent-state"),
                              "--env-file", str(env_file)))
        proc = run_exec_start(unit, tmp_path / "agent.log")
        try:
            wait_for(lambda: (manager.node("unit-node") or {}).get("state") == "ready", 20,
                     what="the unit's agent to join")
        finally:
            code = stop_as_systemd(proc, unit)
        assert code == 0, (tmp_path / "agent.log").read_text()
    finally:
        manager.stop()


def _answers(url: str) -> bool:
    try:
        return requests.get(url, timeout=1).ok
    except requests.ConnectionError:
        return False


def test_unknown_part_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["generate", "systemd", "guardian"])
    assert exc.value.code == 2 and "invalid choice" in capsys.readouterr().err
