"""``bench/gangs.py`` at a small size, so it cannot rot: its JSON has the shape the docs quote, and its figures
are sane. No timing is asserted.

A gang's members land on as many nodes as it has members; with a reservation every gang starts, and never
later than its held GPUs' last move plus the longest small job (each held GPU takes nothing new, so its
last small job ends by then); without one nothing is ever held.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gangs import SMALL_RUNTIME, Stream

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--nodes", "40", "--gpus", "4", "--members", "4", "--reps", "3", "--sim-nodes", "8", "--gang", "4",
        "--seeds", "2", "--hours", "1", "--warmup", "900"]


@pytest.mark.timeout(200)
def test_the_command_line_writes_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    done = subprocess.run([sys.executable, "bench/gangs.py", *TINY, "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    placement = result["placement"]
    assert placement["fill"] == pytest.approx(0.8, abs=0.02)
    assert set(placement["shapes"]) == {"1 GPU x 8 GiB", "4 GPUs x 80 GiB (whole node)"}
    for shape in placement["shapes"].values():
        assert shape["distinct_nodes"] == [4]  # one member per node, every repetition
        for timed in ("submit_gang_ms", "singles_ms", "plan_gang_ms"):
            assert shape[timed]["n"] == 3 and 0 < shape[timed]["median"] <= shape[timed]["max"]
        assert shape["gang_over_singles"] > 0
    settings = result["starvation"]["settings"]
    assert list(settings) == ["off", "300 s", "60 s"]
    assert settings["off"]["held_gpu_s"]["median"] == 0 and settings["off"]["bound_s"] is None
    for name, figures in settings.items():
        assert 0.5 < figures["utilisation"] <= 1.0
        assert figures["small_wait_s"]["n"] > 100
        if name == "off":
            continue
        assert figures["gang_wait_s"]["never"] == 0 and figures["held_gpu_s"]["median"] > 0
        assert figures["bound_s"] == figures["reserve_after_s"] + SMALL_RUNTIME[1]
        # the held GPUs are chosen once and kept: they never move, and the bound holds
        assert figures["over_bound"] == 0 and figures["hold_moves"] == [0, 0]


def test_a_reserved_gang_starts_by_its_holds_last_move_plus_the_longest_small_job() -> None:
    args = argparse.Namespace(sim_nodes=8, gang=4, load=0.9, warmup=900.0, hours=1.0, gang_runtime=0.0)
    for seed in (1, 2, 3):
        run = Stream(args, seed, 60.0).run()
        assert run["gang_wait_s"] is not None and run["first_hold_s"] is not None
        since = max(60.0, run["last_move_s"] or 0.0)
        assert run["gang_wait_s"] <= since + SMALL_RUNTIME[1] + 1, run
        assert run["held_gpu_s"] > 0
    unreserved = Stream(args, 1, float("inf")).run()
    assert unreserved["held_gpu_s"] == 0 and unreserved["first_hold_s"] is None
