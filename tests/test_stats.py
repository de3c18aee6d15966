"""``docker gpu stats`` and ``docker gpu nodes`` against a real manager, agent and engine.

Real parts: a ``gpumgr manager`` process, a ``gpumgr agent`` process driving the Docker engine on two
simulated 24 GiB GPUs, containers whose GPU usage is declared by a real process inside them, and the plugin
run both in this process (``docker_gpu.main``) and as its own process (``python -m gpumgr.plugin.docker_gpu``),
live views included, stopped with a real SIGINT.
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from gpumgr.plugin import docker_gpu, stats
from gpumgr.wire.units import format_bytes
from tests.procs import ManagerProc, wait_for

GiB = 1 << 30
MiB = 1 << 20
USAGE = "/tmp/use"
UNREACHABLE = "http://127.0.0.1:1"
#: The plugin as a process sees no token or settings of whoever runs the tests.
ENV = {k: v for k, v in os.environ.items() if k not in ("GPUMGR_TOKEN", "GPUMGR_MANAGER")}


def create(manager: ManagerProc, image: str, name: str, use: int, **extra: Any) -> dict[str, Any]:
    """A container granted 2 GiB whose process declares ``use`` bytes of simulated GPU usage."""
    body = {"image": image, "gpu_memory": "2GiB", "name": name, "env": {"GPUMGR_SIM_USAGE_FILE": USAGE},
            "command": ["sh", "-c", f"echo {use} > {USAGE}; trap 'exit 0' TERM; while :; do sleep 1; done"],
            **extra}
    response = manager.post("/v1/containers", json=body)
    assert response.status_code in (201, 202), response.text
    return response.json()


def wait_used(manager: ManagerProc, record: dict[str, Any], used: int) -> dict[str, Any]:
    return wait_for(lambda: (r := manager.get(f"/v1/containers/{record['id']}").json())["gpu_memory_used"] == used
                    and r, 20, what=f"{record['name']} to use {used} bytes")


@pytest.fixture
def two(manager, docker_agent, test_image) -> tuple[ManagerProc, dict[str, Any], dict[str, Any]]:
    """The manager with two running containers: ``stats-one`` uses 1 GiB of 2, ``stats-two`` 512 MiB."""
    one = create(manager, test_image, "stats-one", GiB)
    other = create(manager, test_image, "stats-two", 512 * MiB)
    return manager, wait_used(manager, one, GiB), wait_used(manager, other, 512 * MiB)


def plugin(url: str, *args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``docker gpu --manager URL ARGS`` in this process: status, stdout, stderr."""
    status = docker_gpu.main(["gpu", "--manager", url, *args])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def command(url: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "gpumgr.plugin.docker_gpu", "gpu", "--manager", url, *args]


def columns(line: str) -> list[str]:
    """A row of a piped table: its columns are at least two spaces apart (names may hold single ones)."""
    return re.split(r"\s{2,}", line.strip())


def rows_of(table: str) -> dict[str, list[str]]:
    return {columns(line)[1]: columns(line) for line in table.splitlines()[1:] if line.strip()}


