"""The real manager against scripted agents that delay, drop, repeat and reorder replies, on a logical clock.

Rules: POST (queued or not, 1 to 4 GPUs, burstable or not), POST of a gang (2 or 3 members, queued or not, restarted
once or never), DELETE (any record, twice as likely as not), PATCH, the fate of each request in flight (answered,
refused, lost after it was applied, dropped before, answered again late), node down and up, reconnects, agent
restarts, forgetting a node, containers exiting, containers using more or less (bursters above their grants:
requests reclaim them, the agent's protection stops them), sweeps and dispatches. After every step: the model's
invariant (:meth:`Cluster.check`), the engines' truth (no container alive on a node on the map without its bytes
held), and no gang partly placed. The number of examples is
``GPUMGR_MODEL_EXAMPLES`` (500 in CI); ``bench/lifecycle_model.py`` runs it far longer.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gpumgr.manager.config import ManagerSettings
from gpumgr.manager.model.gangs import GangSpec
from gpumgr.manager.model.records import PlacementSpec
from gpumgr.manager.service import Manager
from gpumgr.wire.errors import GpumgrError
from gpumgr.wire.names import LIVE, State
from tests.lifecycle_model import GiB, HeldLink, LogicalClock, ScriptedAgent, engine_violations, lost, refusal

EXAMPLES = int(os.environ.get("GPUMGR_MODEL_EXAMPLES", "500"))
FATES = st.sampled_from(["answer", "answer", "answer", "refuse", "lose_reply", "drop", "answer_twice"])


class LifecycleMachine(RuleBasedStateMachine):
    """See the module docstring."""

    @initialize(nodes=st.integers(1, 2), gpus=st.sampled_from([1, 2, 4, 4]), size=st.sampled_from([4, 8]))
    def start(self, nodes: int, gpus: int, size: int) -> None:
        import tempfile
        self.folder = tempfile.mkdtemp(prefix="gpumgr-model-")
        self.clock = LogicalClock()
        self.link = HeldLink(self.clock)
        config = ManagerSettings(state_dir=self.folder, heartbeat_interval=1.0, heartbeat_liveness=3,
                                 create_timeout=10.0, remove_timeout=6.0, forget_after=600.0, burst_min_runtime=1.0,
                                 gang_grace=8.0, gang_exit_grace=5.0)  # gangs end within a few steps
        self.manager = Manager(config, link=self.link, clock=self.clock)
        counter = iter(range(1, 1 << 30))
        self.manager.cluster.new_id = lambda: f"r{next(counter):06d}"  # replays draw the same ids
        self.agents = [ScriptedAgent(self.manager, f"n{i}", gpus, size * GiB, mps=i == 0) for i in range(nodes)]
        for agent in self.agents:
            agent.register()
        self.ids: list[str] = []
        self.gangs: list[str] = []

    def agent(self, name: str) -> ScriptedAgent:
        return next(a for a in self.agents if a.name == name)

    def drop_requests_to(self, agent: ScriptedAgent) -> None:
        """Requests sent to a process that is gone are never carried out; their senders hear nothing."""
        for number in [n for n, h in self.link.held.items() if h.key == agent.key]:
            self.link.held.pop(number).future.set_exception(lost())

    def settle(self) -> None:
        for agent in self.agents:
            if agent.up:
                agent._obey()

    # --- the API -------------------------------------------------------------------------------
    @rule(memory=st.integers(1, 8), count=st.sampled_from([1, 1, 1, 2, 3, 4]), queue=st.booleans(),
          priority=st.integers(0, 3),
          preemptible=st.booleans(), burst=st.sampled_from([0, 0, 2, 8]))
    def post(self, memory: int, count: int, queue: bool, priority: int, preemptible: bool, burst: int) -> None:
        spec = PlacementSpec(memory=memory * GiB // 2, count=count, placement="spread", image="img", command=[],
                             priority=priority, preemptible=preemptible,
                             memory_limit=(memory + burst) * GiB // 2 if burst else 0)
        try:
            record, commands = self.manager.cluster.submit(spec, queue=queue)
        except GpumgrError:
            return
        self.ids.append(record.id)
        self.manager.send(commands)

    @rule(memory=st.integers(1, 8), count=st.sampled_from([1, 1, 2]), queue=st.booleans(), share=st.integers(1, 100),
          priority=st.integers(0, 3), preemptible=st.booleans())
    def post_share(self, memory: int, count: int, queue: bool, share: int, priority: int, preemptible: bool) -> None:
        """Issue 36: a compute share goes only to node n0 (MPS), at most 100 per GPU."""
        spec = PlacementSpec(memory=memory * GiB // 2, count=count, placement="spread", image="img", command=[],
                             priority=priority, preemptible=preemptible, compute_share=share)
        try:
            record, commands = self.manager.cluster.submit(spec, queue=queue)
        except GpumgrError:
            return
        assert record.node in ("", "n0"), f"a compute share placed on {record.node}, which runs no MPS"
        self.ids.append(record.id)
        self.manager.send(commands)

    @rule(replicas=st.integers(2, 3), memory=st.integers(1, 8), queue=st.booleans(), restart=st.booleans())
    def post_gang(self, replicas: int, memory: int, queue: bool, restart: bool) -> None:
        member = PlacementSpec(memory=memory * GiB // 2, count=1, placement="spread", image="img", command=[])
        spec = GangSpec(member, replicas, one_per_node=False, restart="gang" if restart else "never",
                        max_restarts=1 if restart else 0)  # a failed gang placed again whole, once
        try:
            gang, commands = self.manager.cluster.submit_gang(spec, queue=queue)
        except GpumgrError:
            return
        self.ids.extend(gang.members)
        self.gangs.append(gang.id)
        self.manager.send(commands)

    @precondition(lambda self: self.ids)
    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        cid = data.draw(st.sampled_from(self.ids), "record")
        for _ in range(data.draw(st.integers(1, 2), "times")):
            record, commands = self.manager.cluster.request_removal(cid)
            self.manager.send(commands)
            assert record.desired is not State.RUNNING or record.state not in LIVE

    def live(self) -> list[str]:
        """Running records to resize (queued ones when none runs)."""
        states = {c: self.manager.cluster.get(c).state for c in self.ids}
        return [c for c, s in states.items() if s is State.RUNNING] or \
            [c for c, s in states.items() if s is State.QUEUED]

    @precondition(lambda self: self.live())
    @rule(data=st.data(), memory=st.integers(1, 8))
    def patch(self, data: st.DataObject, memory: int) -> None:
        cid = data.draw(st.sampled_from(self.live()), "record")
        try:
            _, command = self.manager.cluster.begin_resize(cid, memory * GiB // 2, force=True)
        except GpumgrError:
            return
        if command is not None:
            self.manager.send([command])

    # --- what happens to requests in flight --------------------------------------------------------
    @precondition(lambda self: self.link.held)
    @rule(data=st.data(), fate=FATES)
    def deliver(self, data: st.DataObject, fate: str) -> None:
        self.deliver_one(data.draw(st.sampled_from(sorted(self.link.held)), "request"), fate)  # any order

    def deliver_one(self, number: int, fate: str) -> None:
        held = self.link.held.pop(number)
        agent = next((a for a in self.agents if held.key == a.key), None)
        if agent is None or not agent.up or fate == "drop":
            held.future.set_exception(lost())
            return
        if fate == "refuse":
            held.future.set_result(refusal())
            return
        reply = agent.apply(held.message)
        if fate == "lose_reply":
            held.future.set_exception(lost())
            return
        callbacks = list(getattr(held.future, "_done_callbacks", []))
        held.future.set_result(reply)
        if fate == "answer_twice":  # the same answer again, after it was settled: must change nothing
            for callback in callbacks:
                callback(held.future)
        self.settle()

    @precondition(lambda self: self.link.held)
    @rule(data=st.data())
    def deliver_all(self, data: st.DataObject) -> None:
        """Every request in flight meets a fate at once (drawn for each, in a drawn order)."""
        for number in data.draw(st.permutations(sorted(self.link.held)), "order"):
            if number in self.link.held:
                self.deliver_one(number, data.draw(FATES, "fate"))

    # --- nodes ---------------------------------------------------------------------------------
    @rule(data=st.data())
    def heartbeat(self, data: st.DataObject) -> None:
        agent = data.draw(st.sampled_from(self.agents), "node")
        if agent.up:
            agent.heartbeat()

    @rule(data=st.data(), how=st.sampled_from(["down", "reconnect", "restart"]))
    def node_trouble(self, data: st.DataObject, how: str) -> None:
        agent = data.draw(st.sampled_from(self.agents), "node")
        if how == "down":
            agent.up = False
            return
        if how == "restart":  # requests to the old process are never carried out
            self.drop_requests_to(agent)
            agent.restart()
        else:
            agent.reconnect()
        agent.up = True
        agent.register()

    @precondition(lambda self: any(not a.up for a in self.agents))
    @rule(data=st.data())
    def node_up(self, data: st.DataObject) -> None:
        agent = data.draw(st.sampled_from([a for a in self.agents if not a.up]), "node")
        agent.up = True
        agent.heartbeat()

    @rule(data=st.data())
    def forget(self, data: st.DataObject) -> None:
        agent = data.draw(st.sampled_from(self.agents), "node")
        if self.manager.cluster.node_ready(agent.name):
            return
        try:
            self.manager.forget_node(agent.name)
        except GpumgrError:
            return
        agent.engine.clear()  # its host was rebuilt; it joins again from nothing, and comes back later
        self.drop_requests_to(agent)
        agent.restart()
        agent.up = False
        agent._join()

    @rule(data=st.data(), quarters=st.integers(0, 4), beat=st.booleans())
    def usage_changes(self, data: st.DataObject, quarters: int, beat: bool) -> None:
        """A running container (a burster, where one runs) uses another share of its limit, reported at the next
        heartbeat (at once with ``beat``); requests then find those bytes taken, or reclaim them."""
        agent = data.draw(st.sampled_from(self.agents), "node")
        running = [g for g, b in agent.engine.items() if b.state == "running"]
        bursters = [g for g in running if agent.engine[g].limit > agent.engine[g].gpu_memory]
        if agent.up and running:
            grant = data.draw(st.sampled_from(bursters or running), "container")
            box = agent.engine[grant]
            agent.burst(grant, (box.limit or box.gpu_memory) * quarters // 4)
            if beat:
                agent.heartbeat()

    @rule(data=st.data(), code=st.integers(0, 2))
    def container_exits(self, data: st.DataObject, code: int) -> None:
        agent = data.draw(st.sampled_from(self.agents), "node")
        running = [g for g, b in agent.engine.items() if b.state == "running"]
        if agent.up and running:
            agent.exit(data.draw(st.sampled_from(running), "container"), code)

    # --- time ----------------------------------------------------------------------------------
    @rule(seconds=st.sampled_from([0.5, 2.0, 5.0, 12.0, 40.0]))
    def time_passes(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.link.expire()
        self.manager.sweep_once()
        self.settle()

    @rule()
    def dispatch(self) -> None:
        self.manager.dispatch_once()
        self.settle()
        for gid in self.gangs:  # members of gangs placed by a dispatch (a waiting gang, or a restart)
            self.ids.extend(m for m in self.manager.cluster.gangs.gangs[gid].members if m not in self.ids)

    # --- after every step ----------------------------------------------------------------------
    @invariant()
    def the_invariant_holds(self) -> None:
        if hasattr(self, "manager"):
            assert engine_violations(self.manager, self.agents) == []  # tests/invariant.py, model and engines

    def teardown(self) -> None:
        if hasattr(self, "manager"):
            import shutil
            self.manager.cluster.journal.close()
            shutil.rmtree(self.folder, ignore_errors=True)


LifecycleMachine.TestCase.settings = settings(max_examples=EXAMPLES, stateful_step_count=60, deadline=None,
                                              database=None, suppress_health_check=list(HealthCheck))
test_the_lifecycle_holds_against_a_misbehaving_agent = pytest.mark.timeout(1200)(LifecycleMachine.TestCase)
