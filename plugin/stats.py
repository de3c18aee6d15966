"""``docker gpu stats`` and ``docker gpu nodes``: live GPU memory per container, and the GPU map as bars.

``stats`` works like ``docker stats``: a table redrawn every second until Ctrl-C, ``--no-stream`` for one
table, ``--format json`` for scripts (one JSON array; without ``--no-stream`` one array per second, each on
its own line: JSON lines). ``nodes`` shows each GPU with a bar of what is granted, used outside any grant
and still free.

Tables are drawn with ``rich``, imported here only: ``docker gpu`` loads this module just for these two
commands, so its other commands start as fast as before. When stdout is not a terminal, rich writes plain
text (no colours, no cursor movement) and the live table becomes one table per second.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from gpumgr.wire.names import LIVE
from gpumgr.wire.units import format_bytes

if TYPE_CHECKING:
    from rich.console import Console, RenderableType
    from rich.table import Table
    from rich.text import Text

#: Seconds between two refreshes of the live views.
INTERVAL = 1.0
#: Cells of a GPU's bar in ``docker gpu nodes``.
BAR_WIDTH = 30
#: A percentage of the grant from which the row is shown in yellow (above 100: red, over its grant).
WARN_PERCENT = 90.0
#: Width given to rich when writing to a pipe or a file, where it would otherwise cut tables at 80 columns.
PIPE_WIDTH = 1000
#: The keys of each object in ``--format json``, in order; scripts may rely on them.
JSON_KEYS = ("id", "container_id", "name", "node", "gpus", "grant_bytes", "gpu_count", "used_bytes", "peak_bytes",
             "percent", "state", "compute_share", "limit_bytes")
#: The bar's segments in order: (key in the GPU entry, cell character, style, legend). Each segment has its own
#: character so that the bar still reads without colour.
#: How ``-a``'s STATE column shows each state (the live ones plain); ended ones are dimmed, a kill is red.
STATE_STYLES = {"queued": "yellow", "exited": "dim", "removed": "dim", "expired": "dim", "preempted": "dim",
                "killed": "red", "failed": "red"}
SEGMENTS = (("memory_reserved", "█", "cyan", "reserved"), ("memory_burst", "▚", "yellow", "burst"),
            ("memory_unmanaged", "▓", "magenta", "unmanaged"),
            ("memory_headroom", "▒", "bright_black", "headroom"), ("memory_free", "░", "green", "free"))


class Client(Protocol):
    """What these commands need of the manager's REST client (``docker_gpu.Manager``)."""

    def call(self, method: str, path: str, *, params: dict[str, str] | None = None, json_body: Any = None) -> Any:
        """One REST call; the JSON answer."""
        ...


# --- stats -----------------------------------------------------------------------------------
def stats(client: Client, argv: list[str], error: type[Exception]) -> int:
    """``docker gpu stats [-a] [--no-stream] [--format table|json] [CONTAINER...]``.

    ``error`` is the plugin's ``PluginError``, what the client's calls raise: with ``--no-stream`` it ends the
    command (one line, exit 1; so does a CONTAINER that matches none, as in ``docker stats``), and the live views
    show it and try again a second later (CONTAINERs that match none yet show nothing). It is passed in rather than
    imported because ``python -m gpumgr.plugin.docker_gpu`` runs that module as ``__main__``, whose
    ``PluginError`` is not the one an import would give.
    """
    parser = argparse.ArgumentParser(prog="docker gpu stats", description="GPU memory of containers, like "
                                     "'docker stats'. Without --no-stream it refreshes every second until "
                                     "Ctrl-C; with --format json it then prints one JSON array per line.")
    parser.add_argument("-a", "--all", action="store_true", help="also queued and ended containers")
    parser.add_argument("--no-stream", action="store_true", help="print once and exit")
    parser.add_argument("--format", choices=["table", "json"], default="table")
    parser.add_argument("containers", nargs="*", metavar="CONTAINER", help="id, container id or name (prefix)")
    args = parser.parse_args(argv)

    def rows() -> list[dict[str, Any]]:
        chosen = select(client.call("GET", "/v1/containers")["containers"], args.containers, everything=args.all)
        missing = [word for word in args.containers if not select(chosen, [word], everything=True)]
        if missing and args.no_stream:
            raise error(f"no such container: {', '.join(missing)}" + ("" if args.all else " (running; -a for all)"))
        return [stats_row(r) for r in chosen]

    try:
        if args.format == "json":
            return _stats_json(rows, args.no_stream, error)
        return _stats_table(rows, args.no_stream, error, with_state=args.all)
    except KeyboardInterrupt:  # Ctrl-C is how the live views end
        return 0
    except BrokenPipeError:  # e.g. '| head -1': the reader has what it wanted
        _silence_stdout()
        return 0