def test_stats_table_and_json_show_grant_usage_and_peak(two, capsys):
    manager, one, _ = two
    status, out, err = plugin(manager.url, "stats", "--no-stream", capsys=capsys)
    assert status == 0 and err == "", err
    assert "\x1b[" not in out  # captured, not a terminal: plain text
    assert columns(out.splitlines()[0]) == ["CONTAINER ID", "NAME", "NODE", "GPU", "GRANT", "SHARE", "USED", "PEAK",
                                            "%"]
    rows = rows_of(out)
    assert set(rows) == {"stats-one", "stats-two"}, out
    assert rows["stats-one"] == [one["container_id"][:12], "stats-one", "node-a", str(one["gpus"][0]["index"]),
                                 "2GiB", "-", "1GiB", "1GiB", "50.0%"]
    assert rows["stats-two"][4:] == ["2GiB", "-", "512MiB", "512MiB", "25.0%"]

    result = subprocess.run(command(manager.url, "stats", "--format", "json", "--no-stream"), capture_output=True,
                            text=True, timeout=30, env=ENV)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    objects = {o["name"]: o for o in json.loads(result.stdout)}
    assert all(list(o) == list(stats.JSON_KEYS) for o in objects.values())
    assert objects["stats-one"] == {
        "id": one["id"], "container_id": one["container_id"], "name": "stats-one", "node": "node-a",
        "gpus": one["gpus"], "grant_bytes": 2 * GiB, "gpu_count": 1, "used_bytes": GiB, "peak_bytes": GiB,
        "percent": 50.0, "state": "running", "compute_share": 0, "limit_bytes": 2 * GiB}
    assert objects["stats-two"]["percent"] == 25.0

    # a name, an id or an engine id (or a prefix of one) picks containers, like docker stats NAME
    for word in ("stats-one", "stats-o", one["id"], one["container_id"][:8]):
        status, out, _ = plugin(manager.url, "stats", "--no-stream", word, capsys=capsys)
        assert status == 0 and set(rows_of(out)) == {"stats-one"}, (word, out)
    status, out, _ = plugin(manager.url, "stats", "--no-stream", "--format", "json", "stats-t", capsys=capsys)
    assert [o["name"] for o in json.loads(out)] == ["stats-two"]
    status, out, err = plugin(manager.url, "stats", "--no-stream", "stats-one", "nope", capsys=capsys)
    assert status == 1 and out == "" and err == "docker gpu: no such container: nope (running; -a for all)\n", err


def test_stats_all_shows_ended_and_queued_containers(two, test_image, capsys):
    manager, _, other = two
    assert manager.delete(f"/v1/containers/{other['id']}").json()["state"] == "removed"
    # two GPUs of 23 GiB never fit while stats-one holds 2 GiB of one of the two: it waits
    waiting = create(manager, test_image, "stats-wait", 0, gpu_memory="23GiB", gpus=2, queue=True)
    assert waiting["state"] == "queued"

    status, out, _ = plugin(manager.url, "stats", "--no-stream", "--format", "json", capsys=capsys)
    assert status == 0 and [o["name"] for o in json.loads(out)] == ["stats-one"]
    status, out, _ = plugin(manager.url, "stats", "--no-stream", "--format", "json", "-a", capsys=capsys)
    states = {o["name"]: o for o in json.loads(out)}
    assert {n: o["state"] for n, o in states.items()} == {"stats-one": "running", "stats-two": "removed",
                                                          "stats-wait": "queued"}
    assert states["stats-two"]["peak_bytes"] == 512 * MiB
    assert states["stats-wait"]["node"] is None and states["stats-wait"]["container_id"] is None

    status, out, _ = plugin(manager.url, "stats", "--no-stream", "--all", capsys=capsys)
    assert status == 0
    # -a lists ended containers: the STATE tells them from live ones
    assert columns(out.splitlines()[0]) == ["CONTAINER ID", "NAME", "STATE", "NODE", "GPU", "GRANT", "SHARE", "USED",
                                            "PEAK", "%"]
    rows = rows_of(out)
    assert set(rows) == {"stats-one", "stats-two", "stats-wait"}, out
    assert rows["stats-one"][2] == "running" and rows["stats-two"][2] == "removed"
    assert rows["stats-two"][8] == "512MiB"  # the peak stays after the end
    assert rows["stats-wait"][:6] == ["-", "stats-wait", "queued", "-", "-", "2×23GiB"]
    manager.delete(f"/v1/containers/{waiting['id']}")


