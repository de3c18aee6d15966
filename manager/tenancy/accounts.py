"""Accounts: the tree of shares that teams' requests are counted in (``accounts:`` in the manager's YAML).

An account has a guaranteed ``quota`` of GPU memory (bytes × GPUs), a ``limit`` on quota plus
borrowing (absent or ``-1``: none), an ``over_quota_weight`` for its part of the idle surplus, a
``priority`` (the surplus goes to the higher first) and a ``reclaim_min_runtime`` (seconds a borrowing
container runs before reclaim may stop it; inherited from the parent, 60 s at the top). Its parent is
named by its path: ``research/vision`` is a child of ``research``, and the children share what their
parent gets. Requests are counted in *leaf* accounts only: a tenant names one with ``account:``, and a
tenant without one, the operator's own requests and Swarm tasks acting as the operator are in
``default`` (a top-level leaf with no quota and weight 1 unless the YAML sets it).

:class:`AccountTree` is the checked, immutable tree, replaced whole on reload (SIGHUP) with the tenants.
With no ``accounts:`` configured there is no tree, and nothing about placing or the queue changes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from gpumgr.wire import defaults
from gpumgr.wire.config import size

#: One segment of an account's path: as a tenant's name.
SEGMENT = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
#: The leaf that requests without an account of their own are counted in.
DEFAULT = "default"
#: How long a borrowing container runs before reclaim may stop it, where no account on its path says.
RECLAIM_MIN_RUNTIME = 60.0
#: The deepest tree accepted (a path of this many segments).
MAX_DEPTH = 8


def _limit(value: Any) -> int | None:
    if value is None or value in (-1, "-1"):
        return None
    return size(value)


class Memory(BaseModel):
    """A quota or a limit: ``{gpu_memory: 320GiB}``, the only resource an account counts."""

    model_config = ConfigDict(extra="forbid")

    gpu_memory: Annotated[int, BeforeValidator(size)] = 0


class Cap(BaseModel):
    """A limit: ``{gpu_memory: 640GiB}``; ``-1`` (or leaving it out) means no cap."""

    model_config = ConfigDict(extra="forbid")

    gpu_memory: Annotated[int | None, BeforeValidator(_limit)] = None


class AccountConfig(BaseModel):
    """One account in the manager's YAML (``accounts: {path: ...}``)."""

    model_config = ConfigDict(extra="forbid")

    quota: Memory = Field(default_factory=Memory)
    limit: Cap | None = None
    over_quota_weight: float = Field(1.0, ge=0, le=1_000_000)
    priority: int = Field(0, ge=-defaults.MAX_PRIORITY, le=defaults.MAX_PRIORITY)
    reclaim_min_runtime: float | None = Field(None, ge=0, le=30 * 86400)


@dataclass(frozen=True)
class Account:
    """An account as the manager applies it."""

    name: str
    parent: str | None
    quota: int
    #: quota plus borrowing may not pass this (None: no cap)
    limit: int | None
    over_quota_weight: float
    priority: int
    #: its own or inherited
    reclaim_min_runtime: float
    #: the path from the top: ``("research", "research/vision")``
    path: tuple[str, ...] = ()
    children: tuple[str, ...] = ()

    @property
    def leaf(self) -> bool:
        """Requests are counted only in leaves."""
        return not self.children

    def view(self) -> dict[str, Any]:
        """Its settings as ``GET /v1/accounts`` shows them (limit null: no cap)."""
        return {"name": self.name, "parent": self.parent, "quota": {"gpu_memory": self.quota},
                "limit": {"gpu_memory": self.limit}, "over_quota_weight": self.over_quota_weight,
                "priority": self.priority, "reclaim_min_runtime": self.reclaim_min_runtime}


