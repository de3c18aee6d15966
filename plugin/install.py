"""``gpumgr plugin install``: the per-host set-up the Swarm design needs.

It writes two small launchers that run this installation's Python (so they work under dockerd's
bare environment): ``gpumgr-runtime`` (the OCI runtime hook) and the ``docker-gpu`` CLI plugin;
registers the hook with the Docker engine as runtime ``gpumgr`` and makes it the default runtime
(Swarm services cannot choose a runtime); and remembers which real runtime to hand over to.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

from gpumgr.plugin.docker_gpu import METADATA
from gpumgr.plugin.hook import CONFIG as RUNTIME_CONFIG
from gpumgr.plugin.hook import DEFAULT_SOCKET, REQUEST_MEMORY, RUNTIME_CANDIDATES, SEARCH_PATH

RUNTIME_NAME = "gpumgr"
PACKAGE = "gpumgr"
#: The CLI plugin: Docker asks every plugin for its metadata on many commands; answer that without Python.
CLI_LAUNCHER = """#!/bin/sh
# installed by 'gpumgr plugin install'
if [ "$1" = docker-cli-plugin-metadata ]; then
  echo '{metadata}'
  exit 0
fi
exec {python} -I -S -c {code} "$@"
"""
#: The runtime hook is called for every runtime operation of every container on the node (state,
#: start, kill, delete, ...). Only the ``create`` of a container whose bundle asks for GPU memory
#: needs Python; everything else goes straight to the real runtime.
HOOK_LAUNCHER = """#!/bin/sh
# installed by 'gpumgr plugin install': only GPU creates need gpumgr, everything else goes to {runtime}
skip=0
command=
for arg in "$@"; do
  if [ "$skip" = 1 ]; then skip=0; continue; fi
  case "$arg" in
    --root|--log|--log-format|--criu|--rootless) skip=1 ;;
    -*) ;;
    *) command=$arg; break ;;
  esac
