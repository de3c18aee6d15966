"""Tenants: who is calling, what each may ask for, and what each holds.

The manager's config names tenants beside the operator's token; each has its own bearer token (or a
file holding it), optional quotas on its live grants (GPU memory, containers) and the highest
priority its requests may ask for. A request made with a tenant's token acts as that tenant; the
operator's token acts as the operator, who sees everything and may act for a tenant.

:class:`TenantBook` is the live set, replaced whole on reload (SIGHUP), so a request sees either the
old settings or the new ones, never a mix. :class:`Usage` is what one tenant holds, kept by the map.
"""

from __future__ import annotations

import hmac
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from gpumgr.wire import defaults
from gpumgr.wire.config import size
from gpumgr.wire.policy import Policy

#: Tenant names: short, printable, safe in labels, URLs and Prometheus label values.
TENANT_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
#: A token shorter than this is refused: a guessable token is no token.
MIN_TOKEN = 16
#: A token file larger than this is not a token file.
MAX_TOKEN_FILE = 4096


class TenantConfig(BaseModel):
    """One tenant in the manager's YAML config (``tenants: {name: ...}``)."""

    model_config = ConfigDict(extra="forbid")

    token: str | None = Field(None, min_length=MIN_TOKEN, max_length=1024)
    token_file: str | None = None
    gpu_memory: Annotated[int | None, BeforeValidator(lambda v: None if v is None else size(v))] = None
    containers: int | None = Field(None, ge=0)
    priority: int = Field(0, ge=-defaults.MAX_PRIORITY, le=defaults.MAX_PRIORITY)
    #: what its requests may ask for beyond their containers; None: the manager's top-level ``policy``
    policy: Policy | None = None
    #: the leaf account its requests are counted in (``accounts:``); None: ``default``
    account: str | None = Field(None, max_length=600)

    @model_validator(mode="after")
    def _one_token(self) -> TenantConfig:
        if (self.token is None) == (self.token_file is None):
            raise ValueError("give exactly one of token and token_file")
        return self


@dataclass(frozen=True)
class Tenant:
    """A tenant as the manager applies it: its token read, its quotas in bytes and containers."""

    name: str
    token: bytes
    gpu_memory: int | None
    containers: int | None
    priority: int
    policy: Policy | None = None

    def quota_view(self) -> dict[str, Any]:
        """The tenant's limits as ``GET /v1/tenants`` shows them (null: unlimited)."""
        return {"gpu_memory": self.gpu_memory, "containers": self.containers, "priority": self.priority}


@dataclass(frozen=True)
class Principal:
    """Who a request acts as: the operator (``tenant`` None) or one tenant."""

    tenant: str | None

    @property
    def operator(self) -> bool:
        """The operator sees and manages everything."""
        return self.tenant is None

    def sees(self, owner: str | None) -> bool:
        """Whether this caller may see a record owned by ``owner``."""
        return self.tenant is None or self.tenant == owner


OPERATOR = Principal(None)


def build_tenants(configs: dict[str, TenantConfig], operator_token: str | None) -> dict[str, Tenant]:
    """Check and read ``configs``: valid names, readable token files, every token distinct. Raises ValueError."""
    if configs and not operator_token:
        raise ValueError("tenants need the operator's token too: without it any caller with no token would act "
                         "as the operator; set token (or GPUMGR_TOKEN)")
    tenants, seen = {}, {operator_token: "the operator"} if operator_token else {}
    for name, config in configs.items():
        if not TENANT_NAME.match(name):
            raise ValueError(f"tenant name {name!r}: use 1-63 of a-z, 0-9, '_', '.', '-', starting with a letter or "
                             "digit")
        token = config.token if config.token is not None else _read_token(name, config.token_file or "")
        if token in seen:
            raise ValueError(f"tenant {name} has the same token as {seen[token]}; every token must be its own")
        seen[token] = f"tenant {name}"
        tenants[name] = Tenant(name, token.encode(), config.gpu_memory, config.containers, config.priority,
                              config.policy)
    return tenants


def _read_token(name: str, path: str) -> str:
    file = Path(path)
    try:
        if file.stat().st_size > MAX_TOKEN_FILE:
            raise ValueError(f"tenant {name}: token_file {path} is over {MAX_TOKEN_FILE} bytes")
        token = file.read_text().strip()
    except OSError as exc:
        raise ValueError(f"tenant {name}: cannot read token_file {path}: {exc.strerror or exc}") from None
    if len(token) < MIN_TOKEN:
        raise ValueError(f"tenant {name}: the token in {path} is shorter than {MIN_TOKEN} characters")
    return token


class TenantBook:
    """The tenants in force and the operator's token; swapped whole on reload."""

    def __init__(self, tenants: dict[str, Tenant], operator_token: str | None) -> None:
        self._lock = threading.Lock()
        self._tenants = tenants
        self._operator = operator_token.encode() if operator_token else None

    def replace(self, tenants: dict[str, Tenant], operator_token: str | None) -> None:
        """Put new settings in force at once."""
        with self._lock:
            self._tenants = tenants
            self._operator = operator_token.encode() if operator_token else None

    @property
    def open(self) -> bool:
        """No token at all: every caller is the operator (a loopback API without a token)."""
        with self._lock:
            return self._operator is None and not self._tenants

    def identify(self, given: str) -> Principal | None:
        """Who ``given`` (a bearer token) is, or None. Compares against every token, each in constant time."""
        with self._lock:
            operator, tenants = self._operator, list(self._tenants.values())
        if operator is None and not tenants:
            return OPERATOR
        candidate = given.encode()
        found: Principal | None = None
        if operator is not None and hmac.compare_digest(candidate, operator):
            found = OPERATOR
        for tenant in tenants:  # no early exit: the time taken says nothing about which token matched
            if hmac.compare_digest(candidate, tenant.token):
                found = Principal(tenant.name)
        return found

    def get(self, name: str) -> Tenant | None:
        """The tenant called ``name``, if it is configured now."""
        with self._lock:
            return self._tenants.get(name)

    def all(self) -> list[Tenant]:
        """Every tenant in force, by name."""
        with self._lock:
            return sorted(self._tenants.values(), key=lambda t: t.name)


@dataclass(slots=True)
class Usage:
    """What one tenant holds now, and its GPU memory over time since the manager started.

    ``memory`` and ``containers`` count live grants (creating, running) and queued requests alike, as
    Kubernetes counts pending pods against a ResourceQuota: a tenant cannot queue past its quota.
    """

    memory: int = 0
    containers: int = 0
    queued: int = 0
    queued_memory: int = 0
    #: bytes granted (live grants only) and used, integrated over time (byte·seconds)
    granted_byte_seconds: float = 0.0
    used_byte_seconds: float = 0.0
    live_memory: int = 0
    marked: float = 0.0

    def advance(self, now: float) -> None:
        """Add the live grants held since the last mark to the granted integral."""
        marked = self.marked
        if marked and now > marked:  # a clock that stepped back adds nothing (max(0, now - marked), without a call)
            self.granted_byte_seconds += self.live_memory * (now - marked)
        self.marked = now
