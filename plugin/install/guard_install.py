"""``gpumgr plugin install --guard`` and the guard's part of ``uninstall``: put the guard in the engine's path, safely.

The engine refuses every API call while an authorization plugin it was told to use does not answer,
a reload (SIGHUP) while it does not answer makes dockerd exit, and the same plugin named both as a
dockerd flag and in ``daemon.json`` stops dockerd from starting. So, in this order:

``install --guard``
  1. writes the guard's systemd unit (``gpumgr-guard.service``: ``gpumgr guard``, started before the
     engine, restarted if it ever stops);
  2. refuses, with nothing more written, when dockerd runs with ``--authorization-plugin`` or the
     guard does not answer ``/Plugin.Activate`` on its socket (start it first:
     ``systemctl enable --now gpumgr-guard``);
  3. does the plain install (runtime hook, CLI plugin), then adds ``gpumgr-guard`` to
     ``daemon.json``'s ``authorization-plugins``, keeping the file as it was before in its state
     file; with ``--reload`` dockerd loads it at once (a reload, never a restart).

``uninstall``
  takes ``gpumgr-guard`` out of ``daemon.json`` first (the exact bytes from before, if the file is
  as the guard's install left it), reloads dockerd while the guard still answers, waits until the
  engine no longer lists the plugin, and only then stops the guard and removes its unit; then the
  plain uninstall runs.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpumgr.plugin.install import install
from gpumgr.plugin.install.daemon_config import RUNTIME_NAME, parse_daemon_json
from gpumgr.plugin.install.daemon_config import Refused as DaemonRefused
from gpumgr.plugin.install.engine import signal_reload
from gpumgr.plugin.install.files import Change, apply, mode_of, read_bytes, sha256_of
from gpumgr.wire.engine import engine_runtime

PLUGIN = "gpumgr-guard"
UNIT_NAME = f"{PLUGIN}.service"
STATE = "/etc/gpumgr/guard-install.json"
#: Seconds to wait for the engine to stop listing the guard after a reload.
RELOAD_WAIT = 30.0
#: The first line of a guard unit gpumgr wrote (``gpumgr generate systemd guard`` writes the same unit),
#: and that of units written by earlier versions: only such a file is replaced or removed.
UNIT_MARKS = (f"# {UNIT_NAME}, written by: gpumgr generate systemd guard".encode(),
              b"# installed by 'gpumgr plugin install --guard'")


#: The engine ``--docker-host`` names when it is not given (install's option, shared).
DOCKER_HOST = "unix:///var/run/docker.sock"


def _reload(pidfile: Path) -> str:
    """SIGHUP to dockerd (a reload, never a restart), and what came of it."""
    return signal_reload(pidfile) or "sent SIGHUP to dockerd: it loads daemon.json now (no restart needed)"


class Refused(Exception):
    """The guard cannot be put in (or taken out of) the engine's path as asked; the message says why."""


def add_arguments(parser: argparse.ArgumentParser, *, installing: bool) -> None:
    """The guard's options of ``install`` and ``uninstall``."""
    if installing:
        parser.add_argument("--guard", action="store_true", help="also make the guard the engine's authorization "
                            "plugin (it must already answer on --guard-socket)")
        parser.add_argument("--agent-config", default="/etc/gpumgr/agent.yaml", help="the guard unit's settings")
    parser.add_argument("--guard-socket", default=f"/run/docker/plugins/{PLUGIN}.sock",
                        help="the guard's plugin socket (its file name is the plugin's name)")
    parser.add_argument("--systemd-dir", default="/etc/systemd/system", help="where the guard's unit goes")
    parser.add_argument("--guard-state", default=STATE, help="what install --guard changed, for uninstall")


def install_command(args: argparse.Namespace) -> int:
    """``gpumgr plugin install [--guard]``."""
    if not args.guard or getattr(args, "dry_run", False):
        if args.guard:
            print("--dry-run: the guard's unit and its daemon.json entry are left out of this list")
        return install.install(args)
    name = Path(args.guard_socket).stem
    unit = Path(args.systemd_dir) / UNIT_NAME
    try:
        unit_note = _write_unit(args, unit)
        _check_engine_flags(Path(args.dockerd_pidfile))
        _check_default_runtime(args)
        _probe(args.guard_socket)
    except Refused as exc:
        print(f"gpumgr plugin install: {exc}; daemon.json was not changed", file=sys.stderr)
        return 2
    print(unit_note)
    status = install.install(args)
    if status != 0:
        return status
    if _change_daemon_json("install", _add_to_daemon_json, args, name) is None:
        return 2
    if args.reload:
        print(_reload(Path(args.dockerd_pidfile)))
    else:
        print(f"the engine uses the guard once it reloads {args.daemon_config}: systemctl reload docker "
              "(a reload, no restart)")
    return 0


