"""A deterministic trace of the queue's decisions on the real cluster map, to prove that without ``accounts:``
the manager decides exactly as it did before accounts existed (issue 34: "nothing changes without accounts").

A *script* is a list of steps, each an action and a few plain integers; :class:`Trace` plays it on a real
:class:`~gpumgr.manager.model.cluster.Cluster` (three nodes, a logical clock, record ids from a counter, tenants
with and without hard quotas): submits (queued or not, of every priority, preemptible or not, for a node or
anywhere, some that can never fit), dispatches, node answers (a create that runs or fails, a remove, a resize),
ends, DELETEs, withdrawals, resizes, and nodes that go silent (down, and with two of three a disrupted zone)
and come back. The integers pick among what exists *now* (``pick % len(candidates)``), so one script drives
two clusters in the same state the same way. After every step the trace takes one line of every observable
decision: the step's outcome (the record's state and placement, or the error's code and HTTP status; the
commands for the nodes), every record's state, desired state, node, GPUs, bytes, reason, exit code and what
it was preempted for, the queue's order, each GPU's reserved bytes, each node's readiness, and each tenant's
counted use. :func:`digest` hashes the lines of one seeded script (:func:`script`).

``tests/data/queue_trace_before_accounts.json`` holds the digests this recorder gave on the tree before accounts
existed (the parent of the commit that introduced them, 9f06032), and ``test_queue_properties.py`` asserts
that today's tree gives the same ones. The recorder uses only what both trees have (no accounts, gangs,
bursts or compute shares), which is why it reads the ledger's plain fields rather than today's views.

To regenerate the file (only when a change of the queue's decisions is intended, and say why in the commit),
check out that tree beside this one and run this module against it, from outside both checkouts so that
``gpumgr`` resolves to the old tree::

    git worktree add --detach /tmp/pre-accounts 9f06032^
    mkdir -p /tmp/pre-pkg/gpumgr && for f in /tmp/pre-accounts/gpumgr/*; do ln -sf $f /tmp/pre-pkg/gpumgr/; done
    for p in manager agent plugin wire; do ln -sfn /tmp/pre-accounts/$p /tmp/pre-pkg/gpumgr/$p; done
    cd /tmp && PYTHONPATH=/tmp/pre-pkg:$REPO $REPO/.venv/bin/python -m tests.queue_trace write \\
        $REPO/tests/data/queue_trace_before_accounts.json

``python -m tests.queue_trace show SEED`` prints one seed's lines, to diff the two trees when a digest differs.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from gpumgr.manager.clock import Clock
from gpumgr.manager.model.cluster import Cluster
from gpumgr.manager.model.records import Command, Container, OpKind, PlacementSpec
from gpumgr.manager.tenancy.tenants import Tenant, TenantBook
from gpumgr.wire.errors import GpumgrError
from gpumgr.wire.names import LIVE, State
from gpumgr.wire.protocol import ContainerReport, ContainerStatus, ErrorBody, GpuInfo, GpuSample, Reply

GiB = 1 << 30
DATA = Path(__file__).parent / "data" / "queue_trace_before_accounts.json"
SEEDS = 100
STEPS = 150
#: node name → its GPUs' memory in GiB
NODES = {"a": (8, 8), "b": (16,), "c": (4, 4, 4)}
CAPACITY = sum(sum(sizes) for sizes in NODES.values()) * GiB
TENANTS = {"t1": Tenant("t1", b"t1" * 8, 12 * GiB, 4, 5), "t2": Tenant("t2", b"t2" * 8, None, None, 2),
           "t3": Tenant("t3", b"t3" * 8, 20 * GiB, None, 9)}
DOWN_AFTER = 10.0
#: (action, weight) of a random script
ACTIONS = (("submit", 30), ("dispatch", 14), ("answer", 22), ("end", 7), ("delete", 6), ("withdraw", 3),
           ("resize", 6), ("down", 2), ("up", 3), ("wait", 7))
Step = tuple[str, tuple[int, ...]]


class Ticks(Clock):
    """Time that moves only when the script says so (``tests.lifecycle_model.LogicalClock`` is not imported:
    that module needs parts of gpumgr the tree before accounts does not have)."""

    def __init__(self) -> None:
        self.mono, self.wall = 1000.0, 1.7e9

    def monotonic(self) -> float:
        return self.mono

    def time(self) -> float:
        return self.wall


def script(seed: int, steps: int = STEPS) -> list[Step]:
    """The random script of ``seed``: the same on every machine and Python (``random.Random`` is seeded)."""
    rng = random.Random(seed)
    names, weights = zip(*ACTIONS, strict=True)
    return [(rng.choices(names, weights)[0], tuple(rng.randrange(1000) for _ in range(6))) for _ in range(steps)]


class Trace:
    """One cluster played by a script; ``lines`` holds what was decided after each step."""

    def __init__(self, setup: Callable[[Cluster], None] | None = None) -> None:
        self.clock = Ticks()
        self.cluster = Cluster(aging=30.0, clock=self.clock, down_after=DOWN_AFTER)
        numbers = itertools.count()
        self.cluster.new_id = lambda: f"r{next(numbers):04d}"
        self.cluster.dispatcher.jitter = lambda: 1.0  # a refused stop's backoff is jittered at random otherwise
        self.cluster.tenants = TenantBook(dict(TENANTS), "operator-token-0000")
        if setup is not None:
            setup(self.cluster)
        self.silent: set[str] = set()
        #: node → the grants whose containers run there (what its engine would report)
        self.engine: dict[str, set[str]] = {name: set() for name in NODES}
        self.pending: list[Command] = []
        self.lines: list[str] = []
        for name in NODES:
            self.cluster.register(name, name.encode(), "docker", self.gpus(name), [])

    @staticmethod
    def gpus(name: str) -> list[GpuInfo]:
        return [GpuInfo(uuid=f"{name}-g{i}", index=i, name="Sim", memory_total=size * GiB)
                for i, size in enumerate(NODES[name])]

    def play(self, steps: Iterable[Step]) -> list[str]:
        for action, numbers in steps:
            self.step(action, numbers)
        return self.lines

    def step(self, action: str, n: tuple[int, ...]) -> str:
        """Play one step, then let time pass (heartbeats, a sweep); returns the line it recorded."""
        try:
            outcome = getattr(self, f"do_{action}")(*n)
        except GpumgrError as exc:
            outcome = ["error", exc.code, exc.status]
        self.clock.mono += n[5] % 4
        # records made in one tick would tie on created_at, and preemption then takes them in the order of a
        # set of ids (which depends on PYTHONHASHSEED): a thousandth of a second per step keeps them apart
        self.clock.wall += n[5] % 4 + 0.001
        beats = [self.beat(name) for name in NODES if name not in self.silent]
        down, commands = self.cluster.sweep()
        self.take(commands)
        line = json.dumps([action, outcome, beats, sorted(down), self.commands(commands), self.snapshot()],
                          separators=(",", ":"))
        self.lines.append(line)
        return line

    # --- the actions: each returns what it decided ---------------------------------------------------
    def do_submit(self, memory: int, count: int, flags: int, priority: int, where: int, _: int) -> list[Any]:
        tenant = [None, *TENANTS][flags % 4]
        owner = TENANTS[tenant] if tenant else None
        gib = 1 + memory % (17 if memory % 4 == 0 else 5)  # mostly small, so several share a GPU
        spec = PlacementSpec(memory=gib * GiB, count=1 + (count % 7 == 0) + (count % 31 == 0),
                             placement="binpack" if where % 3 == 0 else "spread", image="img", command=[],
                             priority=priority % 6 if owner is None else min(priority % 6, owner.priority),
                             preemptible=bool(flags // 4 % 2), node=list(NODES)[where % 4] if where % 4 < 3 and
                             where % 5 == 0 else None)
        record, commands = self.cluster.submit(spec, queue=bool(flags // 8 % 3), tenant=owner)
        self.take(commands)
        return ["submitted", record.id, self.commands(commands)]

    def do_dispatch(self, *_: int) -> list[Any]:
        commands, expired = self.cluster.dispatch()
        self.take(commands)
        return ["dispatched", self.commands(commands), [r.id for r in expired]]

    def do_answer(self, pick: int, ok: int, *_: int) -> list[Any]:
        if not self.pending:
            return ["nothing pending"]
        command = self.pending.pop(pick % len(self.pending))
        record, node, good = command.record, command.record.node, ok % 8 != 0
        if command.kind is OpKind.CREATE and good:
            report = ContainerReport(grant=record.id, container_id=f"c-{record.id}", gpus=record.gpus,
                                     gpu_memory=record.gpu_memory, state="running")
            reply = Reply(ok=True, result=report.model_dump())
        else:
            reply = Reply(ok=good) if good else Reply(ok=False, error=ErrorBody(code="runtime_failed", message="no"))
        follow = self.cluster.settle(command, reply, None)
        if command.kind is OpKind.CREATE and good and node in self.engine:
            self.engine[node].add(record.id)
        elif command.kind is OpKind.REMOVE and good:
            self.engine.get(node, set()).discard(record.id)
        self.take(follow)
        return ["answered", command.kind.value, record.id, good, self.commands(follow)]

    def do_end(self, pick: int, how: int, *_: int) -> list[Any]:
        running = self.records(State.RUNNING)
        if not running:
            return ["nothing running"]
        record = running[pick % len(running)]
        state = (State.EXITED, State.FAILED)[how % 2]
        self.cluster.finish(record.id, state, exit_code=how % 2, reason="ended by the script")
        self.engine.get(record.node, set()).discard(record.id)
        return ["ended", record.id, state.value]

    def do_delete(self, pick: int, *_: int) -> list[Any]:
        targets = self.records(State.QUEUED, *LIVE)
        if not targets:
            return ["nothing to delete"]
        record, commands = self.cluster.request_removal(targets[pick % len(targets)].id)
        self.take(commands)
        return ["deleted", record.id, record.state.value, self.commands(commands)]

    def do_withdraw(self, pick: int, *_: int) -> list[Any]:
        queued = self.records(State.QUEUED)
        if not queued:
            return ["nothing queued"]
        return ["withdrawn", self.cluster.withdraw(queued[pick % len(queued)].id).id]

    def do_resize(self, pick: int, memory: int, force: int, *_: int) -> list[Any]:
        targets = self.records(State.RUNNING, State.QUEUED)
        if not targets:
            return ["nothing to resize"]
        target = targets[pick % len(targets)]
        tenant = TENANTS[target.tenant] if target.tenant else None
        record, command = self.cluster.begin_resize(target.id, (1 + memory % 12) * GiB, force=bool(force % 2),
                                                    tenant=tenant)
        self.take([command])
        return ["resizing", record.id, self.commands([command])]

    def do_down(self, pick: int, *_: int) -> list[Any]:
        alive = [name for name in NODES if name not in self.silent]
        if not alive:
            return ["all silent"]
        name = alive[pick % len(alive)]
        self.silent.add(name)
        return ["silent", name]

    def do_up(self, pick: int, *_: int) -> list[Any]:
        silent = sorted(self.silent)
        if not silent:
            return ["none silent"]
        name = silent[pick % len(silent)]
        self.silent.discard(name)
        return ["back", name]

    def do_wait(self, seconds: int, *_: int) -> list[Any]:
        self.clock.mono += seconds % 40
        self.clock.wall += seconds % 40
        return ["waited", seconds % 40]

    # --- the world's side ------------------------------------------------------------------------------
    def beat(self, name: str) -> list[Any]:
        """``name`` heartbeats its engine's containers; one back from silence registers again with them."""
        grants = sorted(self.engine[name])
        statuses = [ContainerStatus(grant=g, container_id=f"c-{g}", state="running") for g in grants]
        samples = [GpuSample(uuid=g.uuid, memory_used=0, memory_unmanaged=0) for g in self.gpus(name)]
        answer = self.cluster.heartbeat(name, name.encode(), samples, statuses)
        if answer is not None:
            orphans, commands = answer
            self.take(commands)
            return [name, "beat", sorted(orphans), self.commands(commands)]
        records = {r.id: r for r in self.cluster.containers()}
        reports = [ContainerReport(grant=g, container_id=f"c-{g}", gpus=records[g].gpus,
                                   gpu_memory=records[g].gpu_memory, state="running") for g in grants if g in records]
        orphans, commands, restarted = self.cluster.register(name, name.encode(), "docker", self.gpus(name), reports)
        for orphan in orphans:
            self.engine[name].discard(orphan)
        self.take(commands)
        return [name, "registered", sorted(orphans), self.commands(commands), restarted]

    def take(self, commands: Iterable[Command | None]) -> None:
        self.pending += [c for c in commands if c is not None]

    def records(self, *states: State) -> list[Container]:
        return sorted((r for r in self.cluster.containers() if r.state in states), key=lambda r: r.id)

    @staticmethod
    def commands(commands: Iterable[Command | None]) -> list[Any]:
        """The commands for the nodes, sorted: one call's are sent together, and the stops a dispatch plans come
        out of a set of ids, in an order that depends on PYTHONHASHSEED (in both trees)."""
        return sorted([c.kind.value, c.record.id, c.record.node, list(c.record.gpus)]
                      for c in commands if c is not None)

    def snapshot(self) -> list[Any]:
        """Every observable decision the map holds now."""
        ledger = self.cluster.ledger
        records = [[r.id, r.state.value, r.desired.value, r.node, list(r.gpus), r.gpu_memory, r.held, r.reason,
                    r.desired_reason, r.exit_code, r.preempted_for, r.priority, r.tenant]
                   for r in sorted(self.cluster.containers(), key=lambda r: r.id)]
        gpus = [[uuid, gpu.reserved, sorted(gpu.holders)] for uuid, gpu in sorted(ledger.gpus.items())]
        nodes = [[name, node.ready] for name, node in sorted(ledger.nodes.items())]
        use = [[name, u.memory, u.containers, u.queued, u.queued_memory, u.live_memory]
               for name in TENANTS for u in [self.cluster.usage_of(name)]]
        return [records, list(self.cluster.queue.ids()), gpus, nodes, use]


def digest(seed: int) -> str:
    """The sha256 of the lines seed ``seed``'s script records."""
    return hashlib.sha256("\n".join(Trace().play(script(seed))).encode()).hexdigest()


def main(argv: list[str]) -> int:
    """``write PATH``: the digests of every seed, as JSON; ``show SEED``: one seed's lines."""
    if argv[:1] == ["write"] and len(argv) == 2:
        document = {"seeds": SEEDS, "steps": STEPS, "digests": [digest(seed) for seed in range(SEEDS)]}
        Path(argv[1]).write_text(json.dumps(document, indent=1) + "\n")
        return 0
    if argv[:1] == ["show"] and len(argv) == 2:
        print("\n".join(Trace().play(script(int(argv[1])))))
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
