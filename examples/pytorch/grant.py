"""Keep PyTorch's caching allocator inside the gpumgr grant, before the driver or the kill has to act.

gpumgr gives every container ``GPUMGR_GPU_MEMORY``: its grant, in bytes, on each of its GPUs. The
agent kills a container whose processes use more. PyTorch's caching allocator keeps freed blocks and
grows its pool as it likes, so a job that would run within its grant can still pass it on a peak;
``torch.cuda.set_per_process_memory_fraction`` makes the allocator free its cache, and then raise
``torch.OutOfMemoryError`` inside the process, before it asks the driver for more than the fraction.

The arithmetic is plain Python (no torch), so it can be tested anywhere.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

GRANT_ENV = "GPUMGR_GPU_MEMORY"
#: Left to the CUDA context, cuBLAS workspaces and kernels, which the allocator does not count but
#: NVML charges to the process: a 2 GiB grant lets the allocator hold about 1.5 GiB.
DEFAULT_RESERVE = 512 << 20


def grant_bytes(environ: Mapping[str, str] = os.environ) -> int | None:
    """The grant per GPU from ``GPUMGR_GPU_MEMORY``, or None outside gpumgr (or when it is not a whole number)."""
    text = environ.get(GRANT_ENV, "").strip()
    return int(text) if text.isdigit() and int(text) > 0 else None


def memory_fraction(grant: int, total: int, reserve: int = DEFAULT_RESERVE) -> float:
    """The share of a GPU of ``total`` bytes the allocator may hold so the process stays within ``grant``.

    ``reserve`` bytes of the grant are left to what the allocator does not see (the CUDA context),
    but never more than half of it. The result is in (0, 1]: a grant as large as the GPU caps nothing.
    """
    if grant <= 0 or total <= 0:
        raise ValueError(f"grant and total must be positive, not {grant} and {total}")
    usable = grant - min(reserve, grant // 2)
    return min(1.0, usable / total)


def cap_allocator(torch: Any, device: int = 0, grant: int | None = None,
                  reserve: int = DEFAULT_RESERVE) -> float | None:
    """Set ``torch``'s per-process memory fraction on ``device`` from the grant; the fraction set, or None.

    ``grant`` defaults to ``GPUMGR_GPU_MEMORY``; without either, nothing is capped (not under gpumgr).
    """
    grant = grant if grant is not None else grant_bytes()
    if grant is None:
        return None
    fraction = memory_fraction(grant, torch.cuda.get_device_properties(device).total_memory, reserve)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction
