"""MPS on a node: what each container of an ``mps: true`` node gets so that its processes are MPS clients.

The host runs NVIDIA's MPS control daemon (``nvidia-cuda-mps-control -d``). A CUDA process reaches it
through the daemon's pipe directory and shared memory, and takes its caps from its environment:
``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` (the grant, per device) and ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``
(its ``compute_share``, the percentage of each GPU's SMs it may use). Under the Docker runtime a
container sees neither the pipe directory nor the host's shared memory unless it is given them, so the
agent itself binds the pipe directory and joins the host's IPC namespace (which brings the host's
``/dev/shm``), after the tenant's run spec was checked against the policy: these are the node's
additions, not the tenant's asks, and a tenant still may not ask for host IPC where the policy forbids it.
"""

from __future__ import annotations

from typing import Any

from gpumgr.wire.names import Env

#: Where the MPS control daemon listens unless its ``CUDA_MPS_PIPE_DIRECTORY`` says otherwise.
DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"


def share_env(compute_share: int) -> dict[str, str]:
    """The driver's cap on a client's share of each GPU's SMs; none for a container without a share."""
    return {Env.MPS_THREAD_PERCENTAGE: str(compute_share)} if compute_share else {}


def memory_env(gpu_memory: int, count: int) -> dict[str, str]:
    """The driver's cap on each of a client's ``count`` visible devices: the grant, in MiB (at least 1)."""
    mib = max(1, gpu_memory // (1 << 20))
    return {Env.MPS_MEM_LIMIT: ",".join(f"{i}={mib}M" for i in range(count))}


def pipe_env(pipe_directory: str) -> dict[str, str]:
    """Where a client finds the daemon: the same path inside the container as on the host."""
    return {Env.MPS_PIPE_DIRECTORY: pipe_directory}


def docker_options(options: dict[str, Any], pipe_directory: str) -> dict[str, Any]:
    """``options`` (the checked create options) plus what an MPS client needs: the pipe directory, host IPC.

    A mount the tenant put at the pipe directory's path is replaced (the daemon's is the one that
    works); ``shm_size`` goes, as host IPC brings the host's ``/dev/shm``.
    """
    from docker.types import Mount  # here: the process runtime and the hook relay never load docker

    mounts = [m for m in options.get("mounts", []) if m.get("Target") != pipe_directory]
    mounts.append(Mount(target=pipe_directory, source=pipe_directory, type="bind", read_only=False))
    added = {**options, "mounts": mounts, "ipc_mode": "host"}
    added.pop("shm_size", None)
    return added
