"""The launchers ``gpumgr plugin install`` writes: two ``sh`` scripts, and the Python they may run.

Kept apart from :mod:`gpumgr.plugin.install.install` (what install and uninstall change on a host): this
builds the scripts, and the code a launcher's Python runs, from where the installed packages are
imported now.
"""

from __future__ import annotations

import importlib.util
import json
import shlex
import sys
from pathlib import Path

from gpumgr.plugin.hook import GPU_SPEC_PATTERN, REQUEST_MEMORY
from gpumgr.wire import defaults
from gpumgr.wire.engine import hookpipe
from gpumgr.wire.names import Env

PACKAGE = "gpumgr"
#: What a launcher says when its Python no longer finds gpumgr (``_e``: the ImportError, in its own code).
MOVED = ("gpumgr launcher: {_e}: gpumgr is not installed for this Python any more; "
         "run 'gpumgr plugin install' again with gpumgr's Python\n")

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
            f"    import site\n    site.main()\n"
            f"    try:\n        import {module}\n"
            f"    except ImportError as _e:\n"
            f"        sys.stderr.write(f{MOVED!r})\n        sys.exit(127)\n"
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


#: The first line after ``#!``: uninstall removes only launchers that carry it.
MARK = "# installed by 'gpumgr plugin install'"
#: What a launcher says (exit status 127, as a shell does for a missing command) when its Python is gone.
MISSING_PYTHON = ("{program}: the Python that 'gpumgr plugin install' used, {python}, is not there any more (its "
                  "virtual environment moved or was deleted); run 'gpumgr plugin install' again with gpumgr's Python")
#: The launcher's wait for the agent to take its request off the pipe (its answer may take longer:
#: the agent answers every request it took, if only with the manager's silence, and an agent that
#: dies is an end of file); past this the agent is taken to be stuck, and the create fails.
PIPE_TAKE_WAIT = int(defaults.HOOK_TIMEOUT)
#: A bundle path longer than this goes the Python way: the request line must stay one write of under
#: ``PIPE_BUF`` (4,096 bytes), which the kernel never interleaves with another launcher's line.
MAX_PIPE_PATH = 3000
#: The CLI plugin: Docker asks every plugin for its metadata on many commands; answer that without Python.
CLI_LAUNCHER = """#!/bin/sh
{mark}
if [ "$1" = docker-cli-plugin-metadata ]; then
  echo '{metadata}'
  exit 0
fi
if [ ! -x {python} ]; then
  echo {missing_q} >&2
  exit 127
fi
exec {python} -I -S -c {code} "$@"
"""
#: The runtime hook is called for every runtime operation of every container on the node (state,
#: start, kill, delete, ...). Only the ``create`` of a container whose bundle asks for GPU memory (or
#: carries a GPU) goes to gpumgr: first to the agent's pipe, from ``sh`` (:mod:`gpumgr.agent.hook.hookfifo`
#: says how); to the Python hook when there is no live agent behind the pipe or it says ``python``.
#: Everything else goes straight to the plain runtime.
HOOK_LAUNCHER = """#!/bin/sh
{mark}: only the creates of containers that ask gpumgr for GPU memory go
# through gpumgr (and then to the GPU runtime its settings name); everything else goes to $plain
plain={plain_q}
gpu={gpu_q}
skip=0
command=
log=
at=0
for arg in "$@"; do
  at=$((at + 1))
  if [ "$skip" = 1 ]; then skip=0; [ "$log" = next ] && log=$arg; continue; fi
  case "$arg" in
    --log) skip=1; log=next ;;
    --log=*) log=${{arg#--log=}} ;;
    --root|--log-format|--criu|--rootless) skip=1 ;;
    -*) ;;
    *) command=$arg; break ;;
  esac
done
note() {{
  # the reason a create fails, in runc's log, where Docker reads a runtime's error
  if [ -n "$log" ] && [ "$log" != next ]; then printf '%s\\n' "$1" >> "$log"; fi
}}
fail() {{
  note "$1"
  exit "$2"
}}
if [ "$command" = create ]; then
  bundle=.
  id=
  previous=
  n=0
  for arg in "$@"; do
    n=$((n + 1))
    if [ "$n" -gt "$at" ]; then
      case "$previous" in
        --bundle|-b) bundle=$arg ;;
        --pid-file|--console-socket|--preserve-fds) ;;
        *) case "$arg" in --bundle=*) bundle=${{arg#--bundle=}} ;; -*) ;; *) id=$arg ;; esac ;;
      esac
    fi
    previous=$arg
  done
  if grep -qE '"{marker}=|{gpu_pattern}' "$bundle/config.json" 2>/dev/null; then
    case "$bundle" in /*) ;; *) bundle=$PWD/$bundle ;; esac
    reply={reply_q}$$
    if [ -n "$id" ] && [ -p {fifo_q} ] && read -r agent < {pid_q} 2>/dev/null && kill -0 "$agent" 2>/dev/null \\
        && case "$bundle$id" in *[[:space:]]*) false ;; esac && [ "${{#bundle}}" -lt {max_path} ] \\
        && mkfifo -m 600 "$reply" 2>/dev/null; then
      # the agent's pipe: no Python. Read-write first, so that neither open waits for the other end
      exec 3<>"$reply" 4<"$reply"
      # a watchdog, holding none of this create's pipes or the container's stdio, in case the agent is stuck
      (exec 3>&- 4<&- </dev/null >/dev/null 2>&1
       sleep "${{{pipe_wait_env}:-{take_wait}}}"; rm -f "$reply"; note {stuck_q}; kill -9 $$) &
      watchdog=$!
      printf '%s %s %s\\n' "$reply" "$bundle" "$id" > {fifo_q}
      read -r answer <&4
      kill "$watchdog" 2>/dev/null
      exec 3>&-
      if [ "$answer" = {w_wait} ]; then
        # from here the agent holds the only write end: if it dies, this read ends at once
        read -r answer <&4 || answer=
      fi
      exec 4<&-
      case "$answer" in
        {w_ok}) exec "${{{runc_env}:-$gpu}}" "$@" ;;
        {w_plain}) exec "${{{runc_env}:-$plain}}" "$@" ;;
        "{w_error} "*) fail "${{answer#{w_error} }}" 1 ;;
        {w_python}) ;;
        *) rm -f "$reply"; fail {gone_q} 1 ;;
      esac
    fi
    if [ ! -x {python} ]; then
      # the Python install used has moved or gone: fail this create as runc fails one, and say why
      echo {missing_q} >&2
      fail {missing_json_q} 127
    fi
    {config_env}={config_q}
    export {config_env}
    exec {python} -I -S -c {code} "$@"
  fi
fi
exec "${{{runc_env}:-$plain}}" "$@"
"""


