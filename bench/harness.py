"""The bench harness: what every script in bench/ needs besides its own measurement.

Numbers (``pct``, ``median``, ``summary``, ``table``), the machine's facts (``machine``), ``save``
for ``--json``, child processes (``Proc``, ``free_port``, ``wait_for``) and ``stack()``: a ``gpumgr
manager`` and N agents on free loopback ports with a ``Client`` bound to the manager, stopped and
their containers removed on exit; plus the busybox test image and the enforcement benches' /proc
tools. Scripts import it as ``bench.harness``: ``python bench/x.py`` puts the repository root on
sys.path first, ``python -m bench.x`` from the root has it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, TypeVar

import docker  # type: ignore[import-untyped, unused-ignore]
import docker.errors  # type: ignore[import-untyped, unused-ignore]
import requests

from tests.images import IMAGE, busybox_tar

ROOT = Path(__file__).resolve().parent.parent
#: Every container a bench makes carries this label with its run's id, so the run removes exactly its own.
RUN_LABEL = "gpumgr-bench.run"
NODE_LABEL = "gpumgr.node"  # what the agent labels its node's containers with
#: Where bench containers declare their simulated GPU memory use (GPUMGR_SIM_USAGE_FILE).
USAGE = "/tmp/use"
TICK = os.sysconf("SC_CLK_TCK")
GiB, MiB = 1 << 30, 1 << 20
START_TIMEOUT = 20.0
T = TypeVar("T")


# --- numbers and results ---------------------------------------------------------------------------
def pct(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) by linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo, hi = int(pos), min(int(pos) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def median(values: Iterable[float]) -> float:
    """The median, every bench's central figure."""
    return float(statistics.median(values))


