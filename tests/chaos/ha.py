"""HA chaos schedules: leaders stopped and killed, etcd members killed, agents restarted, under keyed load.

The parts are real: a three-member etcd (:class:`tests.etcd.EtcdCluster`, shared by every schedule of a
run), ``gpumgr manager --store etcd://...`` processes (:class:`tests.ha_procs.HaManagers`) on the chaos
harness's clock (heartbeat 0.25 s), and ``gpumgr agent`` processes on the real Docker engine, each given
every manager's address, with one small simulated GPU each so that queued requests wait and run later.
Containers run with networking off; everything is on loopback.

- :class:`HaStack`: the managers and agents of one etcd prefix; :meth:`HaStack.ensure` brings back whatever
  a schedule left down (it is also each heal's last step).
- :class:`Fault` and :func:`schedule`: faults as data in the network harness's
  :class:`~tests.chaos.harness.Schedule`, seeded: the seed and the schedule's name pick the times, the etcd
  member or the agent, and how long each fault lasts.
- :func:`run_schedule`: the keyed load of :mod:`tests.chaos.ha_load` through every manager, the faults
  and their heals, then, polled until it holds or :data:`SETTLE_WITHIN` passes: every node ready on the
  leader, what the clients were told against the engine and the records, and no key run twice; and
  finally the invariant (:func:`tests.invariant.settles` on the leader). Each schedule is a run of its
  own (its ``chaos.run`` label); :meth:`HaStack.clear` DELETEs what it left before the next.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.chaos.ha_load import RUN_LABEL, KeyedLoad, KeyWatch, Told, problems
from tests.chaos.harness import Schedule, Timing, say
from tests.etcd import EtcdCluster
from tests.ha_procs import HaManager, HaManagers
from tests.invariant import settles
from tests.procs import AgentProc, remove_containers_of, wait_for

#: once the last fault healed, the checks are polled this long before the schedule fails with what differs
SETTLE_WITHIN = 20.0
#: a fault's heal waits at most this long for what it brought back (a manager answering, etcd healthy)
BACK_WITHIN = 30.0
#: one simulated GPU per node, small enough that the load fills it and queued requests wait
GPUS = "sim:1x8GiB"


class HaStack:
    """``managers`` managers under etcd prefix ``prefix`` and one agent per name in ``nodes``."""

    def __init__(self, tmp: Path, etcd: EtcdCluster, prefix: str, nodes: list[str], *, managers: int = 3,
                 timing: Timing | None = None, docker_client: Any = None) -> None:
        self.tmp, self.etcd, self.nodes, self.docker = tmp, etcd, nodes, docker_client
        tmp.mkdir(parents=True, exist_ok=True)
        self.ha = HaManagers(tmp, etcd.endpoints, count=managers, prefix=prefix, env=(timing or Timing()).env())
        self.agents: dict[str, AgentProc] = {}
        try:
            leader = self.ha.leader()
            self._token = self.ha.token()
            if docker_client is not None:
                remove_containers_of(docker_client, *nodes)  # a killed run's leftovers would be adopted
            for node in nodes:
                self.start_agent(node, leader, wait=True)
        except BaseException:
            self.stop()
            raise

    def start_agent(self, node: str, entry: HaManager, wait: bool = False) -> AgentProc:
        """Start ``node``'s agent (again, on the state directory it had)."""
        self.agents[node] = AgentProc(self.tmp, entry, node, gpus=GPUS, endpoints=self.ha.endpoints,
                                      token=self._token, state_dir=self.tmp / f"agent-state-{node}", wait=wait)
        return self.agents[node]

    def urls(self) -> list[str]:
        """Every manager's API, as clients know them (down ones too: a client finds that out itself)."""
        return [m.url for m in self.ha.managers]

    def leader(self) -> HaManager:
        return self.ha.leader(timeout=BACK_WITHIN)

    def ensure(self) -> None:
        """Bring back whatever is down: etcd members, stopped or dead managers, dead agents."""
        stopped = [m for m in self.etcd.members if not m.running]
        for member in stopped:
            member.start()
        if stopped:
            wait_for(self.etcd.healthy, BACK_WITHIN, interval=0.1, what="etcd to answer again")
        for manager in list(self.ha.managers):
            with contextlib.suppress(ProcessLookupError):
                os.kill(manager.popen.pid, signal.SIGCONT)
            if manager.popen.poll() is not None:
                manager.stop()
                self.ha.start(manager.api_port, manager.agent_port)
        for node, agent in self.agents.items():
            if agent.popen.poll() is not None:
                agent.stop()
                self.start_agent(node, self.ha.managers[0])

    def ready(self, leader: HaManager) -> list[str]:
        states = {n["name"]: n["state"] for n in leader.get("/v1/nodes").json()["nodes"]}
        return [f"node {n} is {states.get(n, 'not on the map')} on the leader" for n in self.nodes
                if states.get(n) != "ready"]

    def clear(self, run: str) -> None:
        """DELETE every request of ``run`` still live or queued, and wait until the engine has none of it."""
        leader = self.leader()
        for record in leader.get("/v1/containers").json()["containers"]:
            if record["labels"].get(RUN_LABEL) == run and record["state"] in ("queued", "creating", "running"):
                leader.delete(f"/v1/containers/{record['id']}")
        if self.docker is not None:
            wait_for(lambda: not self.docker.api.containers(filters={"label": f"{RUN_LABEL}={run}"}), BACK_WITHIN,
                     interval=0.2, what=f"the containers of {run} to be removed")

    def stop(self) -> None:
        for agent in self.agents.values():
            with contextlib.suppress(Exception):
                agent.stop(signal.SIGKILL)
        self.ha.stop()
        if self.docker is not None:
            remove_containers_of(self.docker, *self.nodes)


