"""``gpumgr plugin install`` and ``gpumgr plugin uninstall``: the per-host set-up the Swarm design needs.

``install`` writes two small launchers that run this installation's Python (so they work under
dockerd's bare environment): ``gpumgr-runtime`` (the OCI runtime hook) and the ``docker-gpu`` CLI
plugin; writes the hook's settings file (``--runtime-config``); registers the hook with the Docker
engine as runtime ``gpumgr`` and makes it the default runtime (Swarm services cannot choose a
runtime).

**Which runtime runs what.** With the hook as the default runtime, every container on the node is
created through it, so it must not hand them all to the NVIDIA runtime: that runtime exposes every
GPU to any container whose image says ``NVIDIA_VISIBLE_DEVICES=all`` (every ``nvidia/cuda`` image),
unmanaged. So the launcher splits the traffic before any Python starts:

- the ``create`` of a container whose bundle asks for GPU memory (``GPUMGR_REQUEST_MEMORY`` in its
  environment) goes to the hook, which gets a grant from the agent, pins ``NVIDIA_VISIBLE_DEVICES``
  to the granted GPU and hands over to the *GPU runtime* (``--runtime``: the NVIDIA runtime when
  installed, else runc), named as ``runtime`` in the settings file;
- every other call (the ``create`` of every container that asks for nothing, and ``start``,
  ``state``, ``kill``, ``delete``, ... of all containers) goes straight to the *plain runtime*
  (``--plain-runtime``, default runc), which the launcher names itself: the fast path reads no
  file but the bundle's ``config.json`` on ``create``, and starts one ``grep``.

Only ``create`` differs between the two, so the GPU runtime must be a runc wrapper that changes the
bundle at ``create`` and nothing after, as ``nvidia-container-runtime`` is. ``GPUMGR_RUNC`` in the
engine's environment still overrides both (tests use it). The launcher exports
``GPUMGR_RUNTIME_CONFIG`` with the settings file it was installed with, so the hook reads the GPU
runtime and the agent's socket (``--hook-socket``) from there.

**Safety.** Everything is read and checked before the first write: a malformed ``daemon.json``, or
another ``default-runtime`` (say ``nvidia``) that installing would silently replace without
``--force``, stops it with nothing written. Every file is written atomically (a temporary file in
the same folder, fsync, rename, fsync of the folder), so a crash leaves the old or the new file,
never a truncated one, and a launcher a runtime call is executing is never rewritten under it; if a
write fails, those already made are undone. The first install that changes ``daemon.json`` keeps
its original as ``daemon.json.before-gpumgr``, and the settings file records what the install did
(whether it created ``daemon.json``, the default runtime it replaced, a digest of what it wrote).

``install`` prints each daemon.json setting it changes before it writes: it makes gpumgr-runtime the
default runtime of every container the engine creates. ``uninstall`` undoes it: if ``daemon.json`` is
still exactly what install wrote, it is put back from the backup (or, if install created it, left
naming only runc); if it was edited since, only gpumgr's runtime is taken out and the replaced
default runtime put back, and the edits are kept. Either way it names ``default-runtime`` and
``runtimes`` outright (:mod:`gpumgr.plugin.install.daemon_config` says why). Then the launchers (only those
install wrote) and the settings file are removed. Running it again does nothing. ``--reload``
signals dockerd and checks with it that it took the file (:mod:`gpumgr.plugin.install.engine`); ``--dry-run``
prints what would change.

A launcher whose Python has gone (its virtual environment moved or deleted) exits with status 127 and
says which, as does one whose Python no longer has gpumgr; ``gpumgr plugin status`` finds both.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from gpumgr.plugin.docker_gpu import METADATA
from gpumgr.plugin.hook import CONFIG as RUNTIME_CONFIG
from gpumgr.plugin.hook import DEFAULT_SOCKET, RUNTIME_CANDIDATES, SEARCH_PATH
from gpumgr.plugin.install.daemon_config import (
    RUNTIME_NAME,
    Refused,
    announce,
    backup_default,
    default_of,
    dump,
    explicit,
    parse_daemon_json,
    strip,
)
from gpumgr.plugin.install.engine import reload_and_check
from gpumgr.plugin.install.engine import status as engine_status
from gpumgr.plugin.install.files import Change, apply, mode_of, read_bytes, sha256_of
from gpumgr.plugin.launchers import MARK, cli_launcher, hook_launcher

PLAIN_RUNTIME = "runc"
BACKUP_SUFFIX = ".before-gpumgr"
#: The settings file's record of what install did, for uninstall.
STATE_KEY = "installed"
def add_path_arguments(parser: argparse.ArgumentParser, reload: bool = True) -> None:
    """The paths ``install`` writes, ``uninstall`` restores or removes and ``status`` reads; the engine's options."""
    parser.add_argument("--daemon-config", default="/etc/docker/daemon.json", help="the Docker engine's daemon.json")
    parser.add_argument("--bin-dir", default="/usr/local/bin", help="where gpumgr-runtime goes")
    parser.add_argument("--cli-plugins-dir", default=str(Path("~/.docker/cli-plugins").expanduser()),
                        help="where the docker-gpu CLI plugin goes")
    parser.add_argument("--runtime-config", default=RUNTIME_CONFIG, help="the hook's own settings file")
    add_engine_argument(parser)
    if not reload:
        return
    parser.add_argument("--reload", action="store_true", help="send SIGHUP to dockerd so it loads daemon.json now, "
                        "and check with the engine (docker info) that it took")
    parser.add_argument("--dockerd-pidfile", default="/var/run/docker.pid")