def summary(values: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """n, min, median (= p50), p90, p99, max and mean of ``values``, each times ``scale`` (1000: s → ms)."""
    v = [x * scale for x in values]
    return {"n": len(v), "min": min(v), "median": median(v), "p50": pct(v, 0.5), "p90": pct(v, 0.9),
            "p99": pct(v, 0.99), "max": max(v), "mean": sum(v) / len(v)}


def table(columns: Sequence[tuple[str, str]], rows: Iterable[Sequence[Any]], lead: str = "", note: str = "") -> None:
    """Print a result table; ``columns`` are (title, format spec of its cells such as ``"12,.0f"``).

    The header is ``lead``, the titles at their spec's width (the first left-aligned, the others
    right-aligned), then ``note``; then one line per row, each cell formatted with its spec.
    """
    widths = [int(re.search(r"\d+", spec).group()) for _, spec in columns]  # type: ignore[union-attr]
    titles = [f"{t:{w}}" if i == 0 else f"{t:>{w}}" for i, ((t, _), w) in enumerate(zip(columns, widths, strict=True))]
    print(lead + " ".join(titles) + note)
    for row in rows:
        print(" ".join(format(cell, spec) for cell, (_, spec) in zip(row, columns, strict=True)))


def save(path: str | Path | None, benchmark: str, args: argparse.Namespace, **data: Any) -> None:
    """With ``--json PATH``: ``data`` as JSON after the benchmark's name, its arguments and ``machine()``."""
    if path:
        head = {"benchmark": benchmark, "machine": data.pop("machine", None) or machine(), "args": vars(args)}
        Path(path).write_text(json.dumps({**head, **data}, indent=2, default=str))


# --- the machine -----------------------------------------------------------------------------------
def machine(**extra: Any) -> dict[str, Any]:
    """CPU, cores, memory, kernel, Python, Docker engine, load and commit of this run, plus ``extra``."""
    memory = _proc_value("/proc/meminfo", "MemTotal").split()
    return {"nproc": os.cpu_count(), "cpu_model": _proc_value("/proc/cpuinfo", "model name") or "unknown",
            "memory_gib": round(int(memory[0]) / (1 << 20), 1) if memory else None,
            "python": platform.python_version(), "kernel": platform.release(),
            "docker": first_line(["docker", "version", "--format", "{{.Server.Version}}"]) or None,
            "loadavg_at_start": os.getloadavg(), "commit": commit(), **extra}


def machine_line(info: Mapping[str, Any]) -> str:
    """The short form printed under a result: cores, CPU model and commit."""
    return f"machine {info['nproc']} x {info['cpu_model']}; commit {info['commit']}"


def _proc_value(path: str, key: str) -> str:
    """What follows ``key:`` in a /proc file such as /proc/cpuinfo, or "" without it."""
    with contextlib.suppress(OSError):
        for line in Path(path).read_text().splitlines():
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    return ""


def commit(tree: Path = ROOT) -> str:
    """The checkout's HEAD (or ``tree``'s), with ``+dirty`` when tracked files differ from it."""
    head = first_line(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"])
    dirty = first_line(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"])
    return head + ("+dirty" if dirty else "") if head else "unknown"


def first_line(argv: list[str]) -> str:
    """The first line of a command's stdout, or "" when it cannot run or fails."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip().split("\n")[0] if done.returncode == 0 else ""


# --- processes -------------------------------------------------------------------------------------
def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(predicate: Callable[[], T], timeout: float = 10.0, interval: float = 0.05, what: str = "it") -> T:
    """Call ``predicate`` until it returns something truthy, and return that; TimeoutError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:g} s for {what}")
        time.sleep(interval)
    return value


def answers(url: str) -> bool:
    """Whether ``GET url`` answers 2xx within a second."""
    try:
        return requests.get(url, timeout=1).ok
    except requests.RequestException:
        return False


def interrupt(*_: Any) -> None:
    """SIGTERM handler: end the run like Ctrl-C, so that the cleanup still runs."""
    raise KeyboardInterrupt


class Proc:
    """A child process in its own session (in ``cwd``, the checkout by default), its stdout and stderr in ``log``."""

    def __init__(self, argv: Sequence[str], log: Path, env: Mapping[str, str] | None = None,
                 cwd: Path = ROOT) -> None:
        self.log, self._out = log, open(log, "ab")  # noqa: SIM115 - held for the child's lifetime, closed in stop()
        self.popen = subprocess.Popen(list(argv), cwd=cwd, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                      stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = self.popen.pid

    def check(self) -> bool:
        """True while the process runs; once it has exited, raise with the end of its log."""
        if self.popen.poll() is not None:
            tail = self.log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{self.log.name}: exited with {self.popen.returncode}:\n{tail}")
        return True

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL to the whole group after ``timeout`` s; returns the exit code."""
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(timeout)
        self._out.close()
        return self.popen.returncode


def gpumgr(args: Sequence[str], log: Path, env: Mapping[str, str] | None = None, tree: Path | None = None) -> Proc:
    """``python -m gpumgr ARGS``, as the README starts the manager and the agents.

    With ``tree``, the gpumgr of another checkout runs instead (its ``.venv``, in its folder): a bench
    measures the code before a change with its own, newer measuring code.
    """
    if tree is None:
        return Proc([sys.executable, "-m", "gpumgr", *args], log, env)
    return Proc([str(tree / ".venv" / "bin" / "python"), "-m", "gpumgr", *args], log, env, cwd=tree)


class Client(requests.Session):
    """A keep-alive HTTP session bound to ``base``: ``client.get("/v1/nodes")``; every call has a timeout."""

    def __init__(self, base: str, timeout: float = 90.0) -> None:
        super().__init__()
        self.base, self.timeout = base, timeout

    def request(self, method: str | bytes, url: str | bytes, *args: Any, **kwargs: Any) -> requests.Response:
        """``Session.request`` with ``url`` relative to ``base`` unless absolute, and the default timeout."""
        kwargs.setdefault("timeout", self.timeout)
        path = url.decode() if isinstance(url, bytes) else url
        return super().request(method, path if path.startswith("http") else self.base + path, *args, **kwargs)


# --- the stack -------------------------------------------------------------------------------------
@dataclass
class Stack:
    """A running manager and its agents, as ``stack()`` yields them."""

    run_id: str
    tmp: Path
    manager: Proc
    url: str
    endpoint: str
    api: Client
    agents: list[Proc] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)
    join_token: str | None = None  # what agents join with, where the link is secured (gpumgr.wire.security)
    tree: Path | None = None  # the checkout whose gpumgr runs (None: this one)

    @property
    def labels(self) -> dict[str, str]:
        """The label every container of this run carries (``create`` adds it)."""
        return {RUN_LABEL: self.run_id}

    @cached_property
    def docker(self) -> Any:
        """A docker-py client of the local engine (made on first use, closed with the stack)."""
        return docker.from_env(timeout=60)

    def create(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """POST /v1/containers with this run's label; the record, which must be a 201 in state running."""
        reply = self.api.post("/v1/containers", json={**body, "labels": {**body.get("labels", {}), **self.labels}})
        if reply.status_code != 201 or reply.json()["state"] != "running":
            raise RuntimeError(f"POST /v1/containers answered {reply.status_code}: {reply.text}")
        return dict(reply.json())

    def create_using(self, grant: int | str, use: int, **extra: Any) -> dict[str, Any]:
        """A container granted ``grant`` that declares ``use`` bytes of simulated GPU memory in its usage file."""
        return self.create({"image": IMAGE, "gpu_memory": grant, "env": {"GPUMGR_SIM_USAGE_FILE": USAGE},
                            "command": ["sh", "-c", f"echo {use} > {USAGE}; exec sleep 36000"], **extra})

    def pid(self, container_id: str) -> int:
        """The host PID of a container's first process."""
        return int(self.docker.api.inspect_container(container_id)["State"]["Pid"])

    def events(self, since: int = 0, **params: Any) -> list[dict[str, Any]]:
        """``GET /v1/events``: the manager's events after id ``since``."""
        return list(self.api.get("/v1/events", params={"since": since, **params}).json()["events"])

    def remove_containers(self) -> int:
        """Force-remove every container of this run or of its agents' nodes; returns how many there were."""
        filters = [f"{RUN_LABEL}={self.run_id}", *(f"{NODE_LABEL}={n}" for n in self.nodes)]
        found = {c.id: c for f in filters for c in self.docker.containers.list(all=True, filters={"label": f})}
        for container in found.values():
            with contextlib.suppress(docker.errors.APIError):
                container.remove(force=True)
        return len(found)


@contextlib.contextmanager
def stack(agents: int = 1, *, name: str = "bench", gpus: str = "sim:2x24GiB", runtime: str = "docker",
          agent_env: Mapping[str, str] | None = None, manager_env: Mapping[str, str] | None = None,
          keep_logs: bool = False, tree: Path | None = None) -> Iterator[Stack]:
    """A manager and ``agents`` agents (nodes ``NAME-RUNID-i``, ``--gpus GPUS --runtime RUNTIME``), all ready.

    Each process keeps its state (keys, join secret) in the stack's temporary folder; agents join with
    the manager's token, get network mode ``none`` and a hook socket of their own, then ``agent_env``.
    With the Docker runtime on the local engine (no DOCKER_HOST in ``agent_env``) the test image is
    built if missing and the run's containers are removed on exit. SIGTERM raises KeyboardInterrupt
    meanwhile. The processes' logs are deleted on exit unless ``keep_logs`` or the block failed.
    With ``tree``, the manager and agents are another checkout's (see ``gpumgr``).
    """
    api, port, run_id = free_port(), free_port(), uuid.uuid4().hex[:12]
    tmp = Path(tempfile.mkdtemp(prefix=f"gpumgr-{name}-"))
    local = runtime == "docker" and agents > 0 and "DOCKER_HOST" not in (agent_env or {})
    previous = signal.signal(signal.SIGTERM, interrupt)
    secure = importlib.util.find_spec("gpumgr.wire.security") is not None  # the link needs a join token
    state = ["--state-dir", str(tmp / "manager-state")] if secure else []
    proc = gpumgr(["manager", "--api", f"127.0.0.1:{api}", "--agents", f"tcp://127.0.0.1:{port}", *state],
                  tmp / "manager.log", manager_env, tree)
    url = f"http://127.0.0.1:{api}"
    s = Stack(run_id, tmp, proc, url, f"tcp://127.0.0.1:{port}", Client(url), tree=tree)
    ok = False
    try:
        if local:
            ensure_image(s.docker)
        wait_for(lambda: s.manager.check() and answers(f"{s.url}/healthz"), START_TIMEOUT, what="the manager")
        s.join_token = join_token(tmp / "manager-state", tree) if secure else None
        _agents(s, agents, name, ["--gpus", gpus, "--runtime", runtime], agent_env or {})
        yield s
        ok = True
    finally:
        _teardown(s, local, keep=keep_logs or not ok)
        signal.signal(signal.SIGTERM, previous)


def _agents(s: Stack, count: int, name: str, args: list[str], env: Mapping[str, str]) -> None:
    """Start ``count`` agents and wait until ``GET /v1/nodes`` shows every one ready."""
    for i in range(count):
        s.nodes.append(node := f"{name}-{s.run_id[:6]}-{i}")
        own = {"GPUMGR_NETWORK_MODE": "none", "GPUMGR_HOOK_SOCKET": str(s.tmp / f"hook-{i}.sock"), **env}
        join = ["--join", s.join_token, "--state-dir", str(s.tmp / f"{node}-state")] if s.join_token else []
        s.agents.append(gpumgr(["agent", "--manager", s.endpoint, "--node", node, *args, *join], s.tmp / f"{node}.log",
                               own, s.tree))

    def ready() -> bool:
        states = {n["name"]: n["state"] for n in s.api.get("/v1/nodes").json()["nodes"]}
        return all(a.check() for a in s.agents) and all(states.get(node) == "ready" for node in s.nodes)

    wait_for(ready, START_TIMEOUT, what=f"nodes {', '.join(s.nodes)} to be ready")


def join_token(state_dir: Path, tree: Path | None = None) -> str:
    """The manager's join token: the last line of ``gpumgr join-token --state-dir STATE_DIR`` (of ``tree``'s gpumgr)."""
    python = sys.executable if tree is None else str(tree / ".venv" / "bin" / "python")
    done = subprocess.run([python, "-m", "gpumgr", "join-token", "--state-dir", str(state_dir)], cwd=tree or ROOT,
                          capture_output=True, text=True, check=True)
    return done.stdout.strip().splitlines()[-1]


def _teardown(s: Stack, local: bool, keep: bool) -> None:
    """Stop the processes, remove the run's containers, close the clients, delete the logs or say where they are."""
    for proc in (*s.agents, s.manager):
        proc.stop()
    if local or "docker" in vars(s):
        with contextlib.suppress(docker.errors.DockerException, requests.RequestException):
            if removed := s.remove_containers():
                print(f"stack: removed {removed} container(s) of run {s.run_id}", file=sys.stderr)
        s.docker.close()
    s.api.close()
    if keep:
        print(f"stack: manager and agent logs kept in {s.tmp}", file=sys.stderr)
    else:
        shutil.rmtree(s.tmp, ignore_errors=True)


# --- Docker and the enforcement benches ------------------------------------------------------------
def ensure_image(client: Any) -> str:
    """The test image ``IMAGE`` on ``client``'s engine, imported from /bin/busybox when it is missing."""
    try:
        client.images.get(IMAGE)
    except docker.errors.ImageNotFound:
        client.api.import_image_from_data(busybox_tar(), repository=IMAGE.split(":")[0], tag=IMAGE.split(":")[1])
    return IMAGE


def write_usage(pid: int, value: int) -> None:
    """Write ``value`` into a container's usage file from the host, in one write() after O_TRUNC."""
    fd = os.open(f"/proc/{pid}/root{USAGE}", os.O_WRONLY | os.O_TRUNC)
    try:
        os.write(fd, f"{value}\n".encode())
    finally:
        os.close(fd)


def cpu_seconds(pid: int, task: int | None = None) -> float:
    """utime+stime of a process (all its threads) or of one of its threads, in seconds."""
    path = f"/proc/{pid}/stat" if task is None else f"/proc/{pid}/task/{task}/stat"
    fields = Path(path).read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # fields 14 and 15 of man 5 proc


def interval_options(parser: argparse.ArgumentParser) -> None:
    """``--poll-interval`` and ``--sample-interval``: the agent's enforcement settings (see ``interval_env``)."""
    for name, default in (("poll", "0.1"), ("sample", "1.0")):
        parser.add_argument(f"--{name}-interval", type=float, help=f"set the agent's GPUMGR_{name.upper()}_INTERVAL "
                            f"(default: leave the agent's default, {default} s)")


def interval_env(args: argparse.Namespace) -> dict[str, str]:
    """The agent settings ``--poll-interval`` and ``--sample-interval`` asked for, as GPUMGR_* variables."""
    return {f"GPUMGR_{name.upper()}_INTERVAL": str(value) for name in ("poll", "sample")
            if (value := getattr(args, f"{name}_interval")) is not None}
