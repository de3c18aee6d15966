"""The fair-share simulator and ``bench/scheduler.py --accounts`` at a small size, so they cannot rot.

No timing is asserted. KAI's fixture (100 GPUs, two accounts of quota 10 with weights 3:1, one holding
every GPU before the other asks) must end at 70/30 in the simulator, through reclaims that the
simulator carried out on the real cluster map; the command line's JSON must have the shape the docs
quote; and the scheduler bench must time all three maps side by side.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.fairshare import Simulation, scenarios

ROOT = Path(__file__).resolve().parent.parent


def test_kais_fixture_converges_to_70_30_by_reclaim() -> None:
    result = Simulation(scenarios()["kai"]).run()
    a, b = result["accounts"]["a"], result["accounts"]["b"]
    assert (a["final_fair_share_gpus"], b["final_fair_share_gpus"]) == (70.0, 30.0)
    assert (a["final_allocated_gpus"], b["final_allocated_gpus"]) == (70.0, 30.0)
    assert result["reclaims"] == result["containers_stopped"] == 30  # one GPU each, and none of b's undone
    assert result["jobs_preempted_twice_or_more"] == 0
    second = result["phases"][1]
    assert second["label"] == "b asks 100" and second["reversals"] == []
    # one walk reclaims b's whole share at once, so it settles within one stop (5 s) and its create (1 s) of
    # asking, not one request's room per stop (145 s before a walk looked past the head of b's line)
    assert second["slowest_settle_s"] is not None and second["slowest_settle_s"] <= 5 + 1 + 1


def test_instant_stops_reach_the_same_shares() -> None:
    result = Simulation(scenarios()["kai"], stop_s=0.0, create_s=0.0).run()
    assert {n: a["final_allocated_gpus"] for n, a in result["accounts"].items()} == {"a": 70.0, "b": 30.0}


def test_a_run_replays_exactly() -> None:
    first, second = (Simulation(scenarios()["bursts"], seed=3).run() for _ in range(2))
    assert first == second


@pytest.mark.timeout(240)
def test_the_command_line_prints_every_figure_as_json() -> None:
    done = subprocess.run([sys.executable, "bench/fairshare.py", "--scenario", "turns", "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    (result,) = out["results"]
    assert result["scenario"] == "turns" and result["capacity_gpus"] == 100
    assert set(result["accounts"]) == {"a", "b"}
    for figures in result["accounts"].values():
        assert 0 <= figures["mae_gpus"] <= figures["max_error_gpus"] <= 100
        assert 0 < figures["within_tolerance"] <= 1
    assert [p["start_s"] for p in result["phases"]] == [0, 900, 1800, 2700]
    for phase in result["phases"]:
        assert set(phase["settle_s"]) == {"a", "b"} and set(phase["reach_s"]) == {"a", "b"}
    # both busy at the end: quotas of 50 each and equal weights split the 100 GPUs evenly
    assert [result["accounts"][n]["final_fair_share_gpus"] for n in ("a", "b")] == [50.0, 50.0]
    assert result["reclaims"] > 0


@pytest.mark.timeout(300)
def test_the_scheduler_bench_times_accounts_beside_plain(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    done = subprocess.run([sys.executable, "bench/scheduler.py", "--nodes", "20", "--gpus", "4", "--reps", "2",
                           "--seconds", "0.05", "--multi-seconds", "0.05", "--accounts", "4", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    names = {row["name"] for row in result["results"]}
    for mode in ("plain", "tenants", "accounts"):
        assert {f"{mode} reserve+finish spread", f"{mode} reserve+finish binpack gpus=2|4"} <= names
    assert all(row["median_per_s"] > 0 for row in result["results"])
    assert result["ratios"]["accounts/plain reserve+finish spread"] > 0
    assert result["fill_after"] == pytest.approx(0.8, abs=0.02)  # the accounts map was filled like the others


def test_a_gang_of_an_account_below_its_fair_share_is_reclaimed_for_whole_and_then_nothing_more() -> None:
    from bench.fairshare_gangs import GangRun

    run = GangRun(replicas=8, member_gpus=2, gang_at=400.0, end=700.0)
    run.run()
    gang = run.result()["gang"]
    assert gang["wait_s"] is not None and gang["wait_s"] <= run.stop_s + run.create_s + 1
    assert 0 < gang["gpus_stopped_for_it"] <= gang["gpus_it_needs"] == 16
    assert gang["reclaims_after_placed"] == 0


def test_the_pairs_bench_times_three_maps_and_counts_in_accounts() -> None:
    from bench.accounts_pairs import build, pairs, run

    result = run(20, 3)
    assert set(result["us_per_pair"]) == {"plain", "tenants", "accounts"}
    for figures in result["us_per_pair"].values():
        assert 0 < figures["min"] <= figures["median"] <= figures["max"]
    assert set(result["ratios"]) == {"accounts/plain", "accounts/tenants", "tenants/plain"}
    # the accounts map's pairs really go through its accounts (each of the 4 granted to, all released again)
    cluster, tenants = build("accounts")
    pairs(cluster, tenants, 8)
    assert cluster.quotas.allocated == {f"a{i}": 0 for i in range(4)} and not any(cluster.quotas.borrowed.values())
    plain, none = build("plain")
    assert none == [None] and plain.accounts is None and plain.tenants is None
