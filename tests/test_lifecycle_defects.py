"""Regression tests for the grant-lifecycle defects: each drives the real manager (service, cluster, inbound)
against a scripted agent on a logical clock, and each failed before its fix.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from gpumgr.manager.config import ManagerSettings
from gpumgr.manager.events import EventLog
from gpumgr.manager.model.lifecycle import placed_text
from gpumgr.manager.model.records import Command, Op, OpKind, PlacementSpec
from gpumgr.manager.service import Manager
from gpumgr.wire import defaults, protocol
from gpumgr.wire.errors import GpumgrError
from gpumgr.wire.names import EventType, State
from tests.lifecycle_model import Box, GiB, HeldLink, LogicalClock, ScriptedAgent, engine_violations, lost, refusal
from tests.procs import ManagerProc, free_port, wait_for


class World:
    """A manager with a held link and scripted agents, each with ``gpus`` GPUs of ``size`` bytes."""

    def __init__(self, tmp: Path, nodes: int = 1, gpus: int = 1, size: int = 8 * GiB) -> None:
        self.clock = LogicalClock()
        self.link = HeldLink(self.clock)
        config = ManagerSettings(state_dir=str(tmp / "state"), create_timeout=10.0, remove_timeout=6.0)
        self.manager = Manager(config, link=self.link, clock=self.clock)
        self.cluster = self.manager.cluster
        self.agents = [ScriptedAgent(self.manager, f"n{i}", gpus, size) for i in range(nodes)]
        for agent in self.agents:
            agent.register()

    def post(self, memory: int, *, queue: bool = False, **spec: object) -> str:
        record, commands = self.cluster.submit(PlacementSpec(memory=memory, count=1, placement="spread",
                                                             image="img", command=[], **spec), queue=queue)
        self.manager.send(commands)
        return record.id

    def delete(self, cid: str) -> None:
        self.manager.send(self.cluster.request_removal(cid)[1])

    def held(self, kind: type[protocol.Message]) -> list[int]:
        return [n for n, h in self.link.held.items() if isinstance(h.message, kind)]

    def answer(self, number: int, *, apply: bool = True, reply: protocol.Reply | None = None,
               lose: bool = False) -> None:
        held = self.link.held.pop(number)
        agent = next(a for a in self.agents if a.key == held.key)
        result = agent.apply(held.message) if apply else None
        if lose:
            held.future.set_exception(lost())
        else:
            held.future.set_result(reply or result or protocol.Reply(ok=True))

    def reserved(self) -> int:
        with self.cluster.lock:
            return sum(g.reserved for g in self.cluster.ledger.gpus.values())

    def sound(self) -> None:
        assert self.cluster.check() == []
        assert engine_violations(self.manager, self.agents) == []


def test_1_a_second_delete_while_creating_never_frees_the_grant(tmp_path):
    world = World(tmp_path)
    cid = world.post(4 * GiB)
    world.delete(cid)
    world.delete(cid)  # the second DELETE once sent Remove, got not_found and freed the bytes
    assert world.held(protocol.Remove) == [] and world.reserved() == 4 * GiB
    (create,) = world.held(protocol.Create)
    world.answer(create)  # the create finishes: now the removal the DELETEs asked for goes out
    world.sound()
    (remove,) = world.held(protocol.Remove)
    assert world.reserved() == 4 * GiB
    world.answer(remove)
    assert world.cluster.get(cid).state is State.REMOVED and world.reserved() == 0
    world.sound()


def test_2_a_placed_request_that_ended_before_its_create_was_sent_is_never_created(tmp_path):
    world = World(tmp_path)
    blocker = world.post(6 * GiB)
    world.answer(world.held(protocol.Create)[0])
    waiting = world.post(6 * GiB, queue=True)
    world.manager.send(world.cluster.request_removal(blocker)[1])
    world.answer(world.held(protocol.Remove)[0])  # room frees: the queued request is placed (its create begun)
    with world.cluster.lock:
        world.cluster._placed_by_walk(world.cluster.dispatcher.walk())
    assert world.cluster.get(waiting).state is State.CREATING
    world.cluster.fail(waiting, "its deadline passed")  # ended before the dispatcher sent its create
    world.manager.dispatch_once()
    assert world.held(protocol.Create) == []  # a container with no grant was created here before
    world.sound()


def test_3_a_grow_whose_reply_is_lost_keeps_the_larger_figure_until_the_node_says(tmp_path):
    world = World(tmp_path)
    cid = world.post(2 * GiB)
    world.answer(world.held(protocol.Create)[0])
    _, command = world.cluster.begin_resize(cid, 6 * GiB)
    world.manager.send([command])
    world.answer(world.held(protocol.Resize)[0], lose=True)  # applied on the node, reply lost
    world.sound()
    assert world.cluster.get(cid).held == 6 * GiB  # once rolled back to 2 GiB while the node enforced 6
    with pytest.raises(GpumgrError):  # the rest of the GPU is not free: 6 GiB stay held
        world.post(4 * GiB)
    world.agents[0].heartbeat()  # the node says it enforces 6 GiB: the map agrees, nothing more to send
    assert world.held(protocol.Resize) == [] and world.cluster.get(cid).held == 6 * GiB
    world.sound()


def test_3_a_failed_shrink_leaves_the_larger_held_and_patching_back_is_not_a_no_op(tmp_path):
    world = World(tmp_path)
    cid = world.post(6 * GiB)
    world.answer(world.held(protocol.Create)[0])
    _, command = world.cluster.begin_resize(cid, 2 * GiB, force=True)
    world.manager.send([command])
    world.answer(world.held(protocol.Resize)[0], apply=False, lose=True)  # never reached the node
    assert world.cluster.get(cid).held == 6 * GiB
    world.sound()
    world.agents[0].heartbeat()  # it still enforces 6 GiB: the map's 2 GiB is sent again
    (again,) = world.held(protocol.Resize)
    world.answer(again)
    world.agents[0].heartbeat()
    assert world.cluster.get(cid).held == 2 * GiB and world.cluster.get(cid).enforced == 2 * GiB
    world.sound()


def test_5_after_a_failed_preemption_the_request_preempts_again(tmp_path):
    world = World(tmp_path)
    victim = world.post(6 * GiB, preemptible=True)
    world.answer(world.held(protocol.Create)[0])
    head = world.post(6 * GiB, queue=True, priority=5)
    world.manager.dispatch_once()
    (remove,) = world.held(protocol.Remove)
    world.answer(remove, apply=False, reply=refusal())  # the node could not stop it
    assert world.cluster.get(victim).state is State.RUNNING and world.cluster.get(victim).desired is State.RUNNING
    world.manager.dispatch_once()
    assert world.held(protocol.Remove) == []  # not asked again at once: it backs off
    world.clock.advance(1.5 * defaults.PREEMPT_RETRY_MIN)
    world.manager.dispatch_once()
    (again,) = world.held(protocol.Remove)  # once never tried again: making_room was never cleared
    world.answer(again)
    world.manager.dispatch_once()
    world.answer(world.held(protocol.Create)[0])
    assert world.cluster.get(victim).state is State.PREEMPTED and world.cluster.get(head).state is State.RUNNING
    world.sound()


def test_6_a_deleted_queued_request_is_never_started(tmp_path):
    world = World(tmp_path)
    blocker = world.post(6 * GiB)
    world.answer(world.held(protocol.Create)[0])
    queued = world.post(6 * GiB, queue=True)
    world.manager.send(world.cluster.request_removal(blocker)[1])
    world.answer(world.held(protocol.Remove)[0])
    world.delete(queued)  # decided under the same lock as the dispatcher's walk
    world.manager.dispatch_once()
    assert world.cluster.get(queued).state is State.REMOVED and world.held(protocol.Create) == []
    world.sound()


def test_7_a_request_that_can_no_longer_fit_anywhere_does_not_block_the_queue(tmp_path):
    world = World(tmp_path, nodes=2)
    big = ScriptedAgent(world.manager, "big", 1, 24 * GiB)
    world.agents.append(big)
    big.register()
    world.post(20 * GiB, node="big")  # the big node's GPU taken
    world.answer(world.held(protocol.Create)[0])
    filler = [world.post(8 * GiB) for _ in range(2)]  # both small nodes full
    for number in world.held(protocol.Create):
        world.answer(number)
    giant = world.post(16 * GiB, queue=True)
    small = world.post(4 * GiB, queue=True)
    big.up = False
    world.clock.advance(30)
    world.manager.sweep_once()
    for agent in world.agents[:2]:
        agent.heartbeat()  # back from down: they register again
    world.manager.forget_node("big")  # the only node that could ever hold the giant is gone
    world.delete(filler[0])
    world.answer(world.held(protocol.Remove)[0])
    world.manager.dispatch_once()
    assert world.cluster.get(giant).state is State.QUEUED
    assert world.cluster.get(small).state is State.CREATING  # once stuck behind the giant for ever
    world.sound()


def test_8_a_reply_after_the_agent_reconnected_still_counts(tmp_path):
    world = World(tmp_path)
    cid = world.post(2 * GiB)
    world.agents[0].reconnect()  # a new routing id; the same process and key
    world.agents[0].heartbeat()
    (create,) = world.held(protocol.Create)
    assert world.link.held[create].key == world.agents[0].key  # matched by the proven key
    world.answer(create)
    assert world.cluster.get(cid).state is State.RUNNING
    world.sound()


def test_a_late_reply_for_an_older_operation_is_ignored(tmp_path):
    world = World(tmp_path)
    cid = world.post(2 * GiB)
    (create,) = world.held(protocol.Create)
    held = world.link.held[create]
    world.answer(create, lose=True)  # the manager gave up; the container exists on the node
    assert world.cluster.get(cid).desired is State.RUNNING and world.reserved() == 2 * GiB
    late = held.future.__class__()
    late.set_result(protocol.Reply(ok=False, error=protocol.ErrorBody(code="runtime_failed", message="late")))
    world.manager._replied(_create_command(world, cid), late)  # a late answer to an older create: ignored
    assert world.cluster.get(cid).state is State.CREATING and world.reserved() == 2 * GiB
    world.agents[0].heartbeat()  # the node reports it running: it runs (its caller was told outcome_unknown)
    assert world.cluster.get(cid).state is State.RUNNING and world.reserved() == 2 * GiB
    assert not world.held(protocol.Remove)
    world.sound()


def _create_command(world: World, cid: str) -> Command:
    """A create command for ``cid`` as it was sent before: its operation is no longer the one in flight."""
    record = world.cluster.get(cid)
    return Command(OpKind.CREATE, record, Op(OpKind.CREATE, 0, 0.0))


def test_adoption_naming_gpus_the_node_lacks_is_refused_and_counts_nothing(tmp_path):
    world = World(tmp_path)
    agent = world.agents[0]
    agent.engine["ghost"] = Box("ghost", ["elsewhere-g9"], GiB)
    agent.register()
    record = world.cluster.get("ghost")
    assert record.state is State.FAILED and "does not report" in (record.reason or "")
    assert "ghost" not in agent.engine  # its container is removed
    world.delete("ghost")  # a DELETE of it never takes a count below zero
    world.sound()


def test_event_detail_keys_never_break_the_log_and_nesting_is_bounded(tmp_path):
    events = EventLog()
    deep: dict[str, object] = {}
    cursor = deep
    for _ in range(200):
        cursor["x"] = {}
        cursor = cursor["x"]  # type: ignore[assignment]
    taken = events.record(State.EXITED, "ended", container="c", kind="mine", text="t", message="m", id=5,  # type: ignore[arg-type]
                          deep=deep)
    deep["x"] = "changed after"  # the event keeps what it was given
    [event] = events.since(0)
    assert event["deep"]["x"] != "changed after"
    assert event["message"] == "ended" and event["id"] == taken == 1 and event["kind"] == "mine"
    json.dumps(event)  # bounded: serialisable, no recursion error


def test_events_are_formatted_when_read_and_tagged_with_their_tenant() -> None:
    """A hot path's event keeps its text's parts; the text is made on read, a node's event has no tenant."""
    events = EventLog()
    gpus = ["GPU-a", "GPU-b"]
    events.add(EventType.PLACED, (placed_text, 3 * GiB, gpus), "n1", "c1", "alice", {"final": True})
    events.record(EventType.NODE_UP, "node n1 is ready", node="n1")
    events.record(EventType.QUEUED, "waits", container="c2", tenant=None)
    placed, up, queued = events.since(0)
    assert placed["message"] == "3GiB on GPU-a, GPU-b" and placed["tenant"] == "alice" and placed["final"] is True
    assert placed["type"] == "placed" and placed["node"] == "n1" and placed["container"] == "c1"
    assert up["message"] == "node n1 is ready" and "tenant" not in up
    assert queued["tenant"] is None and "tenant" in queued  # the operator's container: tagged, with no tenant
    assert [e["type"] for e in events.since(placed["id"], {"node_up"})] == ["node_up"]


