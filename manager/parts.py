"""What the service's helpers see of the manager: one protocol, so that they need not import the service.

:class:`~gpumgr.manager.service.Manager` builds :mod:`~gpumgr.manager.inbound`,
:mod:`~gpumgr.manager.leading`, :mod:`~gpumgr.manager.headless` and :mod:`~gpumgr.manager.forward`'s
parts and hands itself to them; they reach it through :class:`ManagerParts`, which names only what
they use. So the service imports them and they never import the service: no import circle.
"""

from __future__ import annotations

from typing import Any, Protocol

from gpumgr.manager.config import ManagerSettings
from gpumgr.manager.control.ha import Replicated, Solo
from gpumgr.manager.events import EventLog
from gpumgr.manager.link.admission import Admission
from gpumgr.manager.model.cluster import Cluster
from gpumgr.manager.model.records import Command
from gpumgr.manager.tenancy.tenants import TenantBook


class LeadingPart(Protocol):
    """What the others ask of :class:`~gpumgr.manager.leading.Leading`."""

    @property
    def loaded(self) -> bool:
        """Whether this manager leads and has loaded the store."""

    def wait(self, timeout: float) -> None:
        """Wait for the store to be loaded and the grace after an election to end."""


class InboundPart(Protocol):
    """What the others ask of :class:`~gpumgr.manager.inbound.Inbound`."""

    def refuse_hook_waiters(self, why: str) -> int:
        """Refuse every runtime hook waiting in the queue."""


class ManagerParts(Protocol):
    """The manager, as its helpers use it."""

    @property
    def settings(self) -> ManagerSettings:
        """The settings in force."""

    @property
    def tenants(self) -> TenantBook:
        """Tenants, quotas and tokens."""

    @property
    def plane(self) -> Solo | Replicated:
        """One manager on its state directory, or one of several on etcd."""

    @property
    def admission(self) -> Admission:
        """Joins and node bindings."""

    @property
    def events(self) -> EventLog:
        """The event log."""

    @property
    def cluster(self) -> Cluster:
        """The model."""

    @property
    def link(self) -> Any:
        """The agent link (the real one, or a test's stand-in)."""

    @property
    def leading(self) -> LeadingPart:
        """What leadership coming and going does."""

    @property
    def inbound(self) -> InboundPart:
        """What agents send."""

    @property
    def headless(self) -> Any:
        """Several managers: the headless-leader rule (None for a single manager)."""

    def send(self, commands: list[Command]) -> None:
        """Send each command still current to its node."""
