"""``docker gpu gang ps``, ``logs`` and ``rm``: the gangs ``docker gpu run --gang N`` submits (issue 35).

A gang is N containers placed all at once or not at all; its members are ordinary containers, so
``docker gpu ps`` lists them too. These commands show and end the gang as one: ``ps`` one row per gang,
``logs`` every member's output with each line prefixed by its rank (``[0] ...``), ``rm`` every member.
A gang is named by its id or a prefix of it that only it has.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.parse
from typing import Any

from gpumgr.client import MULTIPLEXED, read_frames
from gpumgr.plugin.cli_base import Manager, PluginError, _format, _print_table, _take_options
from gpumgr.wire.units import format_bytes

USAGE = """Usage: docker gpu gang COMMAND

Commands:
  ps [--format table|json]          every gang: its state, size, each member's grant, restarts and master
  logs [-f] [--tail N] GANG         every member's output, each line prefixed with its rank: [0] ...
  rm GANG...                        end it: every member is stopped and removed (a waiting gang is withdrawn)

Submit one with: docker gpu run --gang N --gpu-memory SIZE [--no-one-per-node] [--restart-gang N] [--queue]
                 [docker run options] IMAGE [CMD]"""
#: Held while a member's lines are written, so that two members' lines never run into each other.
_WRITE = threading.Lock()


def gang(client: Manager, argv: list[str]) -> int:
    """Dispatch ``docker gpu gang ps|logs|rm ...``."""
    command, rest = (argv[0], argv[1:]) if argv else ("--help", [])
    if command in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    actions = {"ps": show_gangs, "ls": show_gangs, "logs": gang_logs, "rm": remove_gangs}
    if command not in actions:
        raise PluginError(f"unknown command 'gang {command}'; try 'docker gpu gang --help'")
    return actions[command](client, rest)


def show_gangs(client: Manager, argv: list[str]) -> int:
    """``docker gpu gang ps [--format table|json]``: one row per gang, oldest first."""
    form = _format(argv, "docker gpu gang ps [--format table|json]")
    gangs = client.call("GET", "/v1/gangs")["gangs"]
    if form == "json":  # the API's objects as they are
        print(json.dumps(gangs))
        return 0
    rows = [("ID", "STATE", "REPLICAS", "GPU MEMORY", "RESTARTS", "MASTER", "CREATED")]
    for g in sorted(gangs, key=lambda g: g["created_at"]):
        rows.append((g["id"], _state(g), str(g["replicas"]), _grant(g),
                     f"{g['restart_count']}/{g['max_restarts']}" if g["restart"] == "gang" else "-",
                     f"{g['master_addr']}:{g['master_port']}" if g["master_addr"] else "-", _ago(g["created_at"])))
    _print_table(rows)
    return 0


def gang_logs(client: Manager, argv: list[str]) -> int:
    """``docker gpu gang logs [-f] [--tail N] GANG``: each member's output, each line prefixed ``[RANK] ``.

    Without ``-f`` the members are read one after the other, rank 0 first; with it they are followed
    together (a line is never split by another's) until every member has ended.
    """
    options, rest = _take_options(argv, {"-f": False, "--follow": False, "-n": True, "--tail": True})
    if len(rest) != 1 or rest[0].startswith("-"):
        raise PluginError("usage: docker gpu gang logs [-f] [--tail N] GANG")
    view = find(client, rest[0])
    if not view["members"]:
        raise PluginError(f"gang {view['id']} has no members to read: it is {view['state']}")
    follow = "-f" in options or "--follow" in options
    params = {"follow": "1" if follow else "0", "tail": options.get("--tail", options.get("-n", "all"))}
    failures: list[str] = []
    readers = [threading.Thread(target=_copy, args=(client, rank, cid, params, failures), daemon=True,
                                name=f"rank-{rank}") for rank, cid in enumerate(view["members"])]
    for reader in readers:
        reader.start()
        if not follow:  # one after the other: the output reads rank by rank
            reader.join()
    for reader in readers:
        reader.join()
    for failure in failures:
        print(f"docker gpu: {failure}", file=sys.stderr)
    return 1 if failures else 0


def remove_gangs(client: Manager, argv: list[str]) -> int:
    """``docker gpu gang rm GANG...``: end each; its id is printed once its members are stopped."""
    if not argv or any(a.startswith("-") for a in argv):
        raise PluginError("usage: docker gpu gang rm GANG...")
    for ref in argv:
        gid = find(client, ref)["id"]
        client.call("DELETE", f"/v1/gangs/{urllib.parse.quote(gid, safe='')}")
        print(gid)
    return 0


def find(client: Manager, ref: str) -> dict[str, Any]:
    """The gang whose id is ``ref``, or the only one whose id starts with it."""
    gangs = client.call("GET", "/v1/gangs")["gangs"]
    exact = [g for g in gangs if g["id"] == ref]
    matches = exact or [g for g in gangs if ref and g["id"].startswith(ref)]
    if not matches:
        raise PluginError(f"no gang {ref!r} (not_found)")
    if len(matches) > 1:
        raise PluginError(f"{len(matches)} gangs' ids start with {ref!r}; give more of the id")
    return dict(matches[0])


class _Prefixed:
    """One member's output as whole lines, each prefixed with its rank; a last line without an end gets one."""

    def __init__(self, rank: int) -> None:
        self.prefix = f"[{rank}] ".encode()
        self.partial: dict[int, bytes] = {}

    def feed(self, stream: int, data: bytes) -> None:
        *lines, self.partial[stream] = (self.partial.get(stream, b"") + data).split(b"\n")
        if lines:
            _write(stream, b"".join(self.prefix + line + b"\n" for line in lines))

    def end(self) -> None:
        for stream, rest in self.partial.items():
            if rest:
                _write(stream, self.prefix + rest + b"\n")


def _copy(client: Manager, rank: int, cid: str, params: dict[str, str], failures: list[str]) -> None:
    """Copy member ``rank``'s output to ours, prefixed; a failure is noted for the end, not raised."""
    prefixed = _Prefixed(rank)
    try:
        with client.stream(f"/v1/containers/{cid}/logs", params, MULTIPLEXED) as out:
            for stream, data in read_frames(out):
                prefixed.feed(stream, data)
    except (PluginError, OSError) as exc:
        failures.append(f"[{rank}] cannot read the output of member {cid}: {exc}")
    finally:
        prefixed.end()


def _write(stream: int, data: bytes) -> None:
    out = sys.stderr.buffer if stream == 2 else sys.stdout.buffer
    with _WRITE:
        out.write(data)
        out.flush()


def _state(view: dict[str, Any]) -> str:
    if view["queue"] is not None:
        return f"queued #{view['queue']['position']}"
    return view["state"] if view["exit_code"] is None else f"{view['state']} ({view['exit_code']})"


def _grant(view: dict[str, Any]) -> str:
    """Each member's grant: ``8GiB``, or ``2x8GiB`` for two GPUs of 8 GiB."""
    size = format_bytes(view["gpu_memory"])
    return size if view["gpus"] == 1 else f"{view['gpus']}x{size}"


def _ago(when: float) -> str:
    """How long ago ``when`` (a wall-clock time) was, as ``docker ps`` says it."""
    seconds = max(0, int(time.time() - when))
    for size, unit in ((86400, "day"), (3600, "hour"), (60, "minute"), (1, "second")):
        if seconds >= size:
            count = seconds // size
            return f"{count} {unit}{'s' if count != 1 else ''} ago"
    return "less than a second ago"
