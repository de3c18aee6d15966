"""The cluster's calls for gangs: each takes the map's one lock, as every call of the cluster does.

A mixin of :class:`~gpumgr.manager.model.cluster.Cluster`, which sets the attributes below.
"""

from __future__ import annotations

import threading
from typing import Any

from gpumgr.manager.model.gangs.core import Gangs
from gpumgr.manager.model.gangs.spec import Gang, GangSpec
from gpumgr.manager.model.ledger import Ledger
from gpumgr.manager.model.lifecycle import ENDED, Lifecycle
from gpumgr.manager.model.reconcile import Reconciler
from gpumgr.manager.model.records import Command, Container
from gpumgr.manager.tenancy.tenants import Principal, Tenant
from gpumgr.wire.errors import NoFit
from gpumgr.wire.names import LIVE


class GangCalls:
    """Submit, end and read gangs (see :mod:`gpumgr.manager.model.gangs`)."""

    lock: threading.RLock
    gangs: Gangs
    ledger: Ledger
    life: Lifecycle
    reconciler: Reconciler

    def _remove_ended(self, record: Container) -> list[Command]:
        raise NotImplementedError  # the cluster's: an ended record's DELETE

    def submit_gang(self, spec: GangSpec, *, tenant: Tenant | None = None, queue: bool = False,
                    queue_timeout: float | None = None) -> tuple[Gang, list[Command]]:
        """Place every member of a gang now (their creates to send), or with ``queue`` let it wait whole."""
        with self.lock:
            try:
                return self.gangs.submit(spec, tenant=tenant, queue=queue, queue_timeout=queue_timeout)
            except NoFit:
                self.life.outcome("no_fit")
                raise

    def remove_gang(self, gid: str) -> tuple[Gang, list[Command]]:
        """End gang ``gid`` (withdraw it if it waits): its members' removals to send now (an ended member's
        container is removed from its engine, as a DELETE of an ended container does)."""
        with self.lock:
            gang = self.gangs.remove(gid)
            commands = []
            for cid in gang.members:
                record = self.ledger.records.get(cid)
                if record is None:
                    continue
                if record.state in LIVE:
                    follow = self.reconciler.follow_up(record)
                    commands += [follow] if follow is not None else []
                elif record.state in ENDED and record.op is None:
                    commands += self._remove_ended(record)
            return gang, commands

    def gang_views(self, principal: Principal, gid: str | None = None) -> list[dict[str, Any]]:
        """Every gang the caller may see (or only ``gid``: NotFound if it may not), as the API shows them."""
        with self.lock:
            if gid is not None:
                return [self.gangs.view(self.gangs.get(gid, principal))]
            return [self.gangs.view(g) for g in self.gangs.gangs.values() if principal.sees(g.tenant)]