def uninstall_command(args: argparse.Namespace) -> int:
    """``gpumgr plugin uninstall``: the guard out of the engine's path (reload, wait, stop), then the rest."""
    if getattr(args, "dry_run", False):
        return install.uninstall(args)
    name = Path(args.guard_socket).stem
    notes = _change_daemon_json("uninstall", _remove_from_daemon_json, args, name)
    if notes is None:
        return 2
    if notes:
        print(_reload(Path(args.dockerd_pidfile)))
        if not _wait_unlisted(args.docker_host or DOCKER_HOST, name):
            print(f"gpumgr plugin uninstall: the engine still lists {name} after {RELOAD_WAIT:g}s; the guard is "
                  "left running (stopping it now would block every docker call)", file=sys.stderr)
            return 1
        print(f"the engine no longer uses {name}")
    print(_stop_unit(Path(args.systemd_dir) / UNIT_NAME))
    return install.uninstall(args)


def _change_daemon_json(command: str, change: Callable[[Path, Path, str], list[str]], args: argparse.Namespace,
                        name: str) -> list[str] | None:
    """Make ``change`` to daemon.json and print what it did; None (after saying why) if it could not."""
    try:
        notes = change(Path(args.daemon_config), Path(args.guard_state), name)
    except (Refused, DaemonRefused, OSError) as exc:
        done = "nothing was changed" if command == "uninstall" else "the guard is not named in daemon.json"
        print(f"gpumgr plugin {command}: {exc}; {done}", file=sys.stderr)
        return None
    for note in notes:
        print(note)
    return notes


def _write_unit(args: argparse.Namespace, unit: Path) -> str:
    """The guard's unit, the one ``gpumgr generate systemd guard`` prints, naming this install's socket."""
    from gpumgr.systemd import unit as unit_text

    text = unit_text("guard", config=args.agent_config, command=("guard", "--socket", args.guard_socket))
    if read_bytes(unit) == text.encode():
        return f"{unit} is already the guard's unit"
    existing = read_bytes(unit)
    if existing is not None and not existing.startswith(UNIT_MARKS):
        raise Refused(f"{unit} exists and was not written by gpumgr")
    try:
        apply([Change(unit, text.encode(), 0o644)])
    except OSError as exc:
        raise Refused(f"cannot write {unit}: {exc}") from None
    return f"wrote the guard's unit {unit} (start it before the engine: systemctl enable --now {UNIT_NAME})"


def _dockerd_argv(pidfile: Path) -> list[str] | None:
    """The running dockerd's command line (None when no engine runs)."""
    try:
        argv = Path(f"/proc/{int(pidfile.read_text().strip())}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError):
        return None
    return [arg.decode(errors="replace") for arg in argv if arg]


def _check_engine_flags(pidfile: Path) -> None:
    """Refuse when dockerd runs with ``--authorization-plugin``: the same setting in daemon.json stops it."""
    argv = _dockerd_argv(pidfile)
    if argv is None:
        return  # no running engine to check: daemon.json alone decides
    if any(arg.startswith("--authorization-plugin") for arg in argv):
        raise Refused("dockerd was started with --authorization-plugin; naming a plugin in daemon.json as well "
                      "stops it from starting: remove the flag (and add gpumgr-guard there instead) or leave "
                      "authorization plugins to the flags")


def _check_default_runtime(args: argparse.Namespace) -> None:
    """Refuse to guard a node whose default runtime hands every CUDA image its GPUs (the image's own ENV).

    Judged by what the runtime is (its path, links, wrapper script, arguments), not its name, and
    with dockerd's ``--default-runtime`` flag, which overrides what install writes, counted.
    """
    flags = engine_runtime.parse_flags(["dockerd", *(_dockerd_argv(Path(args.dockerd_pidfile)) or [])[1:]])
    if not args.no_default_runtime and not flags.get("--default-runtime"):
        return  # gpumgr's hook becomes the default: an image's NVIDIA_VISIBLE_DEVICES gets plain runc
    try:
        config = parse_daemon_json(read_bytes(Path(args.daemon_config)), Path(args.daemon_config))
        settings = engine_runtime.engine_settings(flags, config)
    except (DaemonRefused, ValueError):
        return  # the plain install reports a malformed file
    default = settings.default_runtime
    why = None if default == RUNTIME_NAME else engine_runtime.gpu_by_env(default, settings.runtimes)
    if why:
        raise Refused(f"the engine's default runtime is {default!r} ({why}), which gives every CUDA image (its ENV "
                      "sets NVIDIA_VISIBLE_DEVICES) all GPUs whatever the guard says: install without "
                      "--no-default-runtime (and without dockerd's --default-runtime flag) so gpumgr's hook is "
                      "the default")


def _probe(path: str) -> None:
    """The guard answers ``/Plugin.Activate`` with ``authz`` on ``path``, or Refused."""
    try:
        answer = _plugin_call(path, "/Plugin.Activate")
    except (OSError, ValueError, http.client.HTTPException) as exc:
        raise Refused(f"the guard does not answer on {path} ({exc}); start it first "
                      f"(systemctl enable --now {UNIT_NAME}, or gpumgr guard)") from None
    if "authz" not in (answer.get("Implements") or []):
        raise Refused(f"what answers on {path} is not an authorization plugin: {answer}")


def _plugin_call(path: str, call: str) -> dict[str, Any]:
    connection = UnixConnection(path)
    try:
        connection.request("POST", call, body=b"{}", headers={"Content-Type": "application/json"})
        data = json.loads(connection.getresponse().read(65536))
    finally:
        connection.close()
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    return data


class UnixConnection(http.client.HTTPConnection):
    """HTTP over a Unix socket (a plugin's), with a 5 s timeout."""

    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=5)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(5)
        self.sock.connect(self.path)