def select(records: Sequence[dict[str, Any]], wanted: Sequence[str], *, everything: bool) -> list[dict[str, Any]]:
    """The records to show: live ones (all with ``everything``), and with ``wanted`` only those whose id,
    engine container id or name starts with one of its words, as ``docker stats NAME`` filters."""
    chosen = [r for r in records if everything or r["state"] in LIVE]
    if wanted:
        chosen = [r for r in chosen
                  if any(str(r.get(key) or "").startswith(word) for word in wanted
                         for key in ("id", "container_id", "name"))]
    return chosen


def stats_row(record: dict[str, Any]) -> dict[str, Any]:
    """A container record as one object of ``--format json`` (the keys of ``JSON_KEYS``).

    ``percent`` is what it uses of all it was granted (``gpu_memory`` × ``gpu_count``), rounded to one
    decimal: above 100 it is over its grant (a burster may be, up to its ``limit_bytes`` per GPU, the grant
    itself for any other). ``container_id`` is the engine's full id (a pid for host
    processes), null while queued.
    """
    granted = record["gpu_memory"] * record["gpu_count"]
    used = record["gpu_memory_used"]
    return {"id": record["id"], "container_id": record.get("container_id"), "name": record["name"],
            "node": record["node"], "gpus": record["gpus"], "grant_bytes": record["gpu_memory"],
            "gpu_count": record["gpu_count"], "used_bytes": used, "peak_bytes": record["gpu_memory_peak"],
            "percent": round(100 * used / granted, 1) if granted else None, "state": record["state"],
            "compute_share": record.get("compute_share") or 0,
            "limit_bytes": max(record.get("gpu_memory_limit") or 0, record["gpu_memory"])}


def grant_text(per_gpu: int, count: int, limit: int = 0) -> str:
    """A grant as people say it: ``8GiB`` for one GPU, ``2×8GiB`` for two GPUs of 8 GiB each, and a burstable
    grant's limit after a slash (``4GiB/12GiB``: 4 GiB guaranteed, up to 12 GiB while the GPU has room)."""
    burst = f"/{format_bytes(limit)}" if limit > per_gpu else ""
    return (format_bytes(per_gpu) if count == 1 else f"{count}×{format_bytes(per_gpu)}") + burst


def share_text(share: int) -> str:
    """A compute share as the SHARE column shows it: ``25%`` of each GPU's SMs, ``-`` for none."""
    return f"{share}%" if share else "-"


