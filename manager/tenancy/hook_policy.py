"""Who a runtime hook's grant request acts for: the operator (a Swarm task) or the node's hook tenant.

The agent marks a request from a plain ``docker run`` (not a Swarm task) with its node's
``hook_tenant``; the manager then counts the grant against that tenant's quotas, as if the tenant had
asked over REST. A name the manager does not know is refused, so a typo in an agent's settings
cannot quietly turn into an operator grant.
"""

from __future__ import annotations

from gpumgr.manager.tenancy.tenants import Tenant, TenantBook
from gpumgr.wire.errors import InvalidRequest
from gpumgr.wire.protocol import Reserve


def hook_tenant(tenants: TenantBook, request: Reserve) -> Tenant | None:
    """The tenant ``request`` counts against, or None (the operator); InvalidRequest for an unknown name."""
    if not request.tenant:
        return None
    tenant = tenants.get(request.tenant)
    if tenant is None:
        raise InvalidRequest(f"node {request.node}'s hook_tenant {request.tenant!r} is not a tenant of this manager")
    return tenant
