"""The map's benches at a small size, so they cannot rot: they must run and their work must be right.

No timing is asserted. ``bench/scheduler.py`` and ``bench/scheduler_floor.py`` run as processes of
their own and their JSON is checked for shape; the floor's flat pair is also run in-process, and the
map it worked on must still hold the invariant, so it does the map's work and not less.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.scheduler import build
from bench.scheduler_floor import flat_pair
from gpumgr.manager.model.cluster import PlacementSpec
from gpumgr.wire.names import State

ROOT = Path(__file__).resolve().parent.parent
GiB = 1 << 30


def run_bench(tmp_path: Path, script: str, *args: str) -> dict:
    out = tmp_path / "out.json"
    done = subprocess.run([sys.executable, script, "--nodes", "20", "--gpus", "4", "--reps", "2", "--json", str(out),
                           *args], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.timeout(300)
def test_the_scheduler_bench_measures_every_row(tmp_path: Path) -> None:
    result = run_bench(tmp_path, "bench/scheduler.py", "--seconds", "0.05", "--multi-seconds", "0.05")
    names = {row["name"] for row in result["results"]}
    assert {"reserve+finish spread", "reserve+finish binpack", "reserve+finish spread gpus=2|4",
            "heartbeat() of one node"} <= names
    assert all(row["median_per_s"] > 0 for row in result["results"])


@pytest.mark.timeout(300)
def test_the_floor_bench_times_both_sides(tmp_path: Path) -> None:
    result = run_bench(tmp_path, "bench/scheduler_floor.py", "--seconds", "0.05")
    assert set(result["rates"]) == {"map (Cluster.reserve + finish)", "flat floor (same work, no layers)"}
    assert all(len(values) == 2 and min(values) > 0 for values in result["rates"].values())
    assert result["floor_over_map"] > 0


def test_the_flat_floor_leaves_the_map_sound() -> None:
    cluster, _ = build(10, 4, 80, 0.5, 1)
    reserve, finish = flat_pair(cluster)
    before = {uuid: gpu.reserved for uuid, gpu in cluster.ledger.gpus.items()}
    ended = []
    for n in range(3000):  # past the list of ended records' cap: the oldest are forgotten
        record = reserve(PlacementSpec(memory=(1 + n % 4) * GiB, count=1, placement="spread", image="img",
                                       command=["true"]))
        assert record.state is State.CREATING and record.held == record.gpu_memory
        finish(record.id)
        ended.append(record)
    with cluster.lock:
        assert cluster.ledger.check() == []
    assert {uuid: gpu.reserved for uuid, gpu in cluster.ledger.gpus.items()} == before
    assert all(r.state is State.EXITED and r.held == 0 and r.op is None for r in ended)