@dataclass(frozen=True)
class AccountTree:
    """Every account by name, each with its path and children; the top-level names in ``tops``."""

    accounts: Mapping[str, Account]
    tops: tuple[str, ...]
    #: tenant name → its leaf account
    members: Mapping[str, str] = field(default_factory=dict)
    #: each account's path as the accounts themselves, top first (read on every grant: no lookups by name)
    chains: Mapping[str, tuple[Account, ...]] = field(default_factory=dict)

    def account_of(self, tenant: str | None) -> str:
        """The leaf a request of ``tenant`` (None: the operator) is counted in."""
        if tenant is None:
            return DEFAULT
        return self.members.get(tenant, DEFAULT)

    def __getitem__(self, name: str) -> Account:
        return self.accounts[name]

    def __contains__(self, name: object) -> bool:
        return name in self.accounts

    def children_of(self, name: str | None) -> tuple[str, ...]:
        """The children of ``name`` (None: the top-level accounts)."""
        return self.tops if name is None else self.accounts[name].children

    def visible_to(self, account: str) -> list[str]:
        """What a tenant in ``account`` may see: its own account and the accounts above it."""
        return list(self.accounts[account].path) if account in self.accounts else []

    def split(self, one: str, other: str) -> tuple[str, str] | None:
        """Under the lowest common parent of ``one`` and ``other``, the two children their paths go through.

        None when one is above the other (or they are the same account): they are not siblings anywhere.
        """
        a, b = self.accounts[one].path, self.accounts[other].path
        for x, y in zip(a, b, strict=False):
            if x != y:
                return x, y
        return None


def build_accounts(configs: Mapping[str, AccountConfig],
                   tenant_accounts: Mapping[str, str | None]) -> AccountTree | None:
    """Check ``configs`` into a tree, and place each tenant in its leaf; None when no accounts are configured.

    Raises ValueError naming what is wrong: a bad name, a missing parent, a tenant naming an account that
    does not exist or has children, a limit below the quota, a tree deeper than :data:`MAX_DEPTH`.
    """
    if not configs:
        named = sorted(t for t, a in tenant_accounts.items() if a)
        if named:
            raise ValueError(f"tenant {named[0]} names account {tenant_accounts[named[0]]!r}, but no accounts are "
                             "configured (add an accounts: section)")
        return None
    configs = dict(configs)
    configs.setdefault(DEFAULT, AccountConfig())
    for name in configs:
        segments = name.split("/")
        if len(segments) > MAX_DEPTH or not all(SEGMENT.match(s) for s in segments):
            raise ValueError(f"account {name!r}: a path of up to {MAX_DEPTH} names of 1-63 of a-z, 0-9, '_', '.', "
                             "'-', joined by '/'")
        parent = "/".join(segments[:-1])
        if parent and parent not in configs:
            raise ValueError(f"account {name}: its parent {parent} is not configured (name every account on its path)")
    if "/" in DEFAULT or any(n.startswith(DEFAULT + "/") for n in configs):
        raise ValueError(f"account {DEFAULT} is where requests without an account go: it may not have children")
    children: dict[str | None, list[str]] = {}
    for name in sorted(configs):
        children.setdefault(name.rpartition("/")[0] or None, []).append(name)
    accounts: dict[str, Account] = {}

    def add(name: str, parent: Account | None) -> None:
        config = configs[name]
        limit = config.limit.gpu_memory if config.limit is not None else None
        if limit is not None and limit < config.quota.gpu_memory:
            raise ValueError(f"account {name}: its limit ({limit} bytes) is below its quota "
                             f"({config.quota.gpu_memory} bytes)")
        runtime = (config.reclaim_min_runtime if config.reclaim_min_runtime is not None
                   else parent.reclaim_min_runtime if parent is not None else RECLAIM_MIN_RUNTIME)
        account = Account(name, parent.name if parent else None, config.quota.gpu_memory, limit,
                          config.over_quota_weight, config.priority, runtime,
                          (parent.path if parent else ()) + (name,), tuple(children.get(name, ())))
        accounts[name] = account
        for child in account.children:
            add(child, account)

    for top in children.get(None, []):
        add(top, None)
    members: dict[str, str] = {}
    for tenant, account_name in tenant_accounts.items():
        leaf: str = account_name or DEFAULT
        if leaf not in accounts:
            raise ValueError(f"tenant {tenant}: account {leaf!r} is not configured")
        if not accounts[leaf].leaf:
            raise ValueError(f"tenant {tenant}: account {leaf} has children; requests are counted in a leaf "
                             f"account only (one of {', '.join(accounts[leaf].children)})")
        members[tenant] = leaf
    chains = {name: tuple(accounts[p] for p in account.path) for name, account in accounts.items()}
    return AccountTree(accounts, tuple(children.get(None, [])), members, chains)


def leaves(tree: AccountTree) -> Iterable[str]:
    """Every leaf account's name."""
    return (name for name, account in tree.accounts.items() if account.leaf)