def test_event_ids_keep_rising_across_restarts(tmp_path):
    first = EventLog(state_dir=tmp_path)
    last = [first.record(State.EXITED, "x") for _ in range(3)][-1]  # type: ignore[arg-type]
    second = EventLog(state_dir=tmp_path)
    assert second.record(State.EXITED, "y") > last  # type: ignore[arg-type]


def test_a_clock_step_does_not_reorder_the_queue(tmp_path):
    world = World(tmp_path)
    world.post(8 * GiB)
    world.answer(world.held(protocol.Create)[0])
    first = world.post(2 * GiB, queue=True)
    world.clock.wall -= 3600  # the wall clock steps back an hour
    second = world.post(2 * GiB, queue=True)
    assert [c.id for c in world.cluster.containers(state="queued")] == [first, second]


def test_a_node_back_after_a_long_absence_reports_exits_with_their_codes(tmp_path):
    world = World(tmp_path)
    cid = world.post(2 * GiB)
    world.answer(world.held(protocol.Create)[0])
    agent = world.agents[0]
    world.clock.advance(60)
    world.manager.sweep_once()  # marked down
    box = agent.engine[cid]
    box.state, box.exit_code, box.ended_at = "exited", 3, world.clock.mono - 40  # ended while it was away
    agent.heartbeat()  # its first heartbeat back asks for the whole report, which carries the exit
    record = world.cluster.get(cid)
    assert record.state is State.EXITED and record.exit_code == 3
    world.sound()


