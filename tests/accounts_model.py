"""A cluster map with accounts on a logical clock, for the fair-share tests: nodes answer every command at once.

Each account has one tenant of the same name (the tenant ``x`` is in account ``x``); ``ask`` queues requests
of one account, ``step`` advances the clock and runs one dispatch, answering its creates (running) and its
removals (the victim stops), and optionally submits again what reclaim stopped, as a Swarm service would.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

from gpumgr.manager.model.cluster import Cluster
from gpumgr.manager.model.records import Command, Container, OpKind, PlacementSpec
from gpumgr.manager.tenancy.accounts import AccountConfig, build_accounts
from gpumgr.manager.tenancy.tenants import OPERATOR, Tenant, TenantBook
from gpumgr.wire.names import LIVE, State
from gpumgr.wire.protocol import ContainerReport, ContainerStatus, GpuInfo, GpuSample, Reply
from tests.invariant import model_violations
from tests.lifecycle_model import LogicalClock

GiB = 1 << 30


def account_tree(accounts: Mapping[str, Mapping[str, Any]], tenants: Mapping[str, str | None]) -> Any:
    """``build_accounts`` from plain dicts."""
    return build_accounts({n: AccountConfig(**c) for n, c in accounts.items()}, tenants)


class Accounts:
    """The harness; see the module docstring."""

    def __init__(self, accounts: Mapping[str, Mapping[str, Any]], *, nodes: int, gpus: int, gpu_memory: int,
                 leaves: list[str] | None = None) -> None:
        self.clock = LogicalClock()
        self.cluster = Cluster(aging=1e9, clock=self.clock)
        leaves = leaves if leaves is not None else list(accounts)
        self.tenants = {leaf: Tenant(leaf.replace("/", "-"), f"token-{leaf}".ljust(16, "x").encode(), None, None, 10)
                        for leaf in leaves}
        self.cluster.tenants = TenantBook({t.name: t for t in self.tenants.values()}, "operator-token-0000")
        self.cluster.accounts = account_tree(accounts, {t.name: leaf for leaf, t in self.tenants.items()})
        self.gpu_memory = gpu_memory
        for n in range(nodes):
            self.add_node(f"n{n}", gpus)
        self.preempted: list[Container] = []
        self.reclaimed: list[Container] = []
        self.placed_ids: list[str] = []
        #: reclaim's victims as they were chosen, with their age then (seconds since their grant)
        self.chosen: dict[str, float] = {}

    def add_node(self, name: str, gpus: int) -> None:
        infos = [GpuInfo(uuid=f"{name}-g{i}", index=i, name="Sim", memory_total=self.gpu_memory) for i in range(gpus)]
        self.cluster.register(name, name.encode(), "docker", infos, [])

    def ask(self, account: str, count: int, memory: int | None = None, *, preemptible: bool = True,
            queue: bool = True, priority: int = 0) -> list[Container]:
        """Submit ``count`` requests of ``memory`` bytes (a whole GPU by default) for ``account``; answer creates."""
        made = []
        for _ in range(count):
            spec = PlacementSpec(memory=memory or self.gpu_memory, count=1, placement="spread", image="img",
                                 command=[], preemptible=preemptible, priority=priority)
            record, commands = self.cluster.submit(spec, queue=queue, tenant=self.tenants[account])
            self.note_chosen()
            self.answer(commands)
            made.append(record)
        return made

    def note_chosen(self) -> None:
        """Note each container reclaim chose since the last look, with its age at that moment."""
        for record in self.cluster.containers():
            if record.desired is State.PREEMPTED and record.desired_reason == "reclaimed" \
                    and record.id not in self.chosen:
                self.chosen[record.id] = self.clock.mono - record.granted_mono

    def answer(self, commands: list[Command | None]) -> None:
        for command in commands:
            if command is None:
                continue
            record = command.record
            if command.kind is OpKind.CREATE:
                report = ContainerReport(grant=record.id, container_id=f"c-{record.id}", gpus=record.gpus,
                                         gpu_memory=record.gpu_memory, state="running")
                self.cluster.settle(command, Reply(ok=True, result=report.model_dump()), None)
                self.placed_ids.append(record.id)
            elif command.kind is OpKind.RESIZE:
                self.cluster.settle(command, Reply(ok=True), None)
            elif command.kind is OpKind.REMOVE:
                self.cluster.settle(command, Reply(ok=True), None)
                if record.state is State.PREEMPTED:
                    self.preempted.append(record)
                    if record.reason == "reclaimed":
                        self.reclaimed.append(record)

    def step(self, seconds: float = 1.0, *, resubmit: bool = False) -> list[Container]:
        """Advance ``seconds`` and dispatch once; with ``resubmit`` what was stopped asks again. The ones stopped."""
        self.clock.advance(seconds)
        before = len(self.preempted)
        commands, _ = self.cluster.dispatch()
        self.note_chosen()
        self.answer(commands)
        stopped = self.preempted[before:]
        if resubmit:
            for record in stopped:
                self.ask(self.account_of(record), 1, record.gpu_memory, preemptible=record.preemptible)
        return stopped

    def account_of(self, record: Container) -> str:
        assert record.account is not None
        return record.account

    def settle_down(self, steps: int = 400, *, resubmit: bool = False) -> None:
        """Step until a dispatch changes nothing (no placement, no stop) or ``steps`` run out."""
        for _ in range(steps):
            placed = len(self.placed_ids)
            if not self.step(resubmit=resubmit) and len(self.placed_ids) == placed and not self.stopping():
                return

    def stopping(self) -> bool:
        return any(r.desired is State.PREEMPTED and r.state in LIVE for r in self.cluster.containers())

    def view(self) -> dict[str, dict[str, Any]]:
        return {a["name"]: a for a in self.cluster.accounts_view(OPERATOR) or []}

    def gpus_of(self, account: str) -> float:
        """The account's live grants in GPUs (of ``gpu_memory``)."""
        return self.view()[account]["allocated"] / self.gpu_memory

    def fair_gpus(self, account: str) -> float:
        return self.view()[account]["fair_share"] / self.gpu_memory

    def heartbeat(self, names: list[str], held: list[Container]) -> None:
        """Nodes ``names`` (of one GPU each) report ``held``'s containers on them running."""
        for name in names:
            statuses = [ContainerStatus(grant=r.id, container_id=f"c-{r.id}", state="running")
                        for r in held if r.node == name and r.state in LIVE]
            self.cluster.heartbeat(name, name.encode(), [GpuSample(uuid=f"{name}-g0", memory_used=0,
                                                                   memory_unmanaged=0)], statuses)

    def partition(self, alive: list[str], held: list[Container]) -> None:
        """Every node but ``alive`` goes silent at once: the zone rule holds (a partition, not their deaths)."""
        self.clock.advance(self.cluster.down_after + 1)
        self.heartbeat(alive, held)
        self.cluster.sweep()
        assert self.cluster.reconciler.disrupted

    def heal(self, silent: list[str], alive: list[str], held: list[Container]) -> None:
        """The ``silent`` nodes come back and register again with ``held``'s containers: the zone rule ends."""
        for name in silent:
            reports = [ContainerReport(grant=r.id, container_id=f"c-{r.id}", gpus=r.gpus, gpu_memory=r.gpu_memory,
                                       state="running") for r in held if r.node == name]
            self.cluster.register(name, name.encode(), "docker", [GpuInfo(uuid=f"{name}-g0", index=0, name="Sim",
                                                                          memory_total=self.gpu_memory)], reports)
        self.heartbeat(alive, held)
        self.cluster.sweep()
        assert not self.cluster.reconciler.disrupted

    def check(self) -> None:
        """The one invariant over the map holds."""
        assert model_violations(SimpleNamespace(cluster=self.cluster)) == []
