"""The manager's side of the operator's policy: which policy a request answers to, checked before placing it.

The operator's own requests answer to none; a tenant's to its own ``policy`` when it has one, else to
the manager's top-level ``policy``. The same policy travels to the node in the create message, where
the agent checks again with the node's real paths.
"""

from __future__ import annotations

from typing import Any

from gpumgr.manager.tenancy.tenants import Tenant, TenantBook
from gpumgr.wire.policy import Policy, check
from gpumgr.wire.runspec import RunSpec


def policy_for(default: Policy, tenant: Tenant | None) -> Policy | None:
    """The policy a request acting for ``tenant`` answers to (None: the operator's, unlimited)."""
    if tenant is None:
        return None
    return tenant.policy if tenant.policy is not None else default


def admit(run: RunSpec, default: Policy, tenant: Tenant | None) -> None:
    """Raise PolicyDenied (403) unless ``tenant``'s policy allows ``run``; host paths are judged as written."""
    check(run, policy_for(default, tenant))


def run_fields(run: dict[str, Any], tenant_name: str | None, default: Policy, tenants: TenantBook) -> dict[str, Any]:
    """The create message's ``run`` and ``policy`` for a request of ``tenant_name``: the policy in force now."""
    if not run and tenant_name is None:
        return {}
    tenant = tenants.get(tenant_name) if tenant_name is not None else None
    if tenant_name is not None and tenant is None:  # its tenant was removed while it waited: the strictest
        return {"run": RunSpec.model_validate(run), "policy": Policy()}
    return {"run": RunSpec.model_validate(run), "policy": policy_for(default, tenant)}