def test_nodes_shows_a_bar_and_the_figures_of_each_gpu(two, capsys):
    manager, one, other = two
    status, out, err = plugin(manager.url, "nodes", capsys=capsys)
    assert status == 0 and err == "", err
    assert "\x1b[" not in out
    lines = out.splitlines()
    assert columns(lines[0]) == ["NODE", "STATE", "GPU", "NAME", "MEMORY", "TOTAL", "RESERVED", "BURST", "USED",
                                 "FREE", "CONTAINERS"]
    rows = {columns(line)[2]: columns(line) for line in lines[1:] if line.startswith("node-a")}
    gpus = manager.node("node-a")["gpus"]
    assert sorted(rows) == sorted(str(g["index"]) for g in gpus) and len(gpus) == 2, out
    held = {g["uuid"] for r in (one, other) for g in r["gpus"]}
    for gpu in gpus:
        row = rows[str(gpu["index"])]
        assert row[:4] == ["node-a", "ready", str(gpu["index"]), gpu["name"]]
        assert row[5:] == [format_bytes(gpu["memory_total"]), format_bytes(gpu["memory_reserved"]),
                           format_bytes(gpu["memory_burst"]), format_bytes(gpu["memory_used"]),
                           format_bytes(gpu["memory_free"]), str(len(gpu["containers"]))]
        bar = row[4]
        assert len(bar) == stats.BAR_WIDTH and set(bar) <= {"█", "▓", "▒", "░"}, bar
        assert ("█" in bar) == (gpu["uuid"] in held) and "░" in bar
        assert bar.count("█") == stats.bar_cells(gpu)[0]
    assert format_bytes(24 * GiB) in out and "reserved" in lines[-1] and "free" in lines[-1]


def test_bar_cells_are_proportional_and_show_small_segments():
    gpu = {"memory_total": 100, "memory_reserved": 50, "memory_unmanaged": 0, "memory_headroom": 0,
           "memory_free": 50}
    assert stats.bar_cells(gpu, 10) == [5, 0, 0, 0, 5]
    tiny = {"memory_total": 1000, "memory_reserved": 1, "memory_unmanaged": 2, "memory_headroom": 0,
            "memory_free": 997}
    assert stats.bar_cells(tiny, 10) == [1, 0, 1, 0, 8]
    thirds = {"memory_total": 3, "memory_reserved": 1, "memory_unmanaged": 1, "memory_headroom": 0, "memory_free": 1}
    assert sum(stats.bar_cells(thirds, 10)) == 10
    assert stats.bar_cells({"memory_total": 0}, 10) == [0, 0, 0, 0, 10]
    burst = {"memory_total": 24, "memory_reserved": 4, "memory_burst": 6, "memory_unmanaged": 0, "memory_headroom": 0,
             "memory_free": 14}  # a 4 GiB grant using 10: its 6 above the grant are not free
    assert stats.bar_cells(burst, 12) == [2, 3, 0, 0, 7]
    assert stats.grant_text(8 * GiB, 1) == "8GiB" and stats.grant_text(8 * GiB, 2) == "2×8GiB"
    assert stats.grant_text(4 * GiB, 1, 12 * GiB) == "4GiB/12GiB" and stats.grant_text(4 * GiB, 1, 4 * GiB) == "4GiB"


class Reader:
    """Collects what a child process writes to one file descriptor, in a thread, with arrival times."""

    def __init__(self, fd: int) -> None:
        self.chunks: list[tuple[float, bytes]] = []
        self._fd = fd
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while True:
            ready, _, _ = select.select([self._fd], [], [], 0.2)
            if not ready:
                continue
            try:
                data = os.read(self._fd, 65536)
            except OSError:  # a pty's master reads EIO once the child is gone
                return
            if not data:
                return
            self.chunks.append((time.monotonic(), data))

    def text(self) -> str:
        return b"".join(data for _, data in self.chunks).decode(errors="replace")

    def join(self) -> None:
        self._thread.join(5)


