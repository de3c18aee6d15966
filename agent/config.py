"""The agent's settings (see ``configs/agent.yaml`` for each one explained)."""

from __future__ import annotations

import socket
from typing import Annotated, Literal

from pydantic import BeforeValidator, Field

from gpumgr.agent.enforcer import EnforcerSettings
from gpumgr.wire import defaults
from gpumgr.wire.config import Settings, size
from gpumgr.wire.policy import Policy


class AgentSettings(Settings):
    """Everything ``gpumgr agent`` can be told; env names are ``GPUMGR_`` + the field in capitals."""

    def enforcement(self) -> EnforcerSettings | None:
        """The enforcer's settings, or None when enforcement is off."""
        if not self.enforce:
            return None
        return EnforcerSettings(poll_interval=self.poll_interval, sample_interval=self.sample_interval,
                                tolerance=self.overrun_tolerance, samples=self.overrun_samples,
                                stop_grace=self.stop_grace, confirm_interval=self.overrun_confirm_interval)

    manager: str = defaults.AGENTS_ENDPOINT
    join_token: str | None = None
    state_dir: str | None = None
    join_timeout: float = Field(defaults.JOIN_TIMEOUT, gt=0)
    node: str = Field(default_factory=socket.gethostname, min_length=1)
    gpus: str = "auto"
    #: this node's labels, for ``node.labels.KEY`` constraints (also ``--label KEY=VALUE``)
    labels: dict[Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,254}$")],
                 Annotated[str, Field(max_length=1024)]] = Field(default_factory=dict,
                                                                  max_length=defaults.MAX_NODE_LABELS)
    runtime: Literal["auto", "docker", "process"] = "auto"
    #: where other hosts reach this node (a gang's rendezvous); None: the local address towards the manager
    advertise_addr: str | None = Field(None, max_length=253, pattern=r"^[0-9A-Za-z.:_\[\]-]*$")
    heartbeat_interval: float = Field(defaults.HEARTBEAT_INTERVAL, gt=0)
    network_mode: str | None = None
    #: this node's own ceiling on what any request may ask for, the operator's included (None: the manager's)
    policy: Policy | None = None
    device_requests: Literal["auto", "always", "never"] = "auto"
    process_log_dir: str = "/tmp/gpumgr/logs"
    enforce: bool = True
    poll_interval: float = Field(defaults.POLL_INTERVAL, gt=0)
    sample_interval: float = Field(defaults.SAMPLE_INTERVAL, gt=0)
    overrun_tolerance: Annotated[int, BeforeValidator(size)] = 0
    overrun_samples: int = Field(defaults.OVERRUN_SAMPLES, ge=1)
    overrun_confirm_interval: float = Field(defaults.OVERRUN_CONFIRM_INTERVAL, ge=0)
    stop_grace: float = Field(defaults.STOP_GRACE, ge=0)
    mps: bool = False
    #: where the host's MPS control daemon listens: bound into every container of an ``mps`` node
    mps_pipe_directory: str = Field("/tmp/nvidia-mps", pattern=r"^/[^\x00]*$", max_length=4096)
    hook_socket: str | None = "/run/gpumgr/agent.sock"
    proc_root: str = "/proc"
    # the guard (gpumgr guard, the engine's authorization plugin) and what plain `docker run`s may ask the hook for
    guard_socket: str = "/run/docker/plugins/gpumgr-guard.sock"
    guard_control: str = "/run/gpumgr/guard.sock"
    guard_state: str = "/var/lib/gpumgr/guard.json"
    guard_allow: list[str] = Field(default_factory=list)
    #: runtimes a create may name besides the engine's default and gpumgr's (sandboxes: runsc, kata)
    guard_runtimes: list[Annotated[str, Field(min_length=1, max_length=255)]] = Field(default_factory=list)
    hook_tenant: str | None = None
    hook_max_priority: int = Field(0, ge=-defaults.MAX_PRIORITY, le=defaults.MAX_PRIORITY)
    hook_max_memory: Annotated[int, BeforeValidator(size)] | None = None
    log_level: str = "INFO"