def test_sighup_refuses_a_configuration_the_startup_checks_refuse(tmp_path):
    port = free_port()
    config = tmp_path / "manager.yaml"
    config.write_text("token: operator-token-0123456789\n")
    manager = ManagerProc(tmp_path, "--config", str(config), "--api", f"0.0.0.0:{port}", api_port=port)
    try:
        assert manager.get("/v1/nodes").status_code == 401
        config.write_text("placement: spread\n")  # no token: anyone would be the operator
        manager.popen.send_signal(signal.SIGHUP)
        wait_for(lambda: "reload refused" in manager.output(), 10, what="the refusal logged")
        assert manager.get("/v1/nodes").status_code == 401
    finally:
        manager.stop()


def test_one_operation_at_a_time(tmp_path):
    world = World(tmp_path)
    cid = world.post(2 * GiB)
    world.answer(world.held(protocol.Create)[0])
    _, command = world.cluster.begin_resize(cid, 3 * GiB)
    assert command is not None and command.kind is OpKind.RESIZE
    with pytest.raises(GpumgrError, match="in flight"):
        world.cluster.begin_resize(cid, 4 * GiB)


def test_8_a_reply_over_a_reconnected_socket_resolves_the_request_on_the_real_link(tmp_path):
    """Real sockets: a request is answered by the same agent key over a new connection (a new routing id)."""
    import time

    import zmq

    from gpumgr.manager.link.link import ManagerLink
    from gpumgr.wire import security
    from gpumgr.wire.link.link import Peer

    server, client = security.KeyPair.generate(), security.KeyPair.generate()
    port = free_port()
    heard: list[Peer] = []
    link = ManagerLink(f"tcp://127.0.0.1:{port}", lambda peer, envelope, message: heard.append(peer), server)
    link.start()
    context = zmq.Context()
    try:
        def dealer() -> zmq.Socket[bytes]:
            sock = context.socket(zmq.DEALER)
            security.connect_curve(sock, client, server.public)
            sock.connect(f"tcp://127.0.0.1:{port}")
            sock.send(protocol.encode(protocol.Heartbeat(node="n", gpus=[])))  # the manager learns its routing id
            return sock

        first = dealer()
        wait_for(lambda: heard, 10, what="the first connection heard")
        future = link.request_async(heard[0].routing_id, protocol.Remove(grant="g"), 10, key=client.public)
        assert first.poll(10_000), "the request never arrived"
        envelope, _ = protocol.decode(first.recv())
        first.close(linger=0)
        second = dealer()  # the same agent (key) on a new connection answers
        wait_for(lambda: len(heard) > 1, 10, what="the second connection heard")
        assert heard[1].routing_id != heard[0].routing_id
        second.send(protocol.encode(protocol.Reply(ok=True), reply_to=envelope.id))
        assert future.result(10).ok  # dropped (and a 504) when replies were matched by routing id
        stranger = context.socket(zmq.DEALER)  # another key may not answer for it
        security.connect_curve(stranger, security.KeyPair.generate(), server.public)
        stranger.connect(f"tcp://127.0.0.1:{port}")
        other = link.request_async(heard[1].routing_id, protocol.Remove(grant="h"), 2, key=client.public)
        request, _ = protocol.decode(second.recv()) if second.poll(10_000) else (None, None)
        assert request is not None
        stranger.send(protocol.encode(protocol.Reply(ok=True), reply_to=request.id))
        time.sleep(0.5)
        assert not other.done()
        second.close(linger=0)
        stranger.close(linger=0)
    finally:
        context.term()
        link.stop()


