"""``docker gpu run --rm`` attached against ``docker run --rm``: a whole run, start to exit code, output included.

Starts a ``gpumgr manager`` and one ``gpumgr agent`` (``sim:2x24GiB``, Docker runtime, network mode
``none``) as child processes on free loopback ports (``bench.harness.stack``), then runs ``--pairs``
interleaved trials, each a separate process timed from its start to its exit:

  A  gpumgr:  python -m gpumgr.plugin.docker_gpu gpu run --rm --gpu-memory 1GiB IMAGE sh -c 'seq 1 LINES'
  B  docker:  docker run --rm --network none IMAGE sh -c 'seq 1 LINES'

Both must print the same LINES lines and exit 0. ``--lines`` sets the output (default 100,000 lines,
about 590 KB, so the output crosses more than one of the agent's pieces). A also pays for starting a
Python interpreter (the plugin), B for the Go CLI; ``--python-start`` times ``python -c pass`` as well,
for scale.

    python bench/run_attached.py [--pairs 15] [--warmup 2] [--lines 100000] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import IMAGE, Stack, median, save, stack, summary, table

NAMES = {"gpumgr": "A docker gpu run --rm (attached)", "docker": "B docker run --rm", "python": "python -c pass"}


def timed(argv: list[str], lines: int, env: dict[str, str] | None = None) -> float:
    """Seconds ``argv`` took from start to exit; it must exit 0 having printed ``lines`` lines."""
    t0 = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, env=env, timeout=300)
    dt = time.perf_counter() - t0
    printed = done.stdout.count(b"\n")
    if done.returncode != 0 or (lines and printed != lines):
        raise RuntimeError(f"{argv[:6]} exited {done.returncode} with {printed} lines: {done.stderr[-500:]!r}")
    return dt


def arms(s: Stack, lines: int) -> dict[str, Any]:
    """Each arm as a function of no arguments returning its seconds."""
    script = f"seq 1 {lines}"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    plugin = [sys.executable, "-m", "gpumgr.plugin.docker_gpu", "gpu", "--manager", s.url, "run", "--rm",
              "--gpu-memory", "1GiB", *(f"--label={k}={v}" for k, v in s.labels.items()), IMAGE, "sh", "-c", script]
    docker = ["docker", "run", "--rm", "--network", "none", *(f"--label={k}={v}" for k, v in s.labels.items()),
              IMAGE, "sh", "-c", script]
    return {"gpumgr": lambda: timed(plugin, lines, env), "docker": lambda: timed(docker, lines),
            "python": lambda: timed([sys.executable, "-c", "pass"], 0)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=15, help="timed rounds (each runs every arm once)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--lines", type=int, default=100_000, help="lines of output per run")
    parser.add_argument("--python-start", action="store_true", help="also time python -c pass")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    names = ["gpumgr", "docker"] + (["python"] if args.python_start else [])
    times: dict[str, list[float]] = {a: [] for a in names}
    with stack(name="bench-run") as s:
        calls = arms(s, args.lines)
        for i in range(args.warmup + args.pairs):
            for arm in names:
                dt = calls[arm]()
                if i >= args.warmup:
                    times[arm].append(dt)
            if i >= args.warmup:
                print(f"  {i - args.warmup + 1:3}/{args.pairs}: "
                      + "  ".join(f"{a}={times[a][-1] * 1000:7.1f}ms" for a in names), file=sys.stderr)
    stats = {a: summary(v, 1000) for a, v in times.items()}
    table([("arm", "36"), ("median ms", "10.1f"), ("p90 ms", "10.1f"), ("min ms", "10.1f"), ("max ms", "10.1f")],
          [[NAMES[a], st["median"], st["p90"], st["min"], st["max"]] for a, st in stats.items()], lead="\n")
    ratio = stats["gpumgr"]["median"] / stats["docker"]["median"]
    paired = median(a / b for a, b in zip(times["gpumgr"], times["docker"], strict=True))
    print(f"\nmedian ratio A/B = {ratio:.3f} (median of per-pair ratios {paired:.3f}); "
          f"A-B = {stats['gpumgr']['median'] - stats['docker']['median']:.1f} ms")
    save(args.json, "run_attached", args, results=stats, median_ratio=ratio, median_paired_ratio=paired,
         samples_ms={a: [x * 1000 for x in v] for a, v in times.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
