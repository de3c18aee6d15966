"""What the Docker engine itself has taken of an install: reload it, check it, and ``gpumgr plugin status``.

``daemon.json`` says what the engine *will* use after a reload; only the engine says what it uses now.
dockerd 20.10 and later reload ``default-runtime`` and ``runtimes`` on SIGHUP only when the file names
them: a file that leaves a key out keeps the value in force. So uninstall writes both keys outright
(:mod:`gpumgr.plugin.install.install`), and after a reload this module asks the engine (``docker info``) until
it reports what the file says, or says that it does not.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The runtime dockerd uses when nothing names another.
ENGINE_DEFAULT_RUNTIME = "runc"
#: Seconds to wait for a reloaded engine to report the new settings.
RELOAD_WAIT = 15.0
RELOAD_POLL = 0.2
#: The line of a launcher that names its Python: ``exec PYTHON -I -S -c ...``.
LAUNCHER_PYTHON = re.compile(r"^\s*exec (\S+) -I -S -c ", re.MULTILINE)


@dataclass(frozen=True)
class EngineView:
    """What the engine reports: its default runtime and the runtimes it knows."""

    default_runtime: str
    runtimes: frozenset[str]


def engine_view(docker_host: str | None) -> EngineView:
    """Ask the engine at ``docker_host`` (default: ``DOCKER_HOST`` or the local socket); OSError if none answers."""
    import docker

    try:
        client = docker.DockerClient(base_url=docker_host, timeout=10) if docker_host else docker.from_env(timeout=10)
        try:
            info: dict[str, Any] = client.info()
        finally:
            client.close()
    except docker.errors.DockerException as exc:
        where = docker_host or os.environ.get("DOCKER_HOST") or "the local socket"
        raise OSError(f"no Docker engine answers at {where} ({exc})") from exc
    return EngineView(str(info.get("DefaultRuntime", "")), frozenset(info.get("Runtimes") or {}))


def signal_reload(pidfile: Path) -> str | None:
    """Send SIGHUP to the dockerd whose pid ``pidfile`` holds; None, or why it could not."""
    try:
        os.kill(int(pidfile.read_text().strip()), signal.SIGHUP)
    except (OSError, ValueError) as exc:
        return f"could not signal dockerd through {pidfile} ({exc}); run: systemctl reload docker"
    return None


def reload_and_check(pidfile: Path, docker_host: str | None, default_runtime: str, registered: str,
                     present: bool) -> tuple[bool, str]:
    """Reload the engine and wait until it reports ``default_runtime`` and ``registered`` (not) among its runtimes.

    Returns whether it did, and a line saying what the engine now runs containers under, or what is wrong.
    """
    failed = signal_reload(pidfile)
    if failed:
        return False, failed
    deadline = time.monotonic() + RELOAD_WAIT
    view: EngineView | None = None
    while True:
        try:
            view = engine_view(docker_host)
        except OSError as exc:
            return False, f"sent SIGHUP to dockerd, but {exc}"
        if view.default_runtime == default_runtime and (registered in view.runtimes) == present:
            listed = "lists" if present else "no longer lists"
            return True, (f"reloaded dockerd: it runs new containers under {default_runtime!r} and {listed} runtime "
                          f"{registered!r} (docker info says so)")
        if time.monotonic() > deadline:
            break
        time.sleep(RELOAD_POLL)
    wanted = f"default runtime {default_runtime!r}, {'with' if present else 'without'} runtime {registered!r}"
    return False, (f"reloaded dockerd, but after {RELOAD_WAIT:.0f} s it still reports default runtime "
                   f"{view.default_runtime!r} and runtimes {sorted(view.runtimes)}, not {wanted}: "
                   "restart it (systemctl restart docker) and check with 'gpumgr plugin status'")


# --- gpumgr plugin status --------------------------------------------------------------------------

def launcher_python(path: Path) -> str | None:
    """The Python a launcher written by install runs, or None if ``path`` is no such launcher."""
    try:
        found = LAUNCHER_PYTHON.search(path.read_text())
    except (OSError, UnicodeDecodeError):
        return None
    return shlex.split(found.group(1))[0] if found else None


def status(args: argparse.Namespace, runtime_name: str, read_daemon: Any) -> int:
    """``gpumgr plugin status``: what is installed, what the engine took, whether the launchers can run.

    Prints one line per part and then every problem found; exit status 0 when there is none, else 1.
    ``read_daemon(path)`` is install's reader of daemon.json (it refuses a malformed one).
    """
    problems: list[str] = []
    daemon = read_daemon(Path(args.daemon_config))
    file_default = daemon.get("default-runtime") or ENGINE_DEFAULT_RUNTIME
    file_registers = runtime_name in daemon.get("runtimes", {})
    print(f"daemon.json   {args.daemon_config}: default runtime {file_default!r}, runtime {runtime_name!r} "
          + ("registered" if file_registers else "not registered"))
    settings = Path(args.runtime_config)
    print(f"settings      {settings}: " + (_settings_line(settings) if settings.exists() else "not there"))
    hook = Path(args.bin_dir) / "gpumgr-runtime"
    for launcher in (hook, Path(args.cli_plugins_dir) / "docker-gpu"):
        problems += _launcher_status(launcher)
    try:
        view = engine_view(args.docker_host)
    except OSError as exc:
        print(f"engine        {exc}")
        problems.append("the engine could not be asked what it runs containers under")
    else:
        registers = runtime_name in view.runtimes
        print(f"engine        default runtime {view.default_runtime!r}, runtime {runtime_name!r} "
              + ("registered" if registers else "not registered"))
        if view.default_runtime != file_default or registers != file_registers:
            problems.append("the engine has not loaded daemon.json as it is now: reload it "
                            "(systemctl reload docker, or kill -HUP $(pidof dockerd))")
        if view.default_runtime == runtime_name and not hook.exists():
            problems.append(f"the engine's default runtime is {runtime_name!r} but {hook} is gone: every "
                            "container start fails until you run 'gpumgr plugin install' or uninstall and reload")
    for problem in problems:
        print(f"problem: {problem}")
    print("ok" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


def _settings_line(path: Path) -> str:
    try:
        settings = json.loads(path.read_text())
        return (f"GPU runtime {settings['runtime']}, plain runtime {settings['plain_runtime']}, "
                f"agent's hook socket {settings['hook_socket']}")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"unreadable ({exc})"


def _launcher_status(launcher: Path) -> list[str]:
    """Print a launcher's line; the problems with it."""
    if not launcher.exists():
        print(f"launcher      {launcher}: not there")
        return []
    python = launcher_python(launcher)
    if python is None:
        print(f"launcher      {launcher}: not written by gpumgr plugin install")
        return []
    there = Path(python).is_file() and os.access(python, os.X_OK)
    print(f"launcher      {launcher}: runs {python}" + ("" if there else " (NOT THERE)"))
    if there:
        return []
    return [f"{launcher} runs {python}, which is gone (its virtual environment moved or was deleted): "
            "run 'gpumgr plugin install' again with gpumgr's Python"]