def test_a_create_lost_with_its_agent_process_is_outcome_unknown_until_its_deadline(tmp_path):
    """The agent restarts before reporting the container and registers before the link notices: the waiting POST
    once answered 409 ("container ended"), then 502 agent_failed ("nothing ran"), though the engine may still carry
    out the old process's create (the HA chaos suite saw it start). Now nobody knows: 502 outcome_unknown, the grant
    kept until its deadline, then released."""
    world = World(tmp_path)
    cid = world.post(4 * GiB)
    (create,) = world.held(protocol.Create)
    op = world.cluster.get(cid).op
    world.agents[0].restart()
    world.agents[0].register()  # the new process does not have the container
    record = world.cluster.get(cid)
    assert record.state is State.CREATING and world.reserved() == 4 * GiB
    assert op is not None and op.error is not None
    assert (op.error.status, op.error.code) == (502, "outcome_unknown"), op.error
    assert "restarted" in str(op.error)
    if create in world.link.held:  # the old request's late failure changes nothing
        world.answer(create, apply=False, lose=True)
    world.clock.advance(2 * world.cluster.down_after + 60)
    world.agents[0].heartbeat()
    world.manager.sweep_once()
    assert world.cluster.get(cid).state is State.FAILED and world.reserved() == 0
    world.sound()