# --- the faults -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Fault:
    """One fault: ``stop_leader`` (SIGSTOP, then SIGCONT), ``kill_leader`` (kill -9, then started again on
    its ports), ``kill_etcd`` (``count`` members kill -9'd, then started again on their data; ``count`` 2 of 3
    loses quorum) or ``restart_agent`` (kill -9 of ``target``'s agent, started again on its state directory);
    ``at`` seconds after the load starts (an agent: once a create is under way there, within 3 s), healed
    ``lasts`` seconds later."""

    kind: str
    at: float
    lasts: float
    target: str = ""
    count: int = 1

    def __str__(self) -> str:
        what = f"{self.kind} {self.target}".strip() + (f" ×{self.count}" if self.kind == "kill_etcd" else "")
        return f"{what} at {self.at:.2f}s for {self.lasts:.2f}s"


Template = Callable[[random.Random, list[str]], list[Fault]]
#: a stopped leader must stay stopped past its 3 s lease, or nobody else is elected
STOPPED = (4.0, 5.0)


def _stop_leader(rng: random.Random, nodes: list[str]) -> list[Fault]:
    return [Fault("stop_leader", rng.uniform(0.8, 1.2), rng.uniform(*STOPPED))]


def _flip(rng: random.Random, nodes: list[str]) -> list[Fault]:
    """M1 stopped (M2 leads), back; then M2 stopped: M1 may lead again, with what it held when deposed."""
    first = Fault("stop_leader", rng.uniform(0.8, 1.2), rng.uniform(*STOPPED))
    return [first, Fault("stop_leader", first.at + first.lasts + rng.uniform(1.0, 1.5), rng.uniform(*STOPPED))]


def _kill_leader(rng: random.Random, nodes: list[str]) -> list[Fault]:
    return [Fault("kill_leader", rng.uniform(0.8, 1.2), rng.uniform(2.0, 3.0))]


def _etcd(count: int) -> Template:
    def template(rng: random.Random, nodes: list[str]) -> list[Fault]:
        """``count`` etcd members down (2 of 3: no quorum, the leader's lease runs out), then back."""
        return [Fault("kill_etcd", rng.uniform(0.8, 1.2), rng.uniform(3.0, 4.0), count=count)]
    return template


def _restart_agent(rng: random.Random, nodes: list[str]) -> list[Fault]:
    return [Fault("restart_agent", rng.uniform(0.8, 1.2), rng.uniform(1.5, 2.5), target=rng.choice(nodes))]


def _mix(rng: random.Random, nodes: list[str]) -> list[Fault]:
    """Two or three faults of different kinds, overlapping."""
    kinds = rng.sample([rng.choice(("stop_leader", "kill_leader")), "etcd", "restart_agent"], rng.choice((2, 3)))
    faults = []
    for kind in kinds:
        at = rng.uniform(0.5, 3.0)
        faults.append(Fault("stop_leader", at, rng.uniform(*STOPPED)) if kind == "stop_leader" else
                      Fault("kill_leader", at, rng.uniform(2.0, 3.0)) if kind == "kill_leader" else
                      Fault("kill_etcd", at, rng.uniform(2.0, 4.0), count=rng.choice((1, 2))) if kind == "etcd" else
                      Fault("restart_agent", at, rng.uniform(1.0, 3.0), target=rng.choice(nodes)))
    return faults


TEMPLATES: dict[str, Template] = {
    "stop_leader": _stop_leader, "flip": _flip, "kill_leader": _kill_leader, "etcd_member": _etcd(1),
    "etcd_quorum": _etcd(2), "restart_agent": _restart_agent, "mix": _mix,
}


def schedule(name: str, seed: int, nodes: list[str]) -> Schedule:
    """The schedule ``name`` for ``seed``: the same seed gives the same faults."""
    rng = random.Random(f"{seed}/ha/{name}")
    return Schedule(name, seed, tuple(TEMPLATES[name](rng, sorted(nodes))))


