"""A job of several processes that meet over gloo, as the members of a gpumgr gang do.

Every member of a gang finds its rendezvous in its environment (``PET_NNODES``, ``PET_NODE_RANK``,
``PET_NPROC_PER_NODE``, ``PET_MASTER_ADDR``, ``PET_MASTER_PORT``, ``PET_RDZV_ID``), so either way works:

    torchrun allreduce.py            # torchrun reads every flag from PET_<FLAG>: one worker per GPU
    python allreduce.py              # one process per member: it reads the PET_* itself

Each process puts its rank + 1 in a tensor on its GPU, sums it across the job with gloo's ``all_reduce``
(through host memory: gloo needs nothing but the address and port), and checks the sum against
1 + 2 + ... + world size. Exit 0 when it is right, 1 when it is not; PyTorch is imported only after the
arguments are read, so ``--help`` runs anywhere.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from datetime import timedelta


def rendezvous(env: Mapping[str, str]) -> tuple[str | None, int, int, int]:
    """``(init method, rank, world size, local rank)`` for this process.

    Started by torchrun: its worker variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), and ``env://``
    (None), so the workers join the store torchrun's agent on rank 0 already serves on the master's port.
    Started on its own: the gang's ``PET_*``, one process per member, meeting at ``tcp://`` the master.
    """
    if "RANK" in env and "WORLD_SIZE" in env:
        return None, int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", "0"))
    try:
        return f"tcp://{env['PET_MASTER_ADDR']}:{int(env['PET_MASTER_PORT'])}", int(env["PET_NODE_RANK"]), \
            int(env["PET_NNODES"]), 0
    except KeyError as missing:
        raise SystemExit(f"no {missing.args[0]} in the environment: run this as a gpumgr gang's member "
                         "(docker gpu run --gang N ...), or under torchrun") from None


def expected_sum(world: int) -> float:
    """What every element holds after the all-reduce: 1 + 2 + ... + ``world``."""
    return world * (world + 1) / 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                        help="where each tensor lives (auto: its GPU when CUDA answers)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the peers")
    args = parser.parse_args(argv)
    method, rank, world, local = rendezvous(os.environ)
    import torch
    import torch.distributed as dist

    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    dist.init_process_group("gloo", init_method=method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=args.timeout))
    try:
        mine = torch.full((4,), float(rank + 1), device=device)
        summed = mine.cpu()
        dist.all_reduce(summed)  # gloo, through host memory
        back = summed.to(device)
        right = bool(torch.all(back == expected_sum(world)))
        print(f"rank {rank} of {world} on {device}: sum {back[0].item():g}, expected {expected_sum(world):g}",
              flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0 if right else 1


if __name__ == "__main__":
    sys.exit(main())
