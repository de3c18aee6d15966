"""Which runtime a Docker engine uses by default, and whether a runtime hands out GPUs by environment.

Shared by ``gpumgr plugin install --guard`` (which refuses to guard such a default) and the guard
(which lets only containers holding a grant use one). The engine's settings come from two places,
as dockerd reads them: its command line (``--default-runtime``, ``--add-runtime``, ``--data-root``,
``--config-file``) and its ``daemon.json`` (``default-runtime``, ``runtimes``, ``data-root``). dockerd
refuses to start with a key in both, so neither wins over the other; with neither, the default is
``runc`` and the data root ``/var/lib/docker``.

A runtime hands out GPUs by environment (the NVIDIA runtime reads ``NVIDIA_VISIBLE_DEVICES``, which
every CUDA image sets in its own ENV) when its name starts with ``nvidia``, when its binary is
``nvidia-container-runtime`` (by path, through symbolic links, as a shim's ``BinaryName``, or named
by a wrapper script), or when its arguments name ``nvidia-container-runtime-hook``. gpumgr's own
launcher (``gpumgr-runtime``) is fenced: it checks every GPU container for a grant.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Any

ENGINE_DEFAULT_RUNTIME = "runc"
DEFAULT_CONFIG_FILE = "/etc/docker/daemon.json"
DEFAULT_DATA_ROOT = "/var/lib/docker"
#: The names dockerd gives its stock runtime (runc through containerd's shim).
STOCK_RUNTIMES = frozenset({"runc", "io.containerd.runc.v2", "io.containerd.runtime.v1.linux"})
NVIDIA_BINARY = "nvidia-container-runtime"
NVIDIA_HOOK = "nvidia-container-runtime-hook"
#: The launcher ``gpumgr plugin install`` writes: it wraps runc or the NVIDIA runtime behind a grant check.
FENCED_BINARY = "gpumgr-runtime"
SEARCH_PATH = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")
#: dockerd flags that take a value (``--flag value`` or ``--flag=value``).
VALUE_FLAGS = frozenset({"--default-runtime", "--add-runtime", "--config-file", "--data-root", "-g", "--graph"})
#: How much of a runtime script is read for the NVIDIA runtime's name.
SCRIPT_BYTES = 65536
MAX_LINKS = 40


@dataclass(frozen=True)
class EngineSettings:
    """What the engine runs containers with: its default runtime, the runtimes it knows, its data root."""

    default_runtime: str
    runtimes: dict[str, dict[str, Any]]
    data_root: str
    config_file: str


def parse_flags(argv: list[str]) -> dict[str, list[str]]:
    """dockerd's value flags as given on its command line (each flag's values in order)."""
    flags: dict[str, list[str]] = {}
    args = iter(argv[1:])
    for arg in args:
        name, eq, value = arg.partition("=")
        if name in VALUE_FLAGS:
            flags.setdefault(name, []).append(value if eq else next(args, ""))
    return flags


def config_file(flags: dict[str, list[str]]) -> str:
    """The daemon.json dockerd reads (``--config-file``, else the default)."""
    return (flags.get("--config-file") or [DEFAULT_CONFIG_FILE])[-1]


def engine_settings(flags: dict[str, list[str]], daemon_json: dict[str, Any]) -> EngineSettings:
    """The engine's settings from its flags and its daemon.json; ValueError if the file holds the wrong types."""
    default = (flags.get("--default-runtime") or [""])[-1] or daemon_json.get("default-runtime") or \
        ENGINE_DEFAULT_RUNTIME
    runtimes = daemon_json.get("runtimes") or {}
    root = (flags.get("--data-root") or flags.get("-g") or flags.get("--graph") or [""])[-1] or \
        daemon_json.get("data-root") or daemon_json.get("graph") or DEFAULT_DATA_ROOT
    if not isinstance(default, str) or not isinstance(runtimes, dict) or not isinstance(root, str):
        raise ValueError("default-runtime, runtimes or data-root has the wrong type")
    merged = {str(name): spec if isinstance(spec, dict) else {} for name, spec in runtimes.items()}
    for added in flags.get("--add-runtime", []):
        name, _, path = added.partition("=")
        merged[name] = {"path": path}
    return EngineSettings(default, merged, root, config_file(flags))


def gpu_by_env(name: str, runtimes: dict[str, dict[str, Any]],
               search_path: tuple[str, ...] = SEARCH_PATH) -> str | None:
    """Why runtime ``name`` (as ``runtimes`` defines it) gives containers GPUs by their environment, or None.

    A name the engine does not know is a reason too: nothing can be said of it.
    """
    if name.lower().startswith("nvidia"):
        return f"runtime {name!r} is NVIDIA's"
    spec = runtimes.get(name)
    if spec is None and name not in STOCK_RUNTIMES:
        return f"runtime {name!r} is not one the engine defines"
    spec = spec or {"path": "runc"}
    args = spec.get("runtimeArgs") or []
    if any(NVIDIA_HOOK in str(arg) for arg in args if isinstance(args, list)):
        return f"runtime {name!r} runs {NVIDIA_HOOK}"
    options = spec.get("options") if isinstance(spec.get("options"), dict) else {}
    for binary in (spec.get("path"), options.get("BinaryName") if options else None):
        why = binary_problem(binary, search_path) if isinstance(binary, str) and binary else None
        if why:
            return f"runtime {name!r} {why}"
    return None


def binary_problem(binary: str, search_path: tuple[str, ...] = SEARCH_PATH) -> str | None:
    """Why the runtime binary ``binary`` is the NVIDIA runtime (itself, a link to it, a script running it), or None."""
    found = binary if "/" in binary else shutil.which(binary, path=os.pathsep.join(search_path))
    if found is None:
        return None  # dockerd cannot run it either
    chain = _link_chain(found)
    names = [os.path.basename(step) for step in chain]
    if FENCED_BINARY in names:
        return None
    if any(name.startswith(NVIDIA_BINARY) and name != NVIDIA_HOOK for name in names):
        return f"is {NVIDIA_BINARY} ({' -> '.join(chain)})"
    try:
        with open(chain[-1], "rb") as handle:
            head = handle.read(SCRIPT_BYTES)
    except OSError:
        return None
    if head.startswith(b"#!") and NVIDIA_BINARY.encode() in head:
        return f"is a script ({chain[-1]}) that runs {NVIDIA_BINARY}"
    return None


def _link_chain(path: str) -> list[str]:
    """``path`` and every path its symbolic links lead to, the real path last."""
    chain = [path]
    for _ in range(MAX_LINKS):
        try:
            target = os.readlink(chain[-1])
        except OSError:
            break
        chain.append(os.path.normpath(os.path.join(os.path.dirname(chain[-1]), target)))
    real = os.path.realpath(path)
    return chain if chain[-1] == real else [*chain, real]
