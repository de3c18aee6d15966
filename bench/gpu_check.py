"""What only a real NVIDIA GPU can show (issue 36), with the process runtime, NVML and PyTorch jobs.

Run by ``.ci/gpu-check`` on a lent GPU machine (no Docker, no registry); each part prints its result
and all of them land in ``OUT/gpu_check.json``:

  1. **kill tail**: ``--jobs`` PyTorch jobs (3 GiB grants, 2 GiB held) on the GPU each allocate 2 GiB
     more at a staggered moment, random over ``--spread`` s; each latency is from that allocation's
     return (``torch.cuda.synchronize()`` after it, the job's own clock) to the process's exit (a pidfd
     of it turning readable); every job must end ``killed`` for ``gpu_memory_exceeded``. No MPS here.
  2. **example**: ``examples/pytorch/train.py`` under a 6 GiB grant exits 0, never killed.
  3. **MPS cap** (only if ``nvidia-cuda-mps-control`` is there; it is started, and the agent runs with
     ``mps: true``): a job granted 2 GiB that asks for 2 GiB more meets CUDA's ``OutOfMemoryError`` and
     exits 3, not killed; a 4 GiB job beside it holding 3 GiB exits 0.
  4. **compute shares** (MPS): two jobs with ``compute_share`` 25 and 75 run bf16 8192³ matrix products
     for ``--seconds`` at once; their TFLOP/s ratio must be within ±15% of 3.
  5. **burst reclaimed** (MPS, the manager's ``burst_min_runtime`` 1 s): a burster with ``gpu_memory``
     4 GiB and ``gpu_memory_limit`` 12 GiB holds 10 GiB; then a request for the GPU's free bytes plus
     2 GiB is created: it is answered 201 once the burster ends ``preempted``/``burst_reclaimed``.

    python bench/gpu_check.py [--out DIR] [--jobs 10] [--rounds 2] [--parts tail,example,mps,shares,burst]
    python bench/gpu_check.py job ...    # what each PyTorch job runs (see ``job_main``)

A part the tree does not support (the REST answers 4xx to a field) is reported as such, not failed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GiB = 1 << 30
PARTS = ("tail", "example", "mps", "shares", "burst")
#: The matrix products of the compute-share part: bf16, 8192³, as the H200 figures of issue 36.
MATMUL_SIZE = 8192
#: Exit status of a job that met CUDA's OutOfMemoryError.
EXIT_OOM = 3
#: How every crossing job must end.
KILLED = ("killed", "gpu_memory_exceeded")


# --- the jobs (run as gpumgr "containers" of the process runtime; only these import torch) ---------
def job_main(argv: list[str]) -> int:
    """One PyTorch job: ``hold`` bytes at once, report ready, then per ``--mode``:

    ``cross``: ``--offset`` s after the go time (read from ``--go`` once it appears) allocate ``grow``
    bytes more, write the moment it returned (to RESULT with suffix ``.crossed``), and wait to be
    killed; ``ask``: allocate ``grow`` more and exit 0, or ``EXIT_OOM`` on OutOfMemoryError;
    ``matmul``: at the go time run bf16 products for ``--seconds`` and write the TFLOP/s; ``sleep``:
    hold for ``--seconds`` and exit 0.
    """
    parser = argparse.ArgumentParser(prog="gpu_check.py job")
    parser.add_argument("--mode", choices=["cross", "ask", "matmul", "sleep"], required=True)
    parser.add_argument("--hold", type=int, default=0)
    parser.add_argument("--grow", type=int, default=0)
    parser.add_argument("--offset", type=float, default=0.0, help="seconds after the go time")
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--go", type=Path, help="a file holding the go time (epoch seconds) once it exists")
    parser.add_argument("--result", type=Path, required=True)
    args = parser.parse_args(argv)
    import torch

    held = [torch.empty(args.hold, dtype=torch.uint8, device="cuda")] if args.hold else []
    torch.cuda.synchronize()
    write_json(args.result, {"ready": time.time(), "pid": os.getpid()})
    if args.mode == "sleep":
        time.sleep(args.seconds)
        return 0
    if args.mode == "ask":
        try:
            held.append(torch.empty(args.grow, dtype=torch.uint8, device="cuda"))
            torch.cuda.synchronize()
        except torch.OutOfMemoryError as exc:
            write_json(args.result, {"oom": str(exc)[:300]})
            return EXIT_OOM
        return 0
    go = wait_go(args.go) + args.offset
    time.sleep(max(0.0, go - time.time()))
    if args.mode == "cross":
        # opened first, so that the moment is on disk one write() after the allocation returns, before any kill
        mark = os.open(args.result.with_suffix(".crossed"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        held.append(torch.empty(args.grow, dtype=torch.uint8, device="cuda"))
        torch.cuda.synchronize()
        os.write(mark, repr(time.time()).encode())
        time.sleep(60)  # the kill comes long before
        return 0
    return matmul(torch, args.seconds, args.result)


def matmul(torch: Any, seconds: float, result: Path) -> int:
    """bf16 ``MATMUL_SIZE``³ products for ``seconds``; writes the TFLOP/s reached."""
    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    started, products = time.perf_counter(), 0
    while time.perf_counter() - started < seconds:
        for _ in range(10):
            a @ b
        torch.cuda.synchronize()
        products += 10
    elapsed = time.perf_counter() - started
    write_json(result, {"tflops": 2 * MATMUL_SIZE**3 * products / elapsed / 1e12, "products": products,
                        "seconds": elapsed, "share": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")})
    return 0


def wait_go(path: Path | None) -> float:
    """The go time written into ``path``, waiting up to 120 s for it to appear."""
    deadline = time.time() + 120
    while path is not None and time.time() < deadline:
        if path.exists() and (text := path.read_text().strip()):
            return float(text)
        time.sleep(0.01)
    return time.time()


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Merge ``data`` into the JSON file at ``path`` (renamed into place, so a reader never sees half)."""
    old = json.loads(path.read_text()) if path.exists() else {}
    part = path.with_suffix(".part")
    part.write_text(json.dumps({**old, **data}))
    part.replace(path)