def test_a_delete_whose_container_a_heartbeat_shows_gone_before_the_reply_ends_without_error(tmp_path):
    """The chaos suite's find: the heartbeat overtook the Remove's reply, the record ended ``removed``, and the
    waiting DELETE answered 409 "container removed: removed on request"."""
    world = World(tmp_path)
    cid = world.post(4 * GiB)
    world.answer(world.held(protocol.Create)[0])
    world.delete(cid)
    (remove,) = world.held(protocol.Remove)
    op = world.cluster.get(cid).op
    held = world.link.held.pop(remove)
    world.agents[0].apply(held.message)  # done on the node; its reply is still on the way
    world.agents[0].heartbeat()  # the heartbeat comes first and no longer shows it
    assert world.cluster.get(cid).state is State.REMOVED
    assert op is not None and op.ended and op.error is None  # the DELETE did what it was asked
    held.future.set_result(protocol.Reply(ok=True))  # the late reply changes nothing
    world.sound()


def test_a_container_restarted_behind_gpumgr_after_its_exit_is_removed_not_left_without_a_grant(tmp_path):
    """The chaos suite's second find: ``docker restart`` of an exited container ran on with no live grant, forever
    (only failed, removed, expired and preempted records' running containers were orphans)."""
    world = World(tmp_path)
    cid = world.post(4 * GiB)
    world.answer(world.held(protocol.Create)[0])
    agent = world.agents[0]
    agent.exit(cid, 0)
    assert world.cluster.get(cid).state is State.EXITED and world.reserved() == 0
    box = agent.engine[cid]
    box.state, box.exit_code, box.ended_at = "running", None, None  # restarted outside gpumgr
    agent.heartbeat()
    assert cid in agent.engine  # a heartbeat built before the exit may still say running: not at once
    world.clock.advance(world.cluster.down_after + 1)
    agent.heartbeat()
    assert cid not in agent.engine  # it holds GPU memory with no grant: removed as an orphan
    assert world.cluster.get(cid).state is State.EXITED  # its record keeps how it ended
    world.sound()


