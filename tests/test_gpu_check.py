"""The prepared GPU check (``.ci/gpu-check`` and ``bench/gpu_check.py``): every piece that runs without a GPU.

The check itself needs an NVIDIA GPU, MPS and PyTorch; here its shell parses, its plan and arguments
are read, and the process watching it relies on (exits seen through pidfds, result files merged) is
run on real processes.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench import gpu_check

ROOT = Path(__file__).resolve().parent.parent


def test_the_shell_script_parses() -> None:
    subprocess.run(["bash", "-n", str(ROOT / ".ci" / "gpu-check")], check=True, timeout=30)


def test_the_plan_runs_the_plain_parts_first_and_the_mps_parts_under_the_daemon(tmp_path) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--dry-run", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "without MPS: ['tail', 'example']" in done.stdout and "['mps', 'shares', 'burst']" in done.stdout
    refused = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--parts", "tail,warp"],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "unknown parts ['warp']" in refused.stderr


def test_a_job_refuses_a_mode_it_does_not_know() -> None:
    with pytest.raises(SystemExit):
        gpu_check.main(["job", "--mode", "fly", "--result", "/dev/null"])


def test_exits_are_seen_for_the_processes_that_ended_only() -> None:
    ending = subprocess.Popen(["sleep", "0.1"])
    staying = subprocess.Popen(["sleep", "30"])
    try:
        watch = gpu_check.ExitWatch([ending.pid, staying.pid])
        died = watch.wait(timeout=3)  # the one still running keeps it waiting to the end
        assert set(died) == {ending.pid}
    finally:
        staying.kill()
        staying.wait()
        ending.wait()


def test_result_files_merge_and_the_go_time_is_read(tmp_path) -> None:
    result = tmp_path / "job.json"
    gpu_check.write_json(result, {"ready": 1.0, "pid": 7})
    gpu_check.write_json(result, {"oom": "no room"})
    assert result.read_text() == '{"ready": 1.0, "pid": 7, "oom": "no room"}'
    go = tmp_path / "go"
    go.write_text("1234.5\n")
    assert gpu_check.wait_go(go) == 1234.5