# --- the driver ----------------------------------------------------------------------------------
class Check:
    """The parts, each a method returning its figures and ``pass``, against one stack."""

    def __init__(self, s: Any, args: argparse.Namespace, work: Path) -> None:
        self.s, self.args, self.work = s, args, work
        self.rng = random.Random(args.seed)

    def job(self, name: str, grant: str, mode: str, *extra: str, **body: Any) -> tuple[dict[str, Any], Path]:
        """POST a job of ``mode``; its record (or the refusal as ``{"refused": ...}``) and its result file."""
        result = self.work / f"{name}.json"
        result.unlink(missing_ok=True)
        command = [sys.executable, str(Path(__file__).resolve()), "job", "--mode", mode, "--result", str(result),
                   *extra]
        reply = self.s.api.post("/v1/containers", json={"name": name, "command": command, "gpu_memory": grant,
                                                        **body})
        if reply.status_code != 201:
            return {"refused": reply.status_code, "body": reply.text[:500]}, result
        return dict(reply.json()), result

    def record(self, record: dict[str, Any]) -> dict[str, Any]:
        return dict(self.s.api.get(f"/v1/containers/{record['id']}").json())

    def ended(self, record: dict[str, Any], timeout: float) -> dict[str, Any]:
        """The record once it is no longer running (or as it is after ``timeout`` s)."""
        from bench.harness import wait_for

        try:
            return dict(wait_for(lambda: (r := self.record(record))["state"] not in ("running", "creating") and r,
                                 timeout, interval=0.1, what=f"{record['id']} to end"))
        except TimeoutError:
            return self.record(record)

    def ready(self, results: list[Path], timeout: float = 120) -> None:
        from bench.harness import wait_for

        wait_for(lambda: all(p.exists() and "ready" in json.loads(p.read_text()) for p in results), timeout,
                 interval=0.1, what="the jobs' CUDA start")

    def remove(self, *records: dict[str, Any]) -> None:
        for record in records:
            if "id" in record:
                self.s.api.delete(f"/v1/containers/{record['id']}")

    def clear(self) -> None:
        """Remove whatever a part left running (one that failed midway), so the next starts on a free GPU."""
        self.remove(*(r for r in self.s.api.get("/v1/containers").json()["containers"]
                      if r["state"] in ("running", "creating")))

    # --- the parts --------------------------------------------------------------------------------
    def tail(self) -> dict[str, Any]:
        """``--rounds`` rounds of ``--jobs`` jobs crossing their 3 GiB grants at staggered moments."""
        rounds = []
        for number in range(self.args.rounds):
            go = self.work / f"tail-{number}.go"
            go.unlink(missing_ok=True)
            offsets = [self.rng.uniform(0, self.args.spread) for _ in range(self.args.jobs)]
            jobs = [self.job(f"tail-{number}-{i}", "3GiB", "cross", "--hold", str(GiB + GiB // 2),
                             "--grow", str(2 * GiB), "--offset", f"{offset:.4f}", "--go", str(go))
                    for i, offset in enumerate(offsets)]
            try:
                if any("refused" in record for record, _ in jobs):
                    return {"error": next(record for record, _ in jobs if "refused" in record), "pass": False}
                rounds.append(self.tail_round(jobs, go))
            finally:
                self.remove(*(record for record, _ in jobs))
            latencies, wrong = rounds[-1]["latencies_s"], rounds[-1]["wrong"]
            print(f"  tail round {number + 1}: " + " ".join(f"{v * 1000:.0f}" for v in latencies) + " ms"
                  + (f"; {len(wrong)} not killed as expected: {wrong}" if wrong else ""), flush=True)
        from bench.harness import summary

        pooled = [v for r in rounds for v in r["latencies_s"]]
        stats = summary(pooled, 1000) if pooled else {}
        ok = bool(pooled) and stats["p99"] <= 250 and not any(r["wrong"] for r in rounds)
        return {"rounds": rounds, "ms": stats, "pass": ok}

    def tail_round(self, jobs: list[tuple[dict[str, Any], Path]], go: Path) -> dict[str, Any]:
        """Once every job holds its bytes: let them cross, and time each from its crossing to its exit."""
        self.ready([path for _, path in jobs])
        exits = ExitWatch([json.loads(path.read_text())["pid"] for _, path in jobs])
        go.write_text(repr(time.time() + 2.0))  # two regular full samples first: every PID is known
        died = exits.wait(self.args.spread + 30)
        latencies, wrong = [], []
        for (record, path), pid in zip(jobs, exits.pids, strict=True):
            mark = path.with_suffix(".crossed")
            crossed = float(text) if mark.exists() and (text := mark.read_text().strip()) else None
            end = self.ended(record, 10)
            if crossed is None or pid not in died or (end["state"], end["reason"]) != KILLED:
                wrong.append({"id": record["id"], "state": end["state"], "reason": end["reason"],
                              "crossed": crossed is not None, "exited": pid in died})
            else:
                latencies.append(died[pid] - crossed)
        return {"latencies_s": sorted(latencies), "wrong": wrong}

    def example(self) -> dict[str, Any]:
        """examples/pytorch/train.py under a 6 GiB grant: exits 0, never killed."""
        script = Path(__file__).resolve().parent.parent / "examples" / "pytorch" / "train.py"
        reply = self.s.api.post("/v1/containers", json={
            "name": "example-train", "gpu_memory": "6GiB",
            "command": [sys.executable, str(script), "--steps", "100", "--batch", "512"]})
        if reply.status_code != 201:
            return {"error": {"refused": reply.status_code, "body": reply.text[:500]}}
        end = self.ended(reply.json(), 240)
        self.remove(end)
        return {"state": end["state"], "exit_code": end["exit_code"], "reason": end["reason"],
                "peak_used": end.get("gpu_memory_peak"), "pass": end["state"] == "exited" and end["exit_code"] == 0}

    def mps_cap(self) -> dict[str, Any]:
        """A 2 GiB grant asking for 2 GiB more gets CUDA's OutOfMemoryError (exit 3); a 4 GiB job beside it runs."""
        small, small_result = self.job("mps-small", "2GiB", "ask", "--hold", str(GiB), "--grow", str(2 * GiB))
        large, _ = self.job("mps-large", "4GiB", "sleep", "--hold", str(3 * GiB), "--seconds", "5")
        if "refused" in small or "refused" in large:
            return {"error": small if "refused" in small else large}
        small_end, large_end = self.ended(small, 120), self.ended(large, 120)
        self.remove(small_end, large_end)
        oom = json.loads(small_result.read_text()).get("oom") if small_result.exists() else None
        return {"small": {k: small_end[k] for k in ("state", "exit_code", "reason")}, "oom": oom,
                "large": {k: large_end[k] for k in ("state", "exit_code", "reason")},
                "pass": (small_end["state"], small_end["exit_code"]) == ("exited", EXIT_OOM) and oom is not None
                and (large_end["state"], large_end["exit_code"]) == ("exited", 0)}

    def shares(self) -> dict[str, Any]:
        """Two jobs of compute_share 25 and 75 multiplying at once: TFLOP/s ratio within ±15% of 3."""
        go = self.work / "shares.go"
        go.unlink(missing_ok=True)
        jobs = {share: self.job(f"share-{share}", "8GiB", "matmul", "--go", str(go), "--seconds",
                                str(self.args.seconds), compute_share=share) for share in (25, 75)}
        if any("refused" in record for record, _ in jobs.values()):
            self.remove(*(record for record, _ in jobs.values()))
            return {"unsupported": next(record for record, _ in jobs.values() if "refused" in record)}
        self.ready([path for _, path in jobs.values()])
        go.write_text(repr(time.time() + 1.0))
        ends = {share: self.ended(record, self.args.seconds + 120) for share, (record, _) in jobs.items()}
        self.remove(*ends.values())
        tflops = {share: json.loads(path.read_text()).get("tflops") for share, (_, path) in jobs.items()}
        if None in tflops.values():
            return {"tflops": tflops, "ends": {s: e["state"] for s, e in ends.items()}, "pass": False}
        ratio = tflops[75] / tflops[25]
        return {"tflops": tflops, "ratio": ratio, "pass": 3 * 0.85 <= ratio <= 3 * 1.15}

    def burst(self) -> dict[str, Any]:
        """A burster (4 GiB request, 12 GiB limit) holding 10 GiB is reclaimed for a request that needs its bytes."""
        burster, _ = self.job("burster", "4GiB", "sleep", "--hold", str(10 * GiB), "--seconds", "300",
                              gpu_memory_limit="12GiB")
        if "refused" in burster:
            return {"unsupported": burster}
        from bench.harness import wait_for

        wait_for(lambda: self.record(burster)["gpu_memory_used"] >= 10 * GiB, 120, interval=0.2,
                 what="the burster's 10 GiB to be seen")
        time.sleep(1.5)  # past burst_min_runtime (1 s here)
        gpu = self.s.api.get("/v1/nodes").json()["nodes"][0]["gpus"][0]
        need = gpu["memory_free"] + 2 * GiB
        started = time.time()
        reply = self.s.api.post("/v1/containers", json={
            "name": "needs-the-burst", "gpu_memory": need,
            "command": [sys.executable, "-c", "import time; time.sleep(30)"]})
        placed_s = time.time() - started
        end = self.ended(burster, 30)
        self.remove(end, reply.json() if reply.status_code == 201 else {})
        return {"request_bytes": need, "status": reply.status_code, "answered_s": placed_s,
                "burster": {k: end[k] for k in ("state", "reason")}, "memory_burst_seen": gpu.get("memory_burst"),
                "pass": reply.status_code == 201 and (end["state"], end["reason"]) == ("preempted", "burst_reclaimed")}


class ExitWatch:
    """When each of ``pids`` exits, from pidfds (exact, and not this process's children)."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self._fds = {os.pidfd_open(pid): pid for pid in pids}

    def wait(self, timeout: float) -> dict[int, float]:
        """Epoch exit time of each PID that exited within ``timeout`` s."""
        poller, died = select.poll(), {}
        for fd in self._fds:
            poller.register(fd, select.POLLIN)
        deadline = time.monotonic() + timeout
        while len(died) < len(self._fds) and time.monotonic() < deadline:
            for fd, _ in poller.poll(50):
                died[self._fds[fd]] = time.time()
                poller.unregister(fd)
        for fd in self._fds:
            os.close(fd)
        return died


def mps_start(work: Path) -> str | None:
    """Start the MPS control daemon; its pipe directory, or None without one."""
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        return None
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(work / "mps-pipe"), "CUDA_MPS_LOG_DIRECTORY": str(work / "mps")}
    for folder in ("mps-pipe", "mps"):
        (work / folder).mkdir(exist_ok=True)
    done = subprocess.run([control, "-d"], env=env, capture_output=True, text=True, timeout=30)
    return env["CUDA_MPS_PIPE_DIRECTORY"] if done.returncode == 0 else None


def mps_stop(pipe: str) -> None:
    subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", text=True, timeout=30, capture_output=True,
                   env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": pipe})


def run_parts(args: argparse.Namespace, work: Path, parts: list[str], mps: str | None,
              results: dict[str, Any]) -> None:
    """One stack (the process runtime on NVML; with MPS when ``mps`` names its pipe directory) for ``parts``.

    Each part's figures go into ``results`` and ``OUT/gpu_check.json`` as soon as it ends, so a run
    cut short by its time limit still leaves what it measured.
    """
    from bench.harness import stack

    env = {"GPUMGR_MPS": "true", "CUDA_MPS_PIPE_DIRECTORY": mps} if mps else {}
    with stack(name="gpu-check", gpus=args.gpus, runtime="process", agent_env={**env, "GPUMGR_PROCESS_LOG_DIR":
                                                                            str(work / "logs")},
               manager_env={"GPUMGR_BURST_MIN_RUNTIME": "1"}, keep_logs=True) as s:
        check = Check(s, args, work)
        calls = {"tail": check.tail, "example": check.example, "mps": check.mps_cap, "shares": check.shares,
                 "burst": check.burst}
        for part in parts:
            started = time.monotonic()
            try:
                results[part] = calls[part]()
            except Exception as exc:  # one part failing still leaves the others their turn
                results[part] = {"error": f"{type(exc).__name__}: {exc}", "pass": False}
            check.clear()
            results[part]["wall_s"] = round(time.monotonic() - started, 1)
            (args.out / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str))
            print(f"{part}: {json.dumps(results[part], default=str)[:2000]}", flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["job"]:
        return job_main(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/gpu-check")))
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    parser.add_argument("--jobs", type=int, default=10, help="tail: jobs crossing their grants each round")
    parser.add_argument("--rounds", type=int, default=2, help="tail: rounds")
    parser.add_argument("--spread", type=float, default=1.0, help="tail: seconds the crossings are spread over")
    parser.add_argument("--seconds", type=float, default=6.0, help="shares: seconds of matrix products")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--gpus", default="nvml", help="the agent's --gpus (nvml: the real GPU)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit (no GPU needed)")
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if unknown := sorted(set(parts) - set(PARTS)):
        parser.error(f"unknown parts {unknown}; choose from {', '.join(PARTS)}")
    plain = [p for p in parts if p in ("tail", "example")]
    shared = [p for p in parts if p not in plain]
    if args.dry_run:
        print(f"without MPS: {plain}; with the MPS daemon, if there is one: {shared}; results in {args.out}")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpumgr-gpu-check-"))
    results: dict[str, Any] = {}
    if plain:
        run_parts(args, work, plain, None, results)
    if shared:
        pipe = mps_start(work)
        if pipe is None:
            results.update({p: {"skipped": "no MPS control daemon could be started"} for p in shared})
        else:
            try:
                run_parts(args, work, shared, pipe, results)
            finally:
                mps_stop(pipe)
    (args.out / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str))
    for part, result in results.items():
        print(f"{part:8} {'PASS' if result.get('pass') else 'NOT PASSED'}: "
              f"{ {k: v for k, v in result.items() if k not in ('rounds',)} }")
    return 0 if all(r.get("pass") or "unsupported" in r or "skipped" in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
