"""The fleet bench at a small size, so it cannot rot: every phase must come out right (no timing is asserted).

``bench/fleet.py`` runs as a process of its own against a real manager process, with 50 scripted
agents on real CURVE DEALER sockets; its JSON results are checked for correctness only.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
AGENTS = 50


def run_fleet(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "fleet.json"
    done = subprocess.run([sys.executable, "bench/fleet.py", "--agents", str(AGENTS), "--gpus", "4", "--steady", "1.5",
                           "--placements", "24", "--clients", "4", "--timeout", "60", "--json", str(out), *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert list(runs) == ["this tree"] and len(runs["this tree"]) == 1
    return runs["this tree"][0]


@pytest.mark.timeout(300)
def test_fleet_joins_heartbeats_serves_the_map_and_places(tmp_path: Path) -> None:
    result = run_fleet(tmp_path, "--poll-hz", "10")
    herd = result["herd"]
    assert len(herd["registered_s"]) == AGENTS and all(t > 0 for t in herd["registered_s"])
    assert herd["joins_sent"] >= AGENTS and herd["registers_sent"] >= AGENTS
    assert result["heartbeats"]["round_trip_s"], "no probe was answered on the link"
    polled = result["polled"]
    assert polled["statuses"] and set(polled["statuses"]) == {200}
    assert min(polled["bytes"]) > 0
    since = result["polled since"]  # the changes only, after the first (whole) answer: mostly none
    assert since["statuses"] and set(since["statuses"]) == {200}
    assert statistics.median(since["bytes"][1:]) < statistics.median(polled["bytes"]) / 4, (since, polled["bytes"])
    assert set(result["polled healthz"]["statuses"]) == {200}
    for name in ("placements gpus=1", "placements gpus=2..4"):
        assert result[name]["statuses"] == [201] * 24, result[name]["statuses"]
        assert result[name]["removed"] == [200] * 24
    final = result["final"]
    # every grant freed, every node still ready: no heartbeat was lost long enough to mark one down
    assert final == {**final, "ready": AGENTS, "nodes": AGENTS, "reserved": 0, "down_events": 0}
    assert final["heartbeats_sent"] >= AGENTS


@pytest.mark.timeout(300)
def test_fleet_poller_with_an_etag_gets_not_modified(tmp_path: Path) -> None:
    """Polling with If-None-Match at 20 Hz sees the map unchanged between rebuilds: some answers are 304."""
    result = run_fleet(tmp_path, "--poll-hz", "20", "--poll-etag", "--retry", "old")
    statuses = result["polled"]["statuses"]
    assert statuses[0] == 200 and 304 in statuses and set(statuses) <= {200, 304}
    sizes = [b for b, s in zip(result["polled"]["bytes"], statuses, strict=True) if s == 304]
    assert sizes and max(sizes) == 0