def stats_table(rows: Sequence[dict[str, Any]], with_state: bool = False) -> Table:
    """The ``docker stats``-like table of ``rows`` (objects of ``stats_row``).

    ``with_state`` (``-a``, where queued and ended containers are listed too) adds a STATE column after NAME,
    so that an ended container's last figures are not taken for a live one's.
    """
    from rich.text import Text

    state_column = ("STATE",) if with_state else ()
    table = _table("CONTAINER ID", "NAME", *state_column, "NODE", "GPU", "GRANT", "SHARE", "USED", "PEAK", "%",
                   right_from=4 + len(state_column))
    for row in rows:
        percent = row["percent"]
        style = "" if percent is None else "bold red" if percent > 100 else "yellow" if percent >= WARN_PERCENT else ""
        state = (Text(row["state"], style=STATE_STYLES.get(row["state"], "")),) if with_state else ()
        table.add_row(str(row["container_id"] or "-")[:12], row["name"], *state, row["node"] or "-",
                      ",".join(str(g["index"]) for g in row["gpus"]) or "-",
                      grant_text(row["grant_bytes"], row["gpu_count"], row["limit_bytes"]),
                      share_text(row["compute_share"]),
                      format_bytes(row["used_bytes"]),
                      format_bytes(row["peak_bytes"]), Text("-" if percent is None else f"{percent:.1f}%", style=style))
    return table


def _stats_table(rows: Callable[[], list[dict[str, Any]]], once: bool, error: type[Exception],
                 with_state: bool) -> int:
    console = _console()
    if once:
        console.print(stats_table(rows(), with_state))
        return 0

    def frame() -> RenderableType:
        try:
            return stats_table(rows(), with_state)
        except error as exc:  # the manager is away: say so where the table goes, and try again
            from rich.text import Text

            return Text(f"docker gpu: {exc} (retrying every {INTERVAL:g}s)", style="red")

    if not console.is_terminal:  # a pipe or a file: one table per refresh, one after another
        for _ in _ticks():
            console.print(frame())
            console.print()
            console.file.flush()
        return 0
    from rich.live import Live

    with Live(frame(), console=console, auto_refresh=False) as live:
        for _ in _ticks(skip_first=True):
            live.update(frame(), refresh=True)
    return 0  # pragma: no cover - _ticks never ends; Ctrl-C leaves through stats()


def _stats_json(rows: Callable[[], list[dict[str, Any]]], once: bool, error: type[Exception]) -> int:
    if once:
        print(json.dumps(rows()))
        return 0
    for _ in _ticks():  # JSON lines: one array per refresh
        try:
            line = json.dumps(rows())
        except error as exc:  # keep stdout parseable: the error goes to stderr, and the next second tries again
            print(f"docker gpu: {exc}", file=sys.stderr, flush=True)
            continue
        print(line, flush=True)
    return 0  # pragma: no cover - _ticks never ends


def _ticks(*, skip_first: bool = False) -> Iterator[int]:
    """Yield once per ``INTERVAL`` for ever, on a fixed schedule (a slow call does not shift later ones)."""
    start, count = time.monotonic(), 0
    if skip_first:
        count = 1
        time.sleep(max(0.0, start + INTERVAL - time.monotonic()))
    while True:
        yield count
        count += 1
        time.sleep(max(0.0, start + count * INTERVAL - time.monotonic()))


# --- nodes -----------------------------------------------------------------------------------
def nodes(client: Client, argv: list[str]) -> int:
    """``docker gpu nodes``: each node's GPUs with a bar of their memory and its figures.

    The bar's cells are proportional to the GPU's memory: granted to containers (reserved), used by
    what no grant explains (unmanaged), kept back (headroom), and free to grant. The call's errors reach the
    caller, which prints them as one line.
    """
    parser = argparse.ArgumentParser(prog="docker gpu nodes", description="The machine × GPU map, one row and "
                                     "one bar per GPU.")
    parser.parse_args(argv)
    table = nodes_table(client.call("GET", "/v1/nodes")["nodes"])
    try:
        _console().print(table)
    except BrokenPipeError:
        _silence_stdout()
    return 0


