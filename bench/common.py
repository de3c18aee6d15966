"""What the benchmark scripts share: the machine they ran on, quantiles, and the enforcement benches' helpers."""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import docker
import docker.errors

ROOT = Path(__file__).resolve().parent.parent
IMAGE = "gpumgr-test/busybox:latest"
#: Every container a bench starts carries this label with its run's id, so the run removes exactly its own.
RUN_LABEL = "gpumgr-bench.run"
#: Where the bench containers declare their simulated usage (GPUMGR_SIM_USAGE_FILE).
USAGE = "/tmp/use"
TICK = os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) by linear interpolation between closest ranks."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo, hi = int(pos), min(int(pos) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def machine(**extra: Any) -> dict[str, Any]:
    """CPU, Python, kernel, load and commit of this run, plus ``extra``: printed with every result."""
    model = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {"nproc": os.cpu_count(), "cpu_model": model, "python": platform.python_version(),
            "kernel": platform.release(), "loadavg_at_start": os.getloadavg(), "commit": commit(), **extra}


def commit() -> str:
    """The checkout's HEAD, with ``+dirty`` when tracked files differ from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cpu_seconds(pid: int, task: int | None = None) -> float:
    """utime+stime of a process (all its threads) or of one of its threads, in seconds."""
    path = f"/proc/{pid}/stat" if task is None else f"/proc/{pid}/task/{task}/stat"
    fields = Path(path).read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # fields 14 and 15 of man 5 proc


def write_usage(pid: int, value: int) -> None:
    """Write ``value`` into the container's usage file from the host, in one write() after O_TRUNC."""
    fd = os.open(f"/proc/{pid}/root{USAGE}", os.O_WRONLY | os.O_TRUNC)
    try:
        os.write(fd, f"{value}\n".encode())
    finally:
        os.close(fd)


def remove_run(client: docker.DockerClient, run_id: str) -> int:
    """Force-remove every container of run ``run_id``; returns how many there were."""
    found = client.containers.list(all=True, filters={"label": f"{RUN_LABEL}={run_id}"})

    def rm(container: Any) -> None:
        with contextlib.suppress(docker.errors.APIError):
            container.remove(force=True)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(rm, found))
    return len(found)


def agent_env(args: argparse.Namespace) -> dict[str, str]:
    """The agent settings ``--poll-interval`` and ``--sample-interval`` asked for, as GPUMGR_* variables."""
    env = {}
    if args.poll_interval is not None:
        env["GPUMGR_POLL_INTERVAL"] = str(args.poll_interval)
    if args.sample_interval is not None:
        env["GPUMGR_SAMPLE_INTERVAL"] = str(args.sample_interval)
    return env


def interrupt(*_: Any) -> None:
    """SIGTERM ends the run like Ctrl-C, so the cleanup still runs."""
    raise KeyboardInterrupt