def add_engine_argument(parser: argparse.ArgumentParser) -> None:
    """Which engine ``--reload`` and ``status`` ask what it runs containers under."""
    parser.add_argument("--docker-host", help="the engine's API, e.g. unix:///var/run/docker.sock "
                                              "(default: $DOCKER_HOST or the local socket)")


def add_dry_run_argument(parser: argparse.ArgumentParser) -> None:
    """``--dry-run``: say what would change, change nothing."""
    parser.add_argument("--dry-run", action="store_true", help="print what would change and write nothing")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``gpumgr plugin install``."""
    add_path_arguments(parser)
    parser.add_argument("--runtime", help="the runtime gpumgr-granted containers are handed to (default: "
                                          "nvidia-container-runtime if installed, else runc)")
    parser.add_argument("--plain-runtime", help="the runtime every other container and runtime call goes to "
                                                "(default: runc)")
    parser.add_argument("--hook-socket", default=DEFAULT_SOCKET, help="the agent's hook socket (its hook_socket)")
    parser.add_argument("--no-default-runtime", action="store_true",
                        help="register the runtime without making it the default (Swarm tasks then bypass it)")
    parser.add_argument("--force", action="store_true",
                        help="replace another default runtime in daemon.json (uninstall puts it back)")


# --- install ---------------------------------------------------------------------------------------

def install(args: argparse.Namespace) -> int:
    """Do the set-up and say what, if anything, the user must still do."""
    try:
        changes, notes, daemon_changed = _plan_install(args)
    except Refused as exc:
        print(f"gpumgr plugin install: {exc}; nothing was written", file=sys.stderr)
        return 2
    if args.dry_run:
        for note in notes:
            print(f"would have: {note}")
        print("dry run: nothing was written")
        return 0
    try:
        apply(changes)
    except OSError as exc:
        print(f"gpumgr plugin install: {exc}; what had been written is undone", file=sys.stderr)
        return 1
    for note in notes:
        print(note)
    if not daemon_changed:
        print(f"{args.daemon_config} already registers runtime {RUNTIME_NAME!r}; nothing to reload")
    elif args.reload:
        wanted = RUNTIME_NAME if not args.no_default_runtime else default_of(Path(args.daemon_config))
        return _reload_and_report(args, wanted, present=True)
    else:
        print(f"updated {args.daemon_config}: the Docker engine must reload it before Swarm tasks get GPUs.\n"
              "  A reload is enough, no restart: systemctl reload docker   (or: kill -HUP $(pidof dockerd))\n"
              "  If dockerd was started with --default-runtime or --add-runtime flags, remove them first:\n"
              "  the same setting as a flag and in daemon.json stops dockerd from starting.")
    return 0


def _plan_install(args: argparse.Namespace) -> tuple[list[Change], list[str], bool]:
    """Read and check everything install needs; the files to write, what to tell, and whether daemon.json changes."""
    gpu_runtime = _resolve_runtime(args.runtime, "--runtime") if args.runtime else _find_runtime()
    if gpu_runtime is None:
        raise Refused("neither nvidia-container-runtime nor runc was found; pass --runtime")
    plain = _resolve_runtime(args.plain_runtime or PLAIN_RUNTIME, "--plain-runtime")
    daemon_path = Path(args.daemon_config).absolute()
    target = Path(os.path.realpath(daemon_path))  # a symbolic link stays one: its target is what is replaced
    backup = daemon_path.with_name(daemon_path.name + BACKUP_SUFFIX)
    runtime_config = Path(args.runtime_config).absolute()
    hook = (Path(args.bin_dir) / "gpumgr-runtime").absolute()
    cli = (Path(args.cli_plugins_dir) / "docker-gpu").absolute()
    raw = read_bytes(target)
    config = parse_daemon_json(raw, daemon_path)
    old_state = _read_state(runtime_config, daemon_path)
    default = not args.no_default_runtime

    current_default = config.get("default-runtime")
    notes: list[str] = []
    if default and current_default not in (None, RUNTIME_NAME, PLAIN_RUNTIME):
        if not args.force:
            raise Refused(f"{daemon_path} makes {current_default!r} the default runtime, and gpumgr must replace it "
                          f"(Swarm tasks only get GPUs through the default runtime). Pass --force to replace it "
                          f"('gpumgr plugin uninstall' puts {current_default!r} back; containers that ask gpumgr "
                          f"for nothing then run under {plain}), or --no-default-runtime")
        notes.append(f"replaced default runtime {current_default!r} (--force); 'gpumgr plugin uninstall' puts it back")
    wanted = dict(config)
    wanted["runtimes"] = {**config.get("runtimes", {}), RUNTIME_NAME: {"path": str(hook.resolve())}}
    if default:
        wanted["default-runtime"] = RUNTIME_NAME
    daemon_changed = wanted != config
    announce(daemon_path, config, wanted, "install")
    if default and daemon_changed:
        print(f"  so {hook} becomes the default runtime of EVERY container this engine creates, GPU or not: "
              f"those that ask gpumgr for no GPU memory go straight on to {plain}; 'gpumgr plugin uninstall' "
              "puts the default back")
    new_daemon = (json.dumps(wanted, indent=2) + "\n").encode()
    digest = sha256_of(new_daemon) if daemon_changed else None

    fresh = RUNTIME_NAME not in config.get("runtimes", {})
    backup_data: bytes | None = None
    if fresh:  # not installed on this daemon.json: this install's "before" is what is there now
        backup_data = raw
        replaced = current_default if default and current_default != RUNTIME_NAME else None
        state: dict[str, Any] = {"created_daemon_config": raw is None, "previous_default_runtime": replaced,
                                 "daemon_config_sha256": digest}
    else:  # installed before: keep the first install's backup and record, unless daemon.json was edited since
        state = {"created_daemon_config": bool(old_state.get("created_daemon_config")),
                 "previous_default_runtime": old_state.get("previous_default_runtime")
                 if old_state else backup_default(backup)}
        if default and current_default not in (None, RUNTIME_NAME):
            state["previous_default_runtime"] = current_default
        untouched = raw is not None and old_state.get("daemon_config_sha256") == sha256_of(raw)
        state["daemon_config_sha256"] = (digest or old_state["daemon_config_sha256"]) if untouched else None
    state.update({"daemon_config": str(daemon_path), "backup": str(backup) if backup.exists() or backup_data
                  is not None else None, "hook": str(hook), "cli_plugin": str(cli)})

    hook_text = hook_launcher(plain=plain, gpu=gpu_runtime, runtime_config=str(runtime_config),
                              hook_socket=args.hook_socket)
    cli_text = cli_launcher(json.dumps(METADATA))
    settings = {"runtime": gpu_runtime, "plain_runtime": plain, "hook_socket": args.hook_socket, STATE_KEY: state}
    changes = [Change(hook, hook_text.encode(), 0o755), Change(cli, cli_text.encode(), 0o755),
               Change(runtime_config, (json.dumps(settings, indent=2) + "\n").encode())]
    if backup_data is not None and daemon_changed:
        changes.append(Change(backup, backup_data, mode_of(target)))
    if daemon_changed:
        changes.append(Change(target, new_daemon, mode_of(target)))
    notes[:0] = [f"installed the OCI runtime hook {hook}: containers granted GPU memory by gpumgr run under "
                 f"{gpu_runtime}, every other container under {plain}",
                 f"installed the Docker CLI plugin {cli} (try: docker gpu nodes)",
                 f"wrote {runtime_config} (the agent's hook socket: {args.hook_socket})"]
    if backup_data is not None and daemon_changed:
        notes.append(f"kept the original {daemon_path} as {backup}")
    return changes, notes, daemon_changed


def _resolve_runtime(name: str, flag: str) -> str:
    """The absolute path of runtime ``name`` (the hook ``exec``s it without a search); Refused if there is none."""
    if os.sep in name:
        path = Path(name).absolute()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise Refused(f"{flag} {name}: no such executable")
        return str(path)
    found = shutil.which(name, path=os.pathsep.join((*SEARCH_PATH, os.environ.get("PATH", ""))))
    if found is None:
        raise Refused(f"{flag} {name}: not found in {os.pathsep.join(SEARCH_PATH)} or $PATH; pass its path")
    return str(Path(found).absolute())


def _find_runtime() -> str | None:
    for name in RUNTIME_CANDIDATES:
        found = shutil.which(name, path=os.pathsep.join(SEARCH_PATH))
        if found:
            return found
    return None


def _read_state(runtime_config: Path, daemon_path: Path) -> dict[str, Any]:
    """What a former install on ``daemon_path`` recorded in the settings file ({} if nothing usable)."""
    try:
        settings = json.loads(runtime_config.read_bytes())
    except (OSError, ValueError):
        return {}
    state = settings.get(STATE_KEY) if isinstance(settings, dict) else None
    if not isinstance(state, dict) or state.get("daemon_config") != str(daemon_path):
        return {}
    return state


# --- uninstall -------------------------------------------------------------------------------------

def uninstall(args: argparse.Namespace) -> int:
    """Put the engine back as it was before ``install`` and remove what install wrote."""
    try:
        changes, notes, daemon_changed = _plan_uninstall(args)
    except Refused as exc:
        print(f"gpumgr plugin uninstall: {exc}; nothing was changed", file=sys.stderr)
        return 2
    if args.dry_run:
        for note in notes:
            print(f"would have: {note}")
        print("dry run: nothing was changed")
        return 0
    try:
        apply(changes)
    except OSError as exc:
        print(f"gpumgr plugin uninstall: {exc}; what had been changed is undone", file=sys.stderr)
        return 1
    for note in notes:
        print(note)
    if not changes:
        print("nothing to uninstall: gpumgr is not installed with these paths")
    if not daemon_changed:
        print(f"{args.daemon_config} was not changed: nothing to reload")
    elif args.reload:
        return _reload_and_report(args, default_of(Path(args.daemon_config)), present=False)
    else:
        print(f"updated {args.daemon_config}: the Docker engine must reload it to stop using gpumgr-runtime.\n"
              "  A reload is enough, no restart: systemctl reload docker   (or: kill -HUP $(pidof dockerd))\n"
              "  Containers created under runtime 'gpumgr' keep calling its launcher to stop and be removed:\n"
              "  recreate them (docker service update --force) or reinstall to manage them.")
    return 0


def _plan_uninstall(args: argparse.Namespace) -> tuple[list[Change], list[str], bool]:
    """The files uninstall changes, what to tell, and whether daemon.json changes; prints daemon.json's changes.

    daemon.json always ends naming ``default-runtime`` and ``runtimes`` outright: dockerd keeps the old value
    of a key its file leaves out when it reloads, so a file without them would leave gpumgr-runtime the
    engine's default after the launcher is gone, and no container could start.
    """
    daemon_path = Path(args.daemon_config).absolute()
    target = Path(os.path.realpath(daemon_path))
    backup = daemon_path.with_name(daemon_path.name + BACKUP_SUFFIX)
    runtime_config = Path(args.runtime_config).absolute()
    state = _read_state(runtime_config, daemon_path)
    raw = read_bytes(target)
    config = parse_daemon_json(raw, daemon_path)
    changes: list[Change] = []
    notes: list[str] = []
    wanted: dict[str, Any] | None = None
    if raw is not None and state.get("daemon_config_sha256") == sha256_of(raw):  # as install left it
        backup_data = read_bytes(backup)
        if state.get("created_daemon_config") or backup_data is not None:
            before = {} if state.get("created_daemon_config") else parse_daemon_json(backup_data, backup)
            wanted = explicit(before)
            data = backup_data if wanted == before and backup_data is not None else dump(wanted)
            changes.append(Change(target, data, mode_of(target)))
            if backup_data is not None:
                changes.append(Change(backup, None))
            notes.append(f"put {daemon_path} back as it was before install" + (
                "" if wanted == before else f", naming the default runtime {wanted['default-runtime']!r} and "
                "the runtimes outright so that a reload takes them"))
    if wanted is None and raw is not None and RUNTIME_NAME in (*config.get("runtimes", {}), config.get(
            "default-runtime")):  # edited since install (or no record): take out only gpumgr's
        previous = state.get("previous_default_runtime") if state else backup_default(backup)
        wanted = strip(config, previous)
        changes.append(Change(target, dump(wanted), mode_of(target)))
        notes.append(f"took runtime {RUNTIME_NAME!r} out of {daemon_path}; it is not as install left it, "
                     "so its other settings are kept")
        if backup.exists():
            notes.append(f"kept {backup} (the file before install) to compare with")
    daemon_changed = wanted is not None and dump(wanted) != raw
    if wanted is not None:
        announce(daemon_path, config, wanted, "uninstall")
    launchers = {Path(args.bin_dir).absolute() / "gpumgr-runtime", Path(args.cli_plugins_dir).absolute() / "docker-gpu"}
    launchers.update(Path(state[key]) for key in ("hook", "cli_plugin") if isinstance(state.get(key), str))
    for launcher in sorted(launchers):
        text = read_bytes(launcher)
        if text is None:
            continue
        lines = text.split(b"\n", 2)
        if len(lines) > 1 and lines[1].startswith(MARK.encode()):
            changes.append(Change(launcher, None))
            notes.append(f"removed {launcher}")
        else:
            notes.append(f"left {launcher}: gpumgr plugin install did not write it")
    if runtime_config.exists():
        changes.append(Change(runtime_config, None))
        notes.append(f"removed {runtime_config}")
    return changes, notes, daemon_changed


def _reload_and_report(args: argparse.Namespace, default_runtime: str, present: bool) -> int:
    """Reload dockerd and check with it that it took daemon.json; 0 if it did, else 1 and what to do."""
    ok, line = reload_and_check(Path(args.dockerd_pidfile), args.docker_host, default_runtime, RUNTIME_NAME, present)
    print(line, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


def status(args: argparse.Namespace) -> int:
    """``gpumgr plugin status``: see :func:`gpumgr.plugin.install.engine.status`."""
    return engine_status(args, RUNTIME_NAME, lambda path: parse_daemon_json(
        read_bytes(Path(os.path.realpath(path))), path))