def _add_to_daemon_json(daemon: Path, state_file: Path, name: str) -> list[str]:
    raw = read_bytes(daemon)
    config = parse_daemon_json(raw, daemon)
    plugins = list(config.get("authorization-plugins") or [])
    if name in plugins:
        return [f"{daemon} already names {name} in authorization-plugins"]
    config["authorization-plugins"] = [*plugins, name]
    new = (json.dumps(config, indent=2) + "\n").encode()
    state = {"before": raw.decode() if raw is not None else None, "after_sha256": sha256_of(new)}
    apply([Change(state_file, (json.dumps(state) + "\n").encode(), 0o600), Change(daemon, new, mode_of(daemon))])
    return [f"added {name} to authorization-plugins in {daemon} (kept the file as it was in {state_file})"]


def _remove_from_daemon_json(daemon: Path, state_file: Path, name: str) -> list[str]:
    raw = read_bytes(daemon)
    config = parse_daemon_json(raw, daemon)
    if name not in (config.get("authorization-plugins") or []):
        return []
    state = _read_state(state_file)
    if raw is not None and state.get("after_sha256") == sha256_of(raw) and isinstance(state.get("before"), str):
        changes = [Change(daemon, state["before"].encode(), mode_of(daemon)), Change(state_file, None)]
        note = f"restored {daemon} as it was before install --guard"
    else:
        plugins = [p for p in config["authorization-plugins"] if p != name]
        stripped = {**config, "authorization-plugins": plugins} if plugins else \
            {k: v for k, v in config.items() if k != "authorization-plugins"}
        changes = [Change(daemon, (json.dumps(stripped, indent=2) + "\n").encode(), mode_of(daemon))]
        note = f"took {name} out of authorization-plugins in {daemon} (its other edits kept)"
    apply(changes)
    return [note]


def _read_state(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _wait_unlisted(docker_host: str, name: str) -> bool:
    """Whether the engine stops listing ``name`` among its authorization plugins within RELOAD_WAIT."""
    import docker

    deadline = time.monotonic() + RELOAD_WAIT
    while time.monotonic() < deadline:
        try:
            client = docker.DockerClient(base_url=docker_host, timeout=10)
            try:
                if name not in (client.info().get("Plugins", {}).get("Authorization") or []):
                    return True
            finally:
                client.close()
        except Exception:  # the engine is reloading or still asking the guard: ask again
            pass
        time.sleep(0.2)
    return False


def _stop_unit(unit: Path) -> str:
    """Stop and remove the guard's unit (only one this command wrote)."""
    text = read_bytes(unit)
    if text is None or not text.startswith(UNIT_MARKS):
        return "no guard unit of gpumgr's to stop; stop 'gpumgr guard' if you started it by hand"
    systemctl = shutil.which("systemctl")
    if systemctl and os.path.isdir("/run/systemd/system"):
        subprocess.run([systemctl, "disable", "--now", UNIT_NAME], capture_output=True, timeout=60)
    apply([Change(unit, None)])
    return f"stopped the guard and removed {unit}"
