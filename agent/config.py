"""The agent's settings (see ``configs/agent.yaml`` for each one explained)."""

from __future__ import annotations

import socket
from typing import Literal

from pydantic import Field

from wire import defaults
from wire.config import Settings


class AgentSettings(Settings):
    """Everything ``gpumgr agent`` can be told; env names are ``GPUMGR_`` + the field in capitals."""

    manager: str = defaults.AGENTS_ENDPOINT
    node: str = Field(default_factory=socket.gethostname, min_length=1)
    gpus: str = "auto"
    runtime: Literal["auto", "docker", "process"] = "auto"
    heartbeat_interval: float = Field(defaults.HEARTBEAT_INTERVAL, gt=0)
    network_mode: str | None = None
    device_requests: Literal["auto", "always", "never"] = "auto"
    process_log_dir: str = "/tmp/gpumgr/logs"
    log_level: str = "INFO"
