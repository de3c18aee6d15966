"""daemon.json as gpumgr plugin install and uninstall read, change and describe it (pure; no writes).

dockerd reloads ``default-runtime`` and ``runtimes`` on SIGHUP only when its file names them: a key left
out keeps the value in force. So what uninstall leaves always names both outright (:func:`explicit`),
runc being dockerd's own default; otherwise a reload would keep gpumgr-runtime the engine's default
after its launcher is gone, and no container could start.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from gpumgr.plugin.install.engine import ENGINE_DEFAULT_RUNTIME
from gpumgr.plugin.install.files import read_bytes

RUNTIME_NAME = "gpumgr"


class Refused(Exception):
    """Install or uninstall cannot go ahead as asked; nothing has been written. The message says why."""


def parse_daemon_json(raw: bytes | None, path: Path) -> dict[str, Any]:
    """daemon.json as a dict ({} if absent or blank); Refused if it is not what dockerd accepts."""
    if raw is None or not raw.strip():
        return {}
    try:
        config = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise Refused(f"{path} is not valid JSON ({exc}); fix it first") from exc
    if not isinstance(config, dict):
        raise Refused(f"{path} holds a JSON {type(config).__name__}, not an object; fix it first")
    if not isinstance(config.get("runtimes", {}), dict):
        raise Refused(f"{path}: 'runtimes' is not an object; fix it first")
    if not isinstance(config.get("default-runtime", ""), str):
        raise Refused(f"{path}: 'default-runtime' is not a string; fix it first")
    return config


def backup_default(backup: Path) -> str | None:
    """The default runtime the backup names, unless it is gpumgr's own (a backup from an older install)."""
    try:
        found = parse_daemon_json(read_bytes(backup), backup).get("default-runtime")
    except Refused:
        return None
    return found if isinstance(found, str) and found != RUNTIME_NAME else None


def strip(config: dict[str, Any], previous_default: str | None) -> dict[str, Any]:
    """``config`` without gpumgr's runtime, and with the runtime gpumgr replaced as the default again (runc if none).

    Both keys are named outright, ``runtimes`` even when empty (see :func:`_explicit`).
    """
    stripped = dict(config)
    stripped["runtimes"] = {name: value for name, value in config.get("runtimes", {}).items() if name != RUNTIME_NAME}
    if config.get("default-runtime") == RUNTIME_NAME:
        stripped["default-runtime"] = previous_default or ENGINE_DEFAULT_RUNTIME
    return explicit(stripped)


def explicit(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` naming its default runtime and its runtimes outright, as dockerd's reload needs to take them."""
    return {**config, "default-runtime": config.get("default-runtime") or ENGINE_DEFAULT_RUNTIME,
            "runtimes": config.get("runtimes", {})}


def dump(config: dict[str, Any]) -> bytes:
    return (json.dumps(config, indent=2) + "\n").encode()


def announce(path: Path, before: dict[str, Any], after: dict[str, Any], action: str) -> None:
    """Print, before anything is written, each setting of daemon.json that ``action`` changes."""
    lines = describe_changes(before, after)
    if lines:
        print(f"gpumgr plugin {action} changes {path}:")
        for line in lines:
            print(f"  {line}")


def describe_changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """One line per top-level setting (and per runtime) that differs between two daemon.json objects."""
    lines: list[str] = []
    for key in sorted(before.keys() | after.keys()):
        old, new = before.get(key), after.get(key)
        if old == new:
            continue
        if key == "runtimes" and isinstance(old or {}, dict) and isinstance(new or {}, dict):
            old_map, new_map = old or {}, new or {}
            lines += [f"runtimes.{name}: added ({json.dumps(new_map[name])})" for name in new_map
                      if name not in old_map]
            lines += [f"runtimes.{name}: removed" for name in old_map if name not in new_map]
            lines += [f"runtimes.{name}: {json.dumps(old_map[name])} -> {json.dumps(new_map[name])}"
                      for name in new_map if name in old_map and old_map[name] != new_map[name]]
            if not old_map and not new_map:
                lines.append("runtimes: named outright ({})")
            continue
        lines.append(f"{key}: {'(not set)' if old is None else json.dumps(old)} -> "
                     f"{'(not set)' if new is None else json.dumps(new)}")
    return lines


def default_of(daemon_path: Path) -> str:
    """The default runtime daemon.json names now (dockerd's own default when it names none)."""
    found = parse_daemon_json(read_bytes(Path(os.path.realpath(daemon_path))), daemon_path).get("default-runtime")
    return str(found or ENGINE_DEFAULT_RUNTIME)
