"""The manager's settings (see ``configs/manager.yaml`` for each one explained)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, field_validator

from gpumgr.manager.tenancy.accounts import AccountConfig
from gpumgr.manager.tenancy.tenants import TenantConfig
from gpumgr.wire import defaults
from gpumgr.wire.config import Settings, size
from gpumgr.wire.policy import Policy


class ManagerSettings(Settings):
    """Everything ``gpumgr manager`` can be told; env names are ``GPUMGR_`` + the field in capitals."""

    api: str = f"{defaults.API_HOST}:{defaults.API_PORT}"
    agents: str = defaults.AGENTS_ENDPOINT
    token: str | None = None
    state_dir: str | None = None
    placement: Literal["spread", "binpack"] = defaults.PLACEMENT
    on_overrun: Literal["kill", "stop", "report"] = "kill"
    headroom: Annotated[int, BeforeValidator(size)] = 0
    heartbeat_interval: float = Field(defaults.HEARTBEAT_INTERVAL, gt=0)
    heartbeat_liveness: int = Field(defaults.HEARTBEAT_LIVENESS, ge=1)
    create_timeout: float = Field(defaults.CREATE_TIMEOUT, gt=0)
    #: seconds a burster runs before its burst may be reclaimed for a request that needs the bytes
    burst_min_runtime: float = Field(defaults.BURST_MIN_RUNTIME, ge=0)
    remove_timeout: float = Field(defaults.REMOVE_TIMEOUT, gt=0)
    forget_after: float = Field(defaults.NODE_FORGET_AFTER, gt=0)
    #: this fraction of the ready nodes silent within one down timeout is a partition: nothing of theirs is ended
    disruption_threshold: float = Field(defaults.DISRUPTION_THRESHOLD, gt=0, le=1)
    #: several managers: a leader that hears from under half its nodes this long, while they ask others, steps down
    headless_after: float = Field(defaults.HEADLESS_AFTER, gt=0)
    threads: int = Field(defaults.API_THREADS, ge=1)
    tenants: dict[str, TenantConfig] = Field(default_factory=dict)
    #: fair share across teams: the tree of accounts (none: one waiting line, as without accounts)
    accounts: dict[str, AccountConfig] = Field(default_factory=dict)
    #: what tenants may ask for beyond their containers (a tenant's own ``policy`` replaces it)
    policy: Policy = Field(default_factory=Policy)
    queue_aging: float = Field(defaults.QUEUE_AGING, gt=0)
    #: the ports a gang's master listens on, ``LOW-HIGH``, taken per host
    gang_ports: str = Field(f"{defaults.GANG_PORTS[0]}-{defaults.GANG_PORTS[1]}", pattern=r"^[0-9]{1,5}-[0-9]{1,5}$")
    #: once one member exits 0 the others have this long to exit 0 too
    gang_exit_grace: float = Field(defaults.GANG_EXIT_GRACE, gt=0)
    #: a member whose node is down is waited for this long before its gang ends (paused by the zone rule)
    gang_grace: float = Field(defaults.GANG_GRACE, gt=0)
    #: a gang that waited this long at the head of its priority has room held for it as room frees
    gang_reserve_after: float = Field(defaults.GANG_RESERVE_AFTER, ge=0)
    log_level: str = "INFO"
    #: several managers on etcd: ``etcd://HOST:PORT[,HOST:PORT...][/PREFIX]``, ``etcds://`` for TLS
    store: str | None = None
    store_ca: str | None = None
    store_cert: str | None = None
    store_key: str | None = None
    #: the URL other managers and clients reach this manager's API at (published in the store)
    advertise_api: str | None = None

    @field_validator("gang_ports")
    @classmethod
    def _port_range(cls, value: str) -> str:
        low, _, high = value.partition("-")
        if not 1024 <= int(low) <= int(high) <= 65535:
            raise ValueError(f"gang_ports {value!r}: LOW-HIGH with 1024 <= LOW <= HIGH <= 65535")
        return value

    @field_validator("store")
    @classmethod
    def _store_url(cls, value: str | None) -> str | None:
        if value:
            from gpumgr.manager.control.ha import parse_store_url

            parse_store_url(value)
        return value or None