def hook_launcher(*, plain: str, gpu: str, runtime_config: str, hook_socket: str) -> str:
    """The ``gpumgr-runtime`` script: ``plain`` and ``gpu`` runtimes, the settings file, the agent's hook socket."""
    missing = MISSING_PYTHON.format(program="gpumgr-runtime", python=sys.executable)
    q = shlex.quote
    return HOOK_LAUNCHER.format(
        mark=MARK, python=q(sys.executable), plain_q=q(plain), gpu_q=q(gpu), config_q=q(runtime_config),
        missing_q=q(missing), missing_json_q=q(log_json(missing)),
        config_env=Env.RUNTIME_CONFIG, runc_env=Env.RUNC, marker=REQUEST_MEMORY,
        code=q(launcher_code(HOOK_MODULE, HOOK_IMPORTS, HOOK_EAGER)),
        gpu_pattern=GPU_SPEC_PATTERN,  # issue 22: a GPU spec without a request goes to the hook, which checks its grant
        fifo_q=q(str(hookpipe.fifo_path(hook_socket))), pid_q=q(str(hookpipe.pid_path(hook_socket))),
        reply_q=q(str(hookpipe.reply_prefix(hook_socket))), take_wait=PIPE_TAKE_WAIT,
        stuck_q=q(log_json(f"gpumgr: the agent took no request off {hookpipe.fifo_path(hook_socket)}: is it stuck?")),
        pipe_wait_env=Env.HOOK_PIPE_WAIT, max_path=MAX_PIPE_PATH,
        gone_q=q(log_json("gpumgr: the agent ended before it answered; is 'gpumgr agent' running?")),
        w_wait=hookpipe.WAIT, w_ok=hookpipe.OK, w_plain=hookpipe.PLAIN, w_python=hookpipe.PYTHON,
        w_error=hookpipe.ERROR)


def log_json(message: str) -> str:
    """A runc log line fixed when the launcher is written (so it carries no time, as runc's own need not)."""
    return json.dumps({"level": "error", "msg": message})


def cli_launcher(metadata: str) -> str:
    """The ``docker-gpu`` CLI plugin script, answering Docker's metadata probe (``metadata``) without Python."""
    missing = MISSING_PYTHON.format(program="docker gpu", python=sys.executable)
    return CLI_LAUNCHER.format(mark=MARK, python=shlex.quote(sys.executable), metadata=metadata,
                               missing_q=shlex.quote(missing), code=shlex.quote(launcher_code(CLI_MODULE, CLI_IMPORTS)))
