"""The gangs on the map: one job of several members placed all or none, handed its rendezvous, and ended as one.

A gang is ``replicas`` members, each an ordinary record (``gang``, ``rank``) asking for ``count`` GPUs of
``gpu_memory`` each. :meth:`Gangs.submit` places every member in one decision under the map's lock
(:func:`~gpumgr.manager.placing.gang.plan_gang`), or none: a gang that does not fit now is ``409 no_fit``,
or waits whole with ``queue`` (it holds nothing while it waits; each dispatch tries it again, and smaller
requests may take room it cannot use yet). A gang no nodes on the map could ever hold is ``never_fits``.

Every member's environment gets ``GPUMGR_GANG``, ``GPUMGR_GANG_RANK`` (from 0), ``GPUMGR_GANG_SIZE``
and torchrun's own ``PET_NNODES``, ``PET_NODE_RANK``, ``PET_NPROC_PER_NODE`` (its GPUs),
``PET_MASTER_ADDR``, ``PET_MASTER_PORT`` and ``PET_RDZV_ID``: the master is rank 0's node at the address
its agent advertises, on a port taken from ``gang_ports`` for that host (on an overlay network named in
the request, rank 0's container name); with host networking ``NCCL_SOCKET_IFNAME`` leaves out ``docker``
and ``lo``. Its gang id, rank, size, restarts and rendezvous id are in its labels too.

**How a gang ends** (:meth:`Gangs.member_ended`, called by the lifecycle's one transition function):
when every member exits 0 within ``gang_exit_grace`` of the first, the gang ends ``exited`` 0; the first
other end (a non-zero exit, a kill, an overrun, a failed create, a removal) ends the gang with that
member's state and reason, and the others are stopped. A member whose node is down is waited for
``gang_grace`` seconds (paused while the zone rule holds). With ``restart: gang`` a gang that failed is
placed again, whole and fresh, up to ``max_restarts`` (a failed create does not count and does not
restart), with the same ``PET_RDZV_ID``. Called under the ledger's lock. What a waiting gang does is in
:mod:`gpumgr.manager.model.gangs.waiting`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from gpumgr.manager.model.gangs.spec import GANG_ENDED, LABEL, Gang, GangSpec, gang_env
from gpumgr.manager.model.gangs.waiting import Waiting
from gpumgr.manager.model.lifecycle import Lifecycle
from gpumgr.manager.model.records import Command, Container, OpKind
from gpumgr.manager.model.walk.dispatch import constraints_of, request_for, take_slots
from gpumgr.manager.placing.gang import could_ever_fit, plan_gang
from gpumgr.manager.tenancy.tenants import Principal, Tenant
from gpumgr.wire import defaults
from gpumgr.wire.errors import Conflict, NoAgents, NoFit, NotFound
from gpumgr.wire.names import LIVE, EventType, State
from gpumgr.wire.units import format_bytes


class Gangs(Waiting):
    """Every gang on the map; see the module docstring."""

    def __init__(self, life: Lifecycle, follow_up: Callable[[Container], Command | None],
                 new_id: Callable[[], str], create_timeout: Callable[[], float],
                 disrupted: Callable[[], bool]) -> None:
        self.life, self.ledger = life, life.ledger
        self.follow_up, self.new_id, self.create_timeout, self.disrupted = follow_up, new_id, create_timeout, disrupted
        #: whether a container may be stopped now (its node refused to before, and it backs off): the dispatcher's
        self.may_stop: Callable[[Container, float], bool] = lambda record, now: True
        #: waiting gang → the preemptible containers being stopped to make room for it
        self.making_room: dict[str, set[str]] = {}
        self.gangs: dict[str, Gang] = {}
        #: gangs waiting for room, first come first
        self.waiting: list[str] = []
        #: ports in use per host: a gang's master port is unique on its host
        self.ports: dict[str, set[int]] = {}
        self.port_range = defaults.GANG_PORTS
        self.exit_grace = defaults.GANG_EXIT_GRACE
        self.node_grace = defaults.GANG_GRACE
        self.reserve_after = defaults.GANG_RESERVE_AFTER
        #: GPUs holding room for the head gang (uuid → gang id), released and held again at each dispatch
        self.holding: dict[str, str] = {}
        #: the head gang's held GPUs and bytes, kept while it stays the head and its GPUs stay schedulable
        self.hold_plan: tuple[str, list[tuple[str, int]]] | None = None
        self.to_send: list[Command] = []
        #: a walk of the queue placing what fits (the cluster's), and the gang a submit tries in it (whether it waits)
        self.walk: Callable[[], None] = lambda: None
        self.trying: tuple[str, bool] | None = None
        life.member_ended = self.member_ended
        life.member_adopted = self.adopted

    def clear(self) -> None:
        """Forget every gang (the map starts from nothing)."""
        self.gangs, self.waiting, self.ports, self.holding, self.hold_plan = {}, [], {}, {}, None
        self.making_room, self.to_send = {}, []

    # --- placing ---------------------------------------------------------------------------------
    def submit(self, spec: GangSpec, *, tenant: Tenant | None, queue: bool,
               queue_timeout: float | None) -> tuple[Gang, list[Command]]:
        """Place every member now (``creating``, their creates to send), or with ``queue`` wait whole."""
        member = spec.member
        total = member.memory * member.count * spec.replicas
        if tenant is not None:
            self.life.quotas.check(tenant, total, spec.replicas)
        self._check_could_fit(spec)
        cid = self.new_id()
        gang = Gang(cid, spec, tenant.name if tenant is not None else member.tenant, self.life.clock.time(),
                    rdzv_id=os.urandom(8).hex())
        try:
            if not self._account_allows(gang):
                self._over_quota(gang, queue)
                raise NoFit("its account may not run it now: it waits for its account's allocation to fall")
            if self._in_line():
                return gang, self._take_turn(gang, queue)
            plan = plan_gang(self.ledger.index, request_for(member, member.memory), spec.replicas, spec.one_per_node)
            self._check_port(plan)
        except (NoFit, NoAgents) as exc:
            if not queue:
                raise NoFit(f"{exc.message}; send \"queue\": true to wait for room") from None
            self.gangs[gang.id] = gang
            gang.queued_at, gang.waiting_mono = gang.created_at, self.life.clock.monotonic()
            if queue_timeout is not None:
                gang.expires_mono = self.life.clock.monotonic() + queue_timeout
            self._wait(gang)
            self.life.events.record(EventType.QUEUED, f"gang {gang.id} of {spec.replicas} waits for room for every "
                                    f"member at once: {exc.message}", gang=gang.id)
            return gang, []
        self.gangs[gang.id] = gang
        return gang, self._start(gang, plan)

    def _over_quota(self, gang: Gang, queue: bool) -> None:
        """``409 over_quota`` for a gang its account may not run now, unless it will wait (or never, at a limit)."""
        quotas, total = self.life.quotas, self.total(gang)
        assert quotas.accounts is not None
        account = quotas.accounts.account_of(gang.tenant)
        never = quotas.never(account, total)
        if never is not None:
            raise Conflict(f"account {never}'s limit is below this gang's {format_bytes(total)} in all: it can never "
                           "run; nothing was queued", code="over_quota")
        if not queue:
            raise Conflict(f"account {account} may not run this gang of {format_bytes(total)} now (past its quota a "
                           "gang runs only if preemptible, and never past a limit); send \"queue\": true to wait",
                           code="over_quota")

    def _check_could_fit(self, spec: GangSpec) -> None:
        member = spec.member
        if not self.ledger.nodes:
            return
        allowed = constraints_of(member).allows if member.constraints else None
        sizes = {name: [g.total - g.headroom for g in node.gpus if allowed is None or allowed(g)]
                 for name, node in self.ledger.nodes.items() if member.node is None or name == member.node}
        if not could_ever_fit(sizes, member.memory, member.count, spec.replicas, spec.one_per_node):
            per = "its own node each" if spec.one_per_node else "nodes it may share"
            raise NoFit(f"no gang of {spec.replicas} members of {member.count} GPU(s) × {format_bytes(member.memory)} "
                        f"on {per} could ever be placed whole on the nodes on the map; nothing was queued",
                        code="never_fits")

    def _start(self, gang: Gang, plan: list[list[Any]]) -> list[Command]:
        """Grant ``plan`` to fresh members of ``gang``: their records join the map ``creating``."""
        spec, member = gang.spec, gang.spec.member
        gang.port_host = self._master_host(plan)
        gang.master_port = self._take_port(gang.port_host)
        base = member.name or f"gpumgr-gang-{gang.id}"
        names = [f"{base}-{rank}" + (f"-r{gang.restart_count}" if gang.restart_count else "")
                 for rank in range(spec.replicas)]
        gang.master_addr = names[0] if spec.network else gang.port_host
        host_network = member.run.get("network") == "host"
        commands, gang.members = [], []
        accounts = self.life.quotas.accounts
        for rank, slots in enumerate(plan):
            labels = {**member.labels, LABEL: gang.id, f"{LABEL}.rank": str(rank),
                      f"{LABEL}.size": str(spec.replicas), f"{LABEL}.restarts": str(gang.restart_count),
                      f"{LABEL}.rdzv": gang.rdzv_id, f"{LABEL}.restart": f"{spec.restart}:{spec.max_restarts}",
                      f"{LABEL}.one_per_node": "1" if spec.one_per_node else "0",
                      f"{LABEL}.master": f"{gang.master_addr}:{gang.master_port}"}
            env = {**member.env, **gang_env(gang, rank, member.count, host_network)}
            record = Container(id=self.new_id(), name=names[rank], node="", gpus=[], gpu_memory=member.memory,
                               spec=replace(member, env=env, labels=labels, name=names[rank]),
                               created_at=self.life.clock.time(), tenant=gang.tenant, priority=member.priority,
                               preemptible=member.preemptible, gang=gang.id, rank=rank)
            if accounts is not None:
                record.account = accounts.account_of(record.tenant)
            take_slots(record, slots)
            self.life.place_new(record, self.create_timeout())
            assert record.op is not None
            commands.append(Command(OpKind.CREATE, record, record.op))
            gang.members.append(record.id)
        gang.state, gang.first_exit_mono, gang.node_down_mono, gang.grace_paused_mono = "creating", None, None, None
        self.life.outcome("placed")
        self.life.events.record(EventType.PLACED, f"gang {gang.id}: {spec.replicas} members placed at once on "
                                f"{', '.join(sorted({s[0].node for s in plan}))}; master {gang.master_addr}:"
                                f"{gang.master_port}", gang=gang.id)
        return commands

    def _master_host(self, plan: list[list[Any]]) -> str:
        """The host of rank 0's node in ``plan``: where the master listens, and whose gang ports it takes."""
        first = self.ledger.nodes.get(plan[0][0].node)
        return (first.advertise_addr if first is not None else "") or "127.0.0.1"

    def _free_port(self, host: str) -> int | None:
        """The lowest port of ``gang_ports`` no gang holds on ``host`` (None: every one is taken)."""
        used = self.ports.get(host, set())
        low, high = self.port_range
        return next((port for port in range(low, high + 1) if port not in used), None)

    def _check_port(self, plan: list[list[Any]]) -> None:
        """NoFit when rank 0's host has no gang port left: a port is room too, the gang waits for it or is no_fit."""
        host = self._master_host(plan)
        if self._free_port(host) is None:
            low, high = self.port_range
            raise NoFit(f"every port of gang_ports {low}-{high} on host {host} is held by a gang; one frees when its "
                        "gang ends")

    def _take_port(self, host: str) -> int:
        port = self._free_port(host)
        assert port is not None  # its plan passed _check_port under the same lock
        self.ports.setdefault(host, set()).add(port)
        return port

    def _release_port(self, gang: Gang) -> None:
        if gang.port_host is not None and gang.master_port is not None:
            self.ports.get(gang.port_host, set()).discard(gang.master_port)
        gang.port_host = None

    def adopted(self, record: Container) -> None:
        """A live member came back in its node's report (a restart or failover): rebuild its gang from its labels.

        What the labels keep: the gang's id, size, restart policy and count, rendezvous id and master. A gang
        placed again later starts its members from the member's image, command and labels as adopted.
        """
        labels = record.labels
        try:
            gid, rank, size = labels[LABEL], int(labels[f"{LABEL}.rank"]), int(labels[f"{LABEL}.size"])
            restart, _, most = labels.get(f"{LABEL}.restart", "never:0").partition(":")
            addr, _, port = labels.get(f"{LABEL}.master", "").rpartition(":")
            restarts = int(labels.get(f"{LABEL}.restarts", "0"))
            one_per_node = labels.get(f"{LABEL}.one_per_node", "1") == "1"
            max_restarts = int(most or 0)
        except (KeyError, ValueError):
            return  # not a gang's member as gpumgr labels them: it runs on as a container on its own
        record.gang, record.rank = gid, rank
        gang = self.gangs.get(gid)
        if gang is None:
            member = replace(record.spec, node=None, labels={k: v for k, v in labels.items()
                                                             if not k.startswith(LABEL)})
            spec = GangSpec(member, size, one_per_node, restart if restart in ("never", "gang") else "never",
                            max_restarts)
            gang = self.gangs[gid] = Gang(gid, spec, record.tenant, record.created_at,
                                          labels.get(f"{LABEL}.rdzv", ""), state="creating", restart_count=restarts,
                                          master_addr=addr or None, master_port=int(port) if port.isdigit() else None)
            gang.port_host = None if gang.master_port is None else self._host_of(record, addr)
            if gang.port_host is not None and gang.master_port is not None:
                self.ports.setdefault(gang.port_host, set()).add(gang.master_port)
            gang.node_down_mono = self.life.clock.monotonic()  # its other members have gang_grace to come back
        if record.id not in gang.members:
            gang.members.append(record.id)
            gang.members.sort(key=lambda m: r.rank if (r := self.ledger.records.get(m)) is not None
                              and r.rank is not None else size)
        if len(gang.members) >= size:
            gang.node_down_mono = gang.grace_paused_mono = None

    def _host_of(self, record: Container, addr: str) -> str:
        node = self.ledger.nodes.get(record.node)
        return (node.advertise_addr if node is not None and node.advertise_addr else "") or addr

    # --- ending ----------------------------------------------------------------------------------
    def member_ended(self, record: Container) -> None:
        """``record``, a member, reached its end: the gang ends, waits for the others, or stops them."""
        gang = self.gangs.get(record.gang or "")
        if gang is None or record.id not in gang.members:
            return
        members = [self.ledger.records.get(m) for m in gang.members]
        if gang.state in GANG_ENDED or gang.state == "restarting":
            self._maybe_done(gang, members)
            return
        if record.state is State.EXITED and record.exit_code == 0 and record.desired is State.RUNNING:
            if gang.first_exit_mono is None:
                gang.first_exit_mono = self.life.clock.monotonic()
            if all(m is not None and m.state is State.EXITED and m.exit_code == 0 for m in members):
                self._end(gang, "exited", "every member exited 0", 0)
            return
        state = {State.EXITED: "failed", State.KILLED: "killed", State.PREEMPTED: "preempted",
                 State.REMOVED: "removed"}.get(record.state, "failed")
        reason = f"member {record.rank} ({record.id}) {record.state}: {record.reason}"
        restart = state != "removed" and not (record.detail.get("create_failed") or self._create_failed(record))
        self._end(gang, state, reason, record.exit_code, restart=restart)

    def _create_failed(self, record: Container) -> bool:
        return record.state is State.FAILED and record.container_id is None

    def _end(self, gang: Gang, state: str, reason: str, exit_code: int | None = None, *,
             restart: bool = False) -> None:
        """End ``gang`` (or mark it for a restart) and stop its members that still run."""
        again = restart and gang.spec.restart == "gang" and gang.restart_count < gang.spec.max_restarts
        gang.reason, gang.exit_code = reason, exit_code
        gang.state, gang.restart_pending = ("restarting", True) if again else (state, False)
        if not again:
            gang.finished_at = self.life.clock.time()
        for cid in gang.members:
            member = self.ledger.records.get(cid)
            if member is not None and member.state in LIVE:
                if member.desired is not State.PREEMPTED:  # one preempted with it (reclaimed whole) ends as such
                    self.life.desire(member, State.REMOVED, f"its gang {gang.id} ended: {reason}")
                member.detail["gang_ended"] = gang.id  # a refused stop is asked again, never given up
        self.life.events.record(EventType.FAILED if state != "exited" else EventType.EXITED,
                                f"gang {gang.id} " + (f"restarts ({gang.restart_count + 1} of "
                                                      f"{gang.spec.max_restarts}): " if again else f"{state}: ")
                                + reason, gang=gang.id)
        self._maybe_done(gang, [self.ledger.records.get(m) for m in gang.members])
        self.ledger.wake.set()

    def _maybe_done(self, gang: Gang, members: list[Container | None]) -> None:
        """Once no member is live: release its port, and a gang to restart waits to be placed again whole."""
        if any(m is not None and m.state in LIVE for m in members):
            return
        self._release_port(gang)
        if gang.restart_pending:
            gang.restart_pending = False
            gang.restart_count += 1
            gang.state, gang.members, gang.waiting_mono = "queued", [], self.life.clock.monotonic()
            self._wait(gang)

    def remove(self, gid: str) -> Gang:
        """``DELETE``: a waiting gang is withdrawn; a placed one ends ``removed`` and its members are stopped."""
        gang = self.gangs.get(gid)
        if gang is None:
            raise NotFound(f"no gang {gid!r}")
        if gang.state in GANG_ENDED:
            return gang
        if gang.state == "queued":
            self._unwait(gang)
            self.making_room.pop(gang.id, None)
            self._release_holds()
            gang.state, gang.reason, gang.finished_at = "removed", "withdrawn before it was placed", \
                self.life.clock.time()
            return gang
        self._end(gang, "removed", "removed on request")
        return gang

    # --- each dispatch ---------------------------------------------------------------------------
    def dispatch(self) -> list[Command]:
        """Grace timers, stops of ended gangs' members, and waiting gangs placed whole: the commands to send."""
        now = self.life.clock.monotonic()
        commands, self.to_send = self.to_send, []  # the creates of gangs the fair walk placed
        for gang in [g for g in self.gangs.values() if g.state in ("creating", "running")]:
            self._tick(gang, now)
        for gang in self.gangs.values():
            for cid in gang.members:
                member = self.ledger.records.get(cid)
                if member is not None and member.desired is State.REMOVED and member.state in LIVE:
                    follow = self.follow_up(member)
                    if follow is not None:
                        commands.append(follow)
        for chosen in self.making_room.values():  # containers being stopped to make room for a waiting gang
            for cid in chosen:
                victim = self.ledger.records.get(cid)
                if victim is not None and victim.desired is State.PREEMPTED and victim.state in LIVE:
                    follow = self.follow_up(victim)
                    if follow is not None:
                        commands.append(follow)
        self._release_holds()
        fair = self.life.quotas.accounts is not None  # with accounts the fair walk tries them, in their accounts' lines
        for gid in self.in_order():
            gang = self.gangs[gid]
            if gang.expires_mono is not None and now >= gang.expires_mono:
                self._unwait(gang)
                gang.state, gang.reason, gang.finished_at = "expired", "its queue_timeout ran out", \
                    self.life.clock.time()
                continue
            wanted = gang.spec.member
            if fair or not self._account_allows(gang) or not self._tenant_allows(gang):
                continue
            try:
                plan = plan_gang(self.ledger.index, request_for(wanted, wanted.memory), gang.spec.replicas,
                                 gang.spec.one_per_node)
            except NoFit:
                self._plan_preemption(gang)
                continue
            except NoAgents:
                continue
            if self._free_port(self._master_host(plan)) is None:
                continue  # its room is there but not a port on its master's host: it waits on, holding nothing
            self._unwait(gang)
            self.making_room.pop(gang.id, None)
            commands += self._start(gang, plan)
        self._hold_for_head(now)
        return commands

    def _tick(self, gang: Gang, now: float) -> None:
        members = [m for cid in gang.members if (m := self.ledger.records.get(cid)) is not None]
        self._started(gang)
        if gang.first_exit_mono is not None and now - gang.first_exit_mono > self.exit_grace:
            late = [str(m.rank) for m in members if m.state in LIVE]
            self._end(gang, "failed", f"member(s) {', '.join(late)} did not exit within gang_exit_grace "
                      f"({self.exit_grace:g}s) of the first", restart=True)
            return
        if len(members) < gang.spec.replicas:  # rebuilt from its nodes: the rest have gang_grace to come back
            if self._grace_over(gang, now):
                self._end(gang, "failed", f"{gang.spec.replicas - len(members)} member(s) never came back within "
                          f"gang_grace ({self.node_grace:g}s) after the manager's restart", restart=True)
            return
        down = [m for m in members if m.state in LIVE and (n := self.ledger.nodes.get(m.node)) is not None
                and not n.ready]
        if not down:
            gang.node_down_mono = gang.grace_paused_mono = None
            return
        if gang.node_down_mono is None:
            gang.node_down_mono = now
        if self._grace_over(gang, now):
            self._end(gang, "failed", f"member {down[0].rank}'s node {down[0].node} was down for over gang_grace "
                      f"({self.node_grace:g}s)", restart=True)

    def _grace_over(self, gang: Gang, now: float) -> bool:
        """Whether a member waited for ran out of ``gang_grace``. The zone rule pauses the wait: a partition is not
        a death, so its time does not count, and the wait resumes where it stopped once the rule no longer holds."""
        if self.disrupted():
            if gang.grace_paused_mono is None:
                gang.grace_paused_mono = now
            return False
        if gang.grace_paused_mono is not None:
            if gang.node_down_mono is not None:
                gang.node_down_mono += now - gang.grace_paused_mono
            gang.grace_paused_mono = None
        return gang.node_down_mono is not None and now - gang.node_down_mono > self.node_grace

    def _started(self, gang: Gang) -> None:
        """A gang ``creating`` is ``running`` once every member runs."""
        if gang.state == "creating" and len(gang.members) == gang.spec.replicas and \
                all((m := self.ledger.records.get(cid)) is not None and m.state is not State.CREATING
                    for cid in gang.members):  # every member started (one may have ended already)
            gang.state = "running"

    # --- reads -----------------------------------------------------------------------------------
    def get(self, gid: str, principal: Principal) -> Gang:
        gang = self.gangs.get(gid)
        if gang is None or not principal.sees(gang.tenant):
            raise NotFound(f"no gang {gid!r}")
        return gang

    def view(self, gang: Gang) -> dict[str, Any]:
        """A gang as the REST API shows it."""
        self._started(gang)
        spec, member = gang.spec, gang.spec.member
        return {"id": gang.id, "state": gang.state, "reason": gang.reason, "exit_code": gang.exit_code,
                "tenant": gang.tenant, "replicas": spec.replicas, "gpus": member.count,
                "gpu_memory": member.memory, "one_per_node": spec.one_per_node, "restart": spec.restart,
                "max_restarts": spec.max_restarts, "restart_count": gang.restart_count,
                "members": list(gang.members), "master_addr": gang.master_addr, "master_port": gang.master_port,
                "rdzv_id": gang.rdzv_id, "image": member.image, "created_at": gang.created_at,
                "finished_at": gang.finished_at, "queued_at": gang.queued_at,
                "queue": {"position": self.waiting.index(gang.id) + 1} if gang.id in self.waiting else None}