def ctrl_c_reaches_it() -> None:
    """In the child before exec: SIGINT as a terminal's Ctrl-C finds it, even when this test run ignores SIGINT.

    A run started in the background by a non-interactive shell (``.ci/run &``) ignores SIGINT, its
    children inherit that, and Python then installs no KeyboardInterrupt handler.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupt(process: subprocess.Popen[bytes]) -> tuple[int, str]:
    """Ctrl-C: SIGINT, then the exit status and stderr."""
    process.send_signal(signal.SIGINT)
    try:
        _, err = process.communicate(timeout=10)
    finally:
        if process.poll() is None:
            process.kill()
    return process.returncode, err.decode(errors="replace")


def test_live_json_lines_refresh_every_second_until_ctrl_c(two):
    manager, *_ = two
    process = subprocess.Popen(command(manager.url, "stats", "--format", "json"), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, env=ENV, preexec_fn=ctrl_c_reaches_it)
    assert process.stdout is not None
    reader = Reader(process.stdout.fileno())
    try:
        wait_for(lambda: reader.text().count("\n") >= 3, 15, what="three refreshes")
    finally:
        status, err = interrupt(process)
    reader.join()
    assert status == 0 and "Traceback" not in err, err
    lines = reader.text().splitlines()
    assert len(lines) >= 3
    for line in lines:
        assert {o["name"]: o["used_bytes"] for o in json.loads(line)} == {"stats-one": GiB, "stats-two": 512 * MiB}
    times = [t for t, data in reader.chunks]
    assert times[-1] - times[0] >= 1.5, "refreshes come about once a second, not as fast as possible"


def test_live_table_on_a_terminal_redraws_until_ctrl_c(two):
    manager, *_ = two
    master, slave = pty.openpty()
    process = subprocess.Popen(command(manager.url, "stats"), stdin=slave, stdout=slave, stderr=subprocess.PIPE,
                               env={**ENV, "TERM": "xterm-256color", "COLUMNS": "160"}, close_fds=True,
                               preexec_fn=ctrl_c_reaches_it)
    os.close(slave)
    reader = Reader(master)
    try:
        wait_for(lambda: reader.text().count("CONTAINER ID") >= 2, 15, what="two redraws of the table")
        time.sleep(0.5)
    finally:
        status, err = interrupt(process)
        reader.join()
        os.close(master)
    assert status == 0 and "Traceback" not in err, err
    screen = reader.text()
    assert "stats-one" in screen and "50.0%" in screen and "node-a" in screen
    assert "\x1b[" in screen  # a terminal: the live view moves the cursor to redraw


def test_an_unreachable_manager_is_one_line_and_status_1(capsys):
    status, out, err = plugin(UNREACHABLE, "stats", "--no-stream", capsys=capsys)
    assert status == 1 and out == ""
    assert err.startswith("docker gpu: cannot reach the gpumgr manager at http://127.0.0.1:1") and \
        err.count("\n") == 1, err
    result = subprocess.run(command(UNREACHABLE, "nodes"), capture_output=True, text=True, timeout=30, env=ENV)
    assert result.returncode == 1 and result.stdout == "" and result.stderr.count("\n") == 1, result.stderr


def test_live_view_shows_an_unreachable_manager_and_keeps_trying():
    process = subprocess.Popen(command(UNREACHABLE, "stats"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env=ENV, preexec_fn=ctrl_c_reaches_it)
    assert process.stdout is not None
    reader = Reader(process.stdout.fileno())
    try:
        wait_for(lambda: reader.text().count("cannot reach") >= 2, 15, what="two attempts shown")
    finally:
        status, err = interrupt(process)
    reader.join()
    assert status == 0 and "Traceback" not in err, err
    assert "retrying" in reader.text()


def test_nodes_says_which_gpu_is_unhealthy_and_why():  # issue 23
    import io

    from rich.console import Console

    gpu = {"index": 0, "name": "Tesla T4", "memory_total": 16 * GiB, "memory_reserved": 0, "memory_used": 0,
           "memory_unmanaged": 0, "memory_headroom": 0, "memory_free": 16 * GiB, "containers": []}
    nodes = [{"name": "n", "state": "ready", "gpus": [gpu, {**gpu, "index": 1, "healthy": False,
                                                            "health": "fatal Xid 79 reported by the driver"}]}]
    out = io.StringIO()
    Console(file=out, width=240).print(stats.nodes_table(nodes))
    lines = out.getvalue().splitlines()
    assert "unhealthy" not in lines[1] and "Tesla T4 (unhealthy: fatal Xid 79 reported by the driver)" in lines[2]
