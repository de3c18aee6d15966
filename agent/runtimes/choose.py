"""Which runtime an agent runs its containers with, chosen once at its start: Docker or host processes."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from gpumgr.agent.runtimes.mps import DEFAULT_PIPE_DIRECTORY
from gpumgr.agent.runtimes.runtime import ChangeCallback, Runtime
from gpumgr.wire import defaults
from gpumgr.wire.policy import Policy

log = logging.getLogger(__name__)


def build_runtime(kind: str, on_change: ChangeCallback, *, network_mode: str | None, device_requests: str,
                  gpu_kind: str, log_dir: str, mps: bool = False, node: str = "",
                  state_dir: str | Path | None = None, guard_control: str | None = None,
                  hook_limits: Any = None, policy: Policy | None = None,
                  mps_pipe_directory: str = DEFAULT_PIPE_DIRECTORY) -> Runtime:
    """The runtime ``kind``, chosen once at start and kept for the agent's life.

    ``auto`` means Docker wherever an engine is installed: when its socket exists but does not answer
    (it is restarting), the agent waits for it rather than quietly running containers as host processes;
    only a host with no engine at all gets the process runtime.
    """
    from gpumgr.agent.runtimes.docker_runtime import DockerRuntime, docker_answers, docker_installed
    from gpumgr.agent.runtimes.process_runtime import ProcessRuntime

    if kind == "auto":
        kind = "docker" if docker_installed() else "process"
        log.info("runtime auto: %s (a Docker engine is %s)", kind, "installed" if kind == "docker" else "absent")
    if kind == "process":
        return ProcessRuntime(on_change, log_dir=log_dir, mps=mps, mps_pipe_directory=mps_pipe_directory)
    deadline = time.monotonic() + defaults.ENGINE_WAIT
    while not docker_answers():
        if time.monotonic() > deadline:
            raise OSError(f"the Docker engine did not answer within {defaults.ENGINE_WAIT:g}s")
        log.warning("waiting for the Docker engine to answer")
        time.sleep(1.0)
    use_requests = device_requests == "always" or (device_requests == "auto" and gpu_kind == "nvml" and _has_nvidia())
    return DockerRuntime(on_change, node=node, network_mode=network_mode, device_requests=use_requests, mps=mps,
                         state_dir=state_dir, guard_control=guard_control, hook_limits=hook_limits,
                         policy=policy, mps_pipe_directory=mps_pipe_directory)


def _has_nvidia() -> bool:
    import docker

    try:
        return "nvidia" in docker.from_env().info().get("Runtimes", {})
    except Exception:  # no engine info means no NVIDIA runtime to use
        return False