done
if [ "$command" = create ]; then
  bundle=.
  previous=
  for arg in "$@"; do
    case "$previous" in --bundle|-b) bundle=$arg ;; esac
    case "$arg" in --bundle=*) bundle=${{arg#--bundle=}} ;; esac
    previous=$arg
  done
  if grep -q '{marker}=' "$bundle/config.json" 2>/dev/null; then
    exec {python} -I -S -c {code} "$@"
  fi
fi
exec "${{GPUMGR_RUNC:-{runtime}}}" "$@"
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``gpumgr plugin install``."""
    parser.add_argument("--daemon-config", default="/etc/docker/daemon.json", help="the Docker engine's daemon.json")
    parser.add_argument("--bin-dir", default="/usr/local/bin", help="where gpumgr-runtime goes")
    parser.add_argument("--cli-plugins-dir", default=str(Path("~/.docker/cli-plugins").expanduser()),
                        help="where the docker-gpu CLI plugin goes")
    parser.add_argument("--runtime-config", default=RUNTIME_CONFIG, help="the hook's own settings file")
    parser.add_argument("--runtime", help="the runtime the hook hands over to (default: nvidia-container-runtime "
                                          "if installed, else runc)")
    parser.add_argument("--hook-socket", default=DEFAULT_SOCKET, help="the agent's hook socket (its hook_socket)")
    parser.add_argument("--no-default-runtime", action="store_true",
                        help="register the runtime without making it the default (Swarm tasks then bypass it)")
    parser.add_argument("--reload", action="store_true", help="send SIGHUP to dockerd so it loads the runtime now")
    parser.add_argument("--dockerd-pidfile", default="/var/run/docker.pid")


#: What each launcher imports: the folders of all go on ``sys.path``; the hook's are imported up front,
#: so a stale path is noticed while the ``site`` fall-back is still possible (``yaml`` is only read
#: by the CLI when a plugin config file exists).
HOOK_MODULE = "gpumgr.plugin.hook"
CLI_MODULE = "gpumgr.plugin.docker_gpu"
HOOK_IMPORTS = ("gpumgr.plugin", "gpumgr.wire", "msgpack")
HOOK_EAGER = ("msgpack",)
CLI_IMPORTS = ("gpumgr.plugin", "gpumgr.wire", "yaml")


def launcher_code(module: str, imports: tuple[str, ...], eager: tuple[str, ...] = ()) -> str:
    """Python for ``python -I -S -c``: run ``module.main()`` without the ``site`` start-up.

    ``site`` (every ``.pth`` file, the editable-install finder) is most of an interpreter's start-up
    time, and the hook starts one per GPU container created. The folders that hold the third-party
    ``imports`` go on the end of ``sys.path``, where ``site`` would put them; gpumgr's own packages
    are registered by folder (their ``__init__`` files hold only docstrings), because an editable
    install maps them from separate folders that no ``sys.path`` entry can express. If an import
    fails (gpumgr moved since ``gpumgr plugin install``), the launcher falls back to ``site``.
    """
    folders: list[str] = []
    packages: dict[str, str] = {}
    for name in imports:
        if name.partition(".")[0] == PACKAGE:
            parts = name.split(".")
            for depth in range(1, len(parts) + 1):
                package = ".".join(parts[:depth])
                packages[package] = _package_folder(package)
            continue
        folder = _import_folder(name)
        if folder is not None and folder not in folders:
            folders.append(folder)
    preload = ", ".join((*eager, module))
    return (f"import sys\nsys.path.extend({json.dumps(folders)})\n"
            f"for _n, _p in {json.dumps(sorted(packages.items()))}:\n"
            f"    _m = type(sys)(_n)\n    _m.__path__ = [_p]\n    sys.modules[_n] = _m\n"
            f"    _up, _, _leaf = _n.rpartition('.')\n    if _up:\n        setattr(sys.modules[_up], _leaf, _m)\n"
            f"try:\n    import {preload}\n"
            f"except ImportError:\n"
            f"    for _n in [n for n in sys.modules if n.partition('.')[0] == {PACKAGE!r}]:\n"
            f"        del sys.modules[_n]\n"
            f"    import site\n    site.main()\n    import {module}\n"
            f"sys.exit({module}.main())\n")


def _package_folder(name: str) -> str:
    """The folder the installed package ``name`` is imported from."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"{name} is not an importable package")
    return str(next(iter(spec.submodule_search_locations)))


def _import_folder(name: str) -> str | None:
    """The ``sys.path`` entry ``name`` is imported from here, or None if it is not importable."""
    spec = importlib.util.find_spec(name)
    if spec is None:
        return None
    if spec.submodule_search_locations:  # a package: its folder's parent
        return str(Path(next(iter(spec.submodule_search_locations))).parent)
    return str(Path(spec.origin).parent) if spec.origin else None


def install(args: argparse.Namespace) -> int:
    """Do the set-up and say what, if anything, the user must still do."""
    runtime = args.runtime or _find_runtime()
    if runtime is None:
        print("gpumgr plugin install: neither nvidia-container-runtime nor runc was found; pass --runtime",
              file=sys.stderr)
        return 2
    hook = _write_script(Path(args.bin_dir) / "gpumgr-runtime",
                         HOOK_LAUNCHER.format(python=shlex.quote(sys.executable), runtime=runtime,
                                              marker=REQUEST_MEMORY, code=shlex.quote(
                                                  launcher_code(HOOK_MODULE, HOOK_IMPORTS, HOOK_EAGER))))
    cli = _write_script(Path(args.cli_plugins_dir) / "docker-gpu",
                        CLI_LAUNCHER.format(python=shlex.quote(sys.executable), metadata=json.dumps(METADATA),
                                            code=shlex.quote(launcher_code(CLI_MODULE, CLI_IMPORTS))))
    _write_json(Path(args.runtime_config), {"runtime": runtime, "hook_socket": args.hook_socket})
    changed = _register_runtime(Path(args.daemon_config), hook, default=not args.no_default_runtime)
    print(f"installed the OCI runtime hook {hook} (hands over to {runtime})")
    print(f"installed the Docker CLI plugin {cli} (try: docker gpu nodes)")
    if not changed:
        print(f"{args.daemon_config} already registers runtime {RUNTIME_NAME!r}; nothing to reload")
    elif args.reload:
        print(_reload(Path(args.dockerd_pidfile)))
    else:
        print(f"updated {args.daemon_config}: the Docker engine must reload it before Swarm tasks get GPUs.\n"
              "  A reload is enough, no restart: systemctl reload docker   (or: kill -HUP $(pidof dockerd))\n"
              "  If dockerd was started with --default-runtime or --add-runtime flags, remove them first:\n"
              "  the same setting as a flag and in daemon.json stops dockerd from starting.")
    return 0


def _find_runtime() -> str | None:
    for name in RUNTIME_CANDIDATES:
        found = shutil.which(name, path=os.pathsep.join(SEARCH_PATH))
        if found:
            return found
    return None


def _write_script(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path.resolve()


def _register_runtime(daemon_json: Path, hook: Path, default: bool) -> bool:
    config = json.loads(daemon_json.read_text()) if daemon_json.exists() and daemon_json.read_text().strip() else {}
    wanted = dict(config)
    wanted["runtimes"] = {**config.get("runtimes", {}), RUNTIME_NAME: {"path": str(hook)}}
    if default:
        wanted["default-runtime"] = RUNTIME_NAME
    if wanted == config:
        return False
    if daemon_json.exists():
        shutil.copy2(daemon_json, daemon_json.with_suffix(".json.before-gpumgr"))
    _write_json(daemon_json, wanted)
    return True


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def _reload(pidfile: Path) -> str:
    try:
        os.kill(int(pidfile.read_text().strip()), signal.SIGHUP)
    except (OSError, ValueError) as exc:
        return f"could not signal dockerd through {pidfile} ({exc}); run: systemctl reload docker"
    return "sent SIGHUP to dockerd: it loads the new runtime now (no restart needed)"