class Faults:
    """Applies and heals faults on a stack, remembering what each one took down."""

    def __init__(self, stack: HaStack, rng: random.Random) -> None:
        self.stack, self.rng = stack, rng
        self.taken: dict[Fault, list[Any]] = {}

    def apply(self, fault: Fault) -> None:
        stack = self.stack
        if fault.kind in ("stop_leader", "kill_leader"):
            leader = next((m for m in stack.ha.managers if m.popen.poll() is None and m.leads), None)
            if leader is None:  # no leader right now (another fault): nothing to take
                self.taken[fault] = []
                return
            os.kill(leader.popen.pid, signal.SIGSTOP if fault.kind == "stop_leader" else signal.SIGKILL)
            self.taken[fault] = [leader]
        elif fault.kind == "kill_etcd":
            members = self.rng.sample([m for m in stack.etcd.members if m.running], fault.count)
            for member in members:
                member.kill()
            self.taken[fault] = members
        else:
            self._creating(fault.target)
            agent = stack.agents[fault.target]
            agent.stop(signal.SIGKILL)
            self.taken[fault] = [agent]

    def _creating(self, node: str, within: float = 3.0) -> None:
        """Wait (at most ``within`` seconds) until ``node``'s engine has a container created and not yet
        started: an agent killed then is in the middle of a create, the case a restart must get right."""
        if self.stack.docker is None:
            return
        deadline = time.monotonic() + within
        while time.monotonic() < deadline and not self.stack.docker.api.containers(
                all=True, filters={"label": f"gpumgr.node={node}", "status": "created"}):
            time.sleep(0.02)

    def heal(self, fault: Fault) -> None:
        stack = self.stack
        for part in self.taken.pop(fault, []):
            if fault.kind == "stop_leader":
                with contextlib.suppress(ProcessLookupError):
                    os.kill(part.popen.pid, signal.SIGCONT)
            elif fault.kind == "kill_leader":
                part.stop()
                try:
                    stack.ha.start(part.api_port, part.agent_port)
                except AssertionError as exc:  # it exits when no etcd member answers (quorum still lost)
                    say(f"the killed leader could not start again yet ({str(exc).splitlines()[0]}); "
                        "it is started once etcd is back")
            elif fault.kind == "kill_etcd":
                part.start()
            else:
                stack.start_agent(fault.target, stack.ha.managers[0])


# --- one schedule -----------------------------------------------------------------------------------------
@dataclass
class Outcome:
    """What one schedule did: what the clients were told and the problems found (none: it passed)."""

    schedule: Schedule
    run: str
    told: Told
    problems: list[str]
    settled_in: float


def run_schedule(stack: HaStack, plan: Schedule, image: str, docker_client: Any, *, clients: int = 4,
                 pause: float = 0.05, settle_within: float = SETTLE_WITHIN) -> Outcome:
    """Run ``plan`` under keyed load on ``stack``, heal, and check everything (see the module docstring)."""
    say(str(plan))
    run = f"{plan.name}-{plan.seed}-{time.monotonic_ns() % 10**6}"
    told, watch = Told(), KeyWatch(docker_client, run)
    faults = Faults(stack, random.Random(f"{plan.seed}/ha/{plan.name}/targets"))
    load = KeyedLoad(stack.urls, image, run, told, plan.seed, clients=clients, pause=pause).start()
    start = time.monotonic()
    steps = sorted([(f.at, 0, f) for f in plan.faults] + [(f.at + f.lasts, 1, f) for f in plan.faults],
                   key=lambda step: (step[0], step[1]))
    try:
        for at, heal, fault in steps:
            time.sleep(max(0.0, start + at - time.monotonic()))
            (faults.heal if heal else faults.apply)(fault)
        stack.ensure()
        healed = time.monotonic()
        time.sleep(max(0.0, start + plan.load_for - time.monotonic()))
    finally:
        load.stop()
        for fault in list(faults.taken):
            faults.heal(fault)
        stack.ensure()
    settle_from = time.monotonic()
    try:
        found = settle(stack, told, watch, run, healed, settle_within)
    finally:
        watch.close()
    found += told.odd  # answers no call may get (a 500, a 504): seen during the load, not to wait out
    if not found:
        try:
            settles(stack.leader(), docker_client, set(stack.nodes))
        except AssertionError as exc:
            found = [str(exc)]
    say(f"{plan.name}: answers {dict(sorted(told.answers.items()))}; "
        f"{'settled' if not found else 'still differs'} {time.monotonic() - settle_from:.1f}s after the load")
    return Outcome(plan, run, told, found, time.monotonic() - settle_from)


def settle(stack: HaStack, told: Told, watch: KeyWatch, run: str, healed: float, within: float) -> list[str]:
    """Poll the checks until none fails (``[]``) or ``within`` seconds past ``healed`` (what still differs)."""
    late: set[str] = set()
    while True:
        leader = stack.leader()
        try:
            records = [r for r in leader.get("/v1/containers").json()["containers"]
                       if r["labels"].get(RUN_LABEL) == run]
            engine = stack.docker.api.containers(all=True, filters={"label": f"{RUN_LABEL}={run}"})
            found = stack.ready(leader) + problems(told, records, engine, watch.counts(), healed, late)
        except (OSError, ValueError) as exc:  # the leader changed under the read
            found = [f"the leader did not answer: {exc!r}"]
        if not found or time.monotonic() > healed + within:
            return found
        time.sleep(0.25)
