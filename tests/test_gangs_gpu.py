"""A gang of two host processes on one GPU, started with ``docker gpu run --gang 2 --no-one-per-node`` (issue 35).

The process runtime's equivalent of two containers on one node: a ``gpumgr manager`` process, one
``gpumgr agent`` process of the process runtime, and the CLI's ``main`` in this process (it only speaks to the
manager). Each member finds its rendezvous in its environment and meets the other at
``PET_MASTER_ADDR:PET_MASTER_PORT``:

- on a simulated GPU, with a plain socket (rank 0 listens, rank 1 connects, they swap ranks): runs everywhere;
- on a real NVIDIA GPU (``gpu``-marked: ``.ci/gpu-check`` runs it on a lent GPU machine), under torchrun,
  ``examples/gang-gloo/allreduce.py`` sums a tensor on the GPU across both with gloo.

Both members must exit 0 and the gang end ``exited``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpumgr.plugin import docker_gpu
from tests.procs import AgentProc, ManagerProc, wait_for

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "gang-gloo" / "allreduce.py"
#: rank 0 listens on the master's port, rank 1 connects (until rank 0 listens), and they swap ranks
MEET = """
import os, socket, sys, time
rank, port = int(os.environ["GPUMGR_GANG_RANK"]), int(os.environ["PET_MASTER_PORT"])
if rank == 0:
    server = socket.create_server(("", port))
    server.settimeout(30)
    peer = server.accept()[0]
else:
    deadline = time.monotonic() + 30
    while True:
        try:
            peer = socket.create_connection((os.environ["PET_MASTER_ADDR"], port), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
peer.sendall(f"rank{rank}".encode())
got = peer.recv(16).decode()
print("got", got, "on", os.environ["CUDA_VISIBLE_DEVICES"], flush=True)
sys.exit(0 if got == f"rank{1 - rank}" else 1)
"""


def test_the_example_reads_its_rendezvous_from_torchrun_or_from_the_gangs_pet_variables() -> None:
    """(PyTorch is imported only after the arguments are read: this runs without it.)"""
    spec = importlib.util.spec_from_file_location("gang_allreduce", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    pet = {"PET_MASTER_ADDR": "10.0.0.1", "PET_MASTER_PORT": "29500", "PET_NODE_RANK": "1", "PET_NNODES": "4"}
    assert example.rendezvous(pet) == ("tcp://10.0.0.1:29500", 1, 4, 0)
    torchrun = {**pet, "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1"}
    assert example.rendezvous(torchrun) == (None, 5, 8, 1)  # env://: torchrun's agent serves the store
    with pytest.raises(SystemExit, match="PET_MASTER_PORT"):
        example.rendezvous({"PET_MASTER_ADDR": "10.0.0.1"})
    assert example.expected_sum(2) == 3 and example.expected_sum(4) == 10
    shown = subprocess.run([sys.executable, str(EXAMPLE), "--help"], capture_output=True, text=True, timeout=30)
    assert shown.returncode == 0 and "--device" in shown.stdout


def gang_on_one_gpu(tmp_path: Path, capsys: Any, manager: ManagerProc, gpus: str,
                    command: list[str]) -> tuple[dict[str, Any], list[str]]:
    """Run ``command`` as a gang of two on one node's one GPU; the ended gang and each member's output."""
    logs = tmp_path / "logs"
    agent = AgentProc(tmp_path, manager, "gang-proc", gpus=gpus, runtime="process",
                      env={"GPUMGR_PROCESS_LOG_DIR": str(logs)})
    try:
        capsys.readouterr()
        status = docker_gpu.main(["gpu", "--manager", manager.url, "run", "--gang", "2", "--no-one-per-node",
                                  "--gpu-memory", "2GiB", "host-process", *command])
        out, err = capsys.readouterr()
        assert status == 0, err
        gid = out.strip()
        ended = wait_for(lambda: (v := manager.get(f"/v1/gangs/{gid}").json())["state"] not in
                         ("creating", "running") and v, 100, what="the gang ended")
        return ended, [(logs / f"{cid}.log").read_text() for cid in ended["members"]]
    finally:
        agent.stop()


def assert_both_exited_0_on_one_gpu(manager: ManagerProc, ended: dict[str, Any], outputs: list[str]) -> None:
    assert (ended["state"], ended["exit_code"]) == ("exited", 0), (ended, outputs)
    records = [manager.get(f"/v1/containers/{cid}").json() for cid in ended["members"]]
    assert [(r["rank"], r["state"], r["exit_code"]) for r in records] == [(0, "exited", 0), (1, "exited", 0)]
    assert len({r["gpus"][0]["uuid"] for r in records}) == 1  # both on the one GPU


def test_two_host_processes_of_a_gang_on_one_gpu_meet_over_pet_variables(tmp_path, capsys, manager) -> None:
    script = tmp_path / "meet.py"
    script.write_text(MEET)
    ended, outputs = gang_on_one_gpu(tmp_path, capsys, manager, "sim:1x8GiB", [sys.executable, str(script)])
    assert_both_exited_0_on_one_gpu(manager, ended, outputs)
    assert "got rank1" in outputs[0] and "got rank0" in outputs[1], outputs


@pytest.mark.gpu
def test_a_two_process_torch_job_on_one_real_gpu_meets_over_gloo_under_torchrun(tmp_path, capsys, manager) -> None:
    """On a real NVIDIA GPU: torchrun reads the gang's PET_*, and gloo sums a CUDA tensor across both members."""
    from gpumgr.agent.gpus.select import open_source
    from gpumgr.agent.gpus.source import NvmlUnavailable

    required = os.environ.get("GPUMGR_REQUIRE_GPU") == "1"
    try:
        open_source("nvml", "probe").close()
    except NvmlUnavailable as exc:
        if required:
            pytest.fail(f"no NVIDIA GPU answers ({exc}), and GPUMGR_REQUIRE_GPU=1 forbids skipping")
        pytest.skip(f"no NVIDIA GPU answers ({exc})")
    try:
        import torch.distributed  # noqa: F401
    except ImportError as exc:
        if required:
            pytest.fail(f"PyTorch is needed on the GPU machine ({exc})")
        pytest.skip(f"no PyTorch ({exc})")
    ended, outputs = gang_on_one_gpu(tmp_path, capsys, manager, "nvml",
                                     [sys.executable, "-m", "torch.distributed.run", str(EXAMPLE), "--device", "cuda"])
    print(*outputs, sep="\n")
    assert_both_exited_0_on_one_gpu(manager, ended, outputs)
    for rank, output in enumerate(outputs):
        assert f"rank {rank} of 2 on cuda:0: sum 3, expected 3" in output, output