def nodes_table(node_list: Sequence[dict[str, Any]]) -> RenderableType:
    """The table of ``docker gpu nodes`` with a legend of the bar under it."""
    from rich.console import Group
    from rich.text import Text

    table = _table("NODE", "STATE", "GPU", "NAME", "MEMORY", "TOTAL", "RESERVED", "BURST", "USED", "FREE",
                   "CONTAINERS", right_from=5)
    for node in node_list:
        state = Text(node["state"], style="green" if node["state"] == "ready" else "red")
        if not node["gpus"]:
            table.add_row(node["name"], state, "-", "(no GPUs)", "", "", "", "", "", "", "0")
        for gpu in node["gpus"]:
            name = gpu["name"] if gpu.get("healthy", True) else Text(f"{gpu['name']} (unhealthy: {gpu.get('health')})",
                                                                     style="red")  # issue 23
            table.add_row(node["name"], state, str(gpu["index"]), name, gpu_bar(gpu),
                          format_bytes(gpu["memory_total"]), format_bytes(gpu["memory_reserved"]),
                          format_bytes(gpu.get("memory_burst") or 0), format_bytes(gpu["memory_used"]),
                          format_bytes(gpu["memory_free"]), str(len(gpu["containers"])))
    legend = Text("MEMORY: ")
    for index, (_, char, style, name) in enumerate(SEGMENTS):
        legend.append(char, style=style).append(f" {name}" + (", " if index < len(SEGMENTS) - 1 else ""))
    return Group(table, Text(""), legend)


def gpu_bar(gpu: dict[str, Any], width: int = BAR_WIDTH) -> Text:
    """A GPU's memory as a ``rich.text.Text`` of ``width`` cells, a styled run of block characters per segment."""
    from rich.text import Text

    bar = Text()
    for (_, char, style, _), cells in zip(SEGMENTS, bar_cells(gpu, width), strict=True):
        bar.append(char * cells, style=style)
    return bar


def bar_cells(gpu: dict[str, Any], width: int = BAR_WIDTH) -> list[int]:
    """How many of ``width`` cells each of ``SEGMENTS`` gets: proportional to its bytes (largest remainders),
    at least one for any segment that is not zero so that a small grant still shows, summing to ``width``."""
    sizes = [max(0, int(gpu.get(key) or 0)) for key, *_ in SEGMENTS]
    total = max(sum(sizes), int(gpu.get("memory_total") or 0))
    if total <= 0:
        return [0] * (len(SEGMENTS) - 1) + [width]
    exact = [size * width / total for size in sizes]
    cells = [max(int(value), 1 if size else 0) for value, size in zip(exact, sizes, strict=True)]
    order = sorted(range(len(sizes)), key=lambda i: exact[i] - int(exact[i]), reverse=True)
    for i in order:  # hand out what flooring left, largest remainder first
        if sum(cells) >= width:
            break
        if sizes[i]:
            cells[i] += 1
    while sum(cells) < width:  # nothing recorded covers it all (e.g. an agent that reports no free): show as free
        cells[-1] += 1
    while sum(cells) > width:  # the minimum of one cell overshot: take from the largest
        cells[max(range(len(cells)), key=lambda i: cells[i])] -= 1
    return cells


# --- helpers ---------------------------------------------------------------------------------
def _console() -> Console:
    """A console for stdout; wide when it is not a terminal, so that piped tables are never cut or wrapped."""
    from rich.console import Console

    class Quiet(Console):
        def on_broken_pipe(self) -> None:
            """rich exits 1 on a closed pipe; leave through ``stats``, which exits 0 as the JSON view does."""
            _silence_stdout()
            raise BrokenPipeError

    console = Quiet()
    if not console.is_terminal:
        console = Quiet(width=PIPE_WIDTH)
    return console


def _table(*headers: str, right_from: int) -> Table:
    """A borderless table with bold headers (docker's look, and plain columns when piped); the columns from
    ``right_from`` on hold figures and are aligned right."""
    from rich.table import Table

    table = Table(box=None, pad_edge=False, header_style="bold", show_edge=False)
    for index, header in enumerate(headers):
        table.add_column(header, no_wrap=True, justify="right" if index >= right_from else "left")
    return table


def _silence_stdout() -> None:
    """After a closed pipe, point stdout at /dev/null so that Python's exit flush does not fail again."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