def test_a_delete_whose_container_exits_before_the_remove_is_answered_ends_without_error(tmp_path):
    """The stop the Remove asked for is reported first (an exit event): the DELETE once answered 409 "exited"."""
    world = World(tmp_path)
    cid = world.post(4 * GiB)
    world.answer(world.held(protocol.Create)[0])
    world.delete(cid)
    (remove,) = world.held(protocol.Remove)
    op = world.cluster.get(cid).op
    world.agents[0].exit(cid, 0)  # stopped by the removal; the reply is still on the way
    assert world.cluster.get(cid).state is State.EXITED
    assert op is not None and not op.ended  # the DELETE is done when its container is gone, not merely stopped
    world.answer(remove)
    assert op.ended and op.error is None and world.cluster.get(cid).state is State.REMOVED
    world.sound()


def test_a_delete_whose_removal_was_cut_off_after_the_stop_is_finished_when_the_node_reports_it(tmp_path):
    """The HA chaos suite's find: the agent was killed between the stop and the removal a DELETE asked for; the
    DELETE had been answered as done on the stop, and the stopped container stayed in the engine, its record
    ``exited``. Now the DELETE waits for the removal, and the node's next report of the stopped container has it
    removed."""
    world = World(tmp_path)
    cid = world.post(4 * GiB)
    world.answer(world.held(protocol.Create)[0])
    world.delete(cid)
    (remove,) = world.held(protocol.Remove)
    op = world.cluster.get(cid).op
    agent = world.agents[0]
    agent.exit(cid, 0)  # stopped; the agent dies before removing it
    world.answer(remove, apply=False, lose=True)
    assert op is not None and op.ended and op.error is not None  # not answered as done
    assert cid in agent.engine and world.cluster.get(cid).state is State.EXITED
    agent.restart()
    agent.register()  # the new agent process reports the stopped container
    (again,) = world.held(protocol.Remove)
    world.answer(again)
    assert cid not in agent.engine and world.cluster.get(cid).state is State.REMOVED
    world.sound()


def test_an_end_reported_with_no_exit_code_is_not_recorded_as_an_exit(tmp_path):
    """The HA chaos suite's find: a container gone from the engine while its agent was away was reported
    ``exited`` with no exit code, and its record broke the invariant (an exit carries its code)."""
    world = World(tmp_path)
    gone, early = world.post(2 * GiB), world.post(2 * GiB)
    for create in world.held(protocol.Create):
        world.answer(create)
    agent = world.agents[0]
    for grant, reason in ((gone, None), (early, "removed_before_start")):
        box = agent.engine[grant]
        box.state, box.exit_code, box.ended_at = "exited", None, world.cluster.clock.monotonic()
        report = protocol.ContainerReport(grant=grant, container_id=f"c-{grant}", gpus=box.gpus,
                                          gpu_memory=box.gpu_memory, state="exited", reason=reason)
        agent._say(protocol.ContainerEvent(node=agent.name, container=report))
    assert world.cluster.get(gone).state is State.REMOVED and world.cluster.get(gone).exit_code is None
    assert world.cluster.get(early).state is State.FAILED
    world.sound()


def test_a_container_that_exits_by_itself_while_a_resize_waits_still_fails_that_resize(tmp_path):
    """Only a removal is done by its container's end: another operation still learns it could not happen."""
    world = World(tmp_path)
    cid = world.post(4 * GiB)
    world.answer(world.held(protocol.Create)[0])
    _, command = world.cluster.begin_resize(cid, 2 * GiB)
    assert command is not None
    world.manager.send([command])
    world.agents[0].exit(cid, 3)
    assert command.op.ended and command.op.error is not None
