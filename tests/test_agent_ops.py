"""A command the manager delivers twice (a frame re-sent after a reconnect) is applied once by the agent.

A real agent (in this process: host processes, a simulated GPU) on a real CURVE link, driven by a
scripted manager: a ROUTER socket this test reads and writes frame by frame, so it can deliver the
same frame twice, or the same command under two request ids, exactly when it wants. Each "container"
is a real process that appends a line to a file when it starts: the lines count the creates.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from gpumgr.agent.agent import Agent
from gpumgr.agent.gpus.select import open_source
from gpumgr.agent.identity import Identity
from gpumgr.agent.runtimes.process_runtime import ProcessRuntime
from gpumgr.wire import protocol, security
from gpumgr.wire.epoch import Epoch
from tests.procs import wait_for

GiB = 1 << 30
BEAT = 0.2


class ScriptedManager:
    """The manager's end of one agent's link, frame by frame: a CURVE-server ROUTER owned by the test's thread."""

    def __init__(self) -> None:
        self.keys = security.KeyPair.generate()
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.auth = security.start_authenticator(self.ctx)
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        security.serve_curve(self.sock, self.keys)
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.routing = b""
        self.epoch: Epoch | None = None
        self.heartbeats = 0
        self.replies: dict[str, list[protocol.Reply]] = {}

    def close(self) -> None:
        self.sock.close(linger=0)
        self.auth.stop()
        self.ctx.term()

    def pump(self, seconds: float) -> None:
        """Read whatever the agent sends for ``seconds``: registrations answered, replies kept, beats counted."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if not self.sock.poll(int(left * 1000) + 1):
                continue
            routing, frame = self.sock.recv_multipart()
            self.routing = routing
            head, message = protocol.decode(frame)
            if isinstance(message, protocol.Register):
                self.sock.send_multipart([routing, protocol.encode(protocol.Registered(heartbeat_interval=BEAT),
                                                                   reply_to=head.id, epoch=self.epoch)])
            elif isinstance(message, protocol.Heartbeat):
                self.heartbeats += 1
            elif isinstance(message, protocol.Reply):
                self.replies.setdefault(head.reply_to or "", []).append(message)

    def until(self, predicate: Callable[[], Any], timeout: float = 15.0, what: str = "the agent") -> Any:
        """Pump until ``predicate()`` is truthy; fail after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not (value := predicate()):
            assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
            self.pump(0.05)
        return value

    def frame(self, message: protocol.Message, msg_id: str | None = None) -> tuple[str, bytes]:
        """``message`` encoded as the manager sends it (stamped with its epoch); returns its id and the frame."""
        msg_id = msg_id or protocol.new_id()
        return msg_id, protocol.encode(message, msg_id=msg_id, epoch=self.epoch)

    def deliver(self, frame: bytes) -> None:
        self.sock.send_multipart([self.routing, frame])

    def ask(self, message: protocol.Message, timeout: float = 15.0) -> protocol.Reply:
        """Send ``message`` once and wait for its reply."""
        msg_id, frame = self.frame(message)
        self.deliver(frame)
        return self.answer(msg_id, timeout)

    def answer(self, msg_id: str, timeout: float = 15.0) -> protocol.Reply:
        replies: list[protocol.Reply] = self.until(lambda: self.replies.get(msg_id), timeout, f"a reply to {msg_id}")
        return replies[0]


class AgentRig:
    """A real agent in this process (host processes, one simulated GPU) connected to a scripted manager."""

    def __init__(self, tmp: Path, manager: ScriptedManager, name: str = "ops-a") -> None:
        self.tmp = tmp
        self.state = tmp / "agent-state"
        self.state.mkdir(parents=True, exist_ok=True)
        holder: list[Agent] = []
        self.runtime = ProcessRuntime(lambda m: holder[0].report_change(m), log_dir=str(tmp / "logs"))
        identity = Identity(self.state, security.KeyPair.generate(), manager.keys.public, None)
        self.agent = Agent(name, manager.endpoint, open_source("sim:1x8GiB", seed=name), self.runtime, identity,
                           heartbeat_interval=BEAT, enforcement=None)
        holder.append(self.agent)
        #: the link's owner: the thread that runs the agent
        self.owner = threading.Thread(target=self.agent.run, name="agent-owner", daemon=True)

    def start(self, manager: ScriptedManager) -> None:
        self.owner.start()
        manager.until(lambda: manager.heartbeats >= 1, what="the agent to register and heartbeat")

    def stop(self) -> None:
        for managed in self.runtime.managed():
            if managed.finished_at is None:
                self.runtime.kill(managed.grant, "test over")
        self.agent.stop()
        self.owner.join(10)

    def spec(self, grant: str) -> protocol.ContainerSpec:
        """A container that writes one line to ``starts`` as it starts, then sleeps."""
        return protocol.ContainerSpec(grant=grant, name=grant, gpus=[self.agent.devices[0].uuid], gpu_memory=GiB,
                                      command=["sh", "-c", f"echo {grant} >> {self.tmp / 'starts'}; exec sleep 60"])

    def starts(self, grant: str) -> int:
        """How many times a process of ``grant`` started."""
        path = self.tmp / "starts"
        return path.read_text().split().count(grant) if path.exists() else 0


@pytest.fixture
def manager() -> Iterator[ScriptedManager]:
    scripted = ScriptedManager()
    yield scripted
    scripted.close()


@pytest.fixture
def rig(tmp_path: Path, manager: ScriptedManager) -> Iterator[AgentRig]:
    agent = AgentRig(tmp_path, manager)
    agent.start(manager)
    yield agent
    agent.stop()


def test_a_create_delivered_twice_starts_one_process_and_every_delivery_is_answered(rig, manager) -> None:
    create = protocol.Create(spec=rig.spec("g-twice"), op="op-1")
    msg_id, frame = manager.frame(create)
    manager.deliver(frame)
    manager.deliver(frame)  # the same frame again, as a manager re-sends it after a reconnect
    first = manager.answer(msg_id)
    assert first.ok, first
    # the same command under another request id while, or after, it runs: answered with the same reply
    again_id, again = manager.frame(create)
    manager.deliver(again)
    assert manager.answer(again_id) == first
    manager.pump(1.0)  # anything a second run would have done has happened by now
    assert rig.starts("g-twice") == 1, "a command delivered twice ran twice"
    assert [m.grant for m in rig.runtime.managed()] == ["g-twice"]
    assert all(reply == first for reply in manager.replies[msg_id])


def test_a_command_delivered_again_while_it_runs_answers_each_request_once_it_ends(rig, manager) -> None:
    create = protocol.Create(spec=rig.spec("g-inflight"), op="op-2")
    ids = []
    for _ in range(3):  # three requests for one operation, all in before the first run can end
        msg_id, frame = manager.frame(create)
        ids.append(msg_id)
        manager.deliver(frame)
    replies = [manager.answer(msg_id) for msg_id in ids]
    assert replies[0].ok and replies == [replies[0]] * 3, replies
    manager.pump(0.5)
    assert rig.starts("g-inflight") == 1
    assert all(len(manager.replies[msg_id]) == 1 for msg_id in ids), manager.replies


def test_a_remove_delivered_twice_is_applied_once_and_a_late_create_does_not_bring_the_container_back(
        rig, manager) -> None:
    created = manager.ask(protocol.Create(spec=rig.spec("g-rm"), op="op-c"))
    assert created.ok, created
    pid = int(created.result["container_id"])
    remove = protocol.Remove(grant="g-rm", stop_grace=0.5, op="op-r")
    ids = [manager.frame(remove), manager.frame(remove)]
    for _, frame in ids:
        manager.deliver(frame)
    removed = [manager.answer(msg_id) for msg_id, _ in ids]
    # without the memory the second remove finds nothing to remove, and says not_found
    assert all(reply.ok and reply.result == {"grant": "g-rm"} for reply in removed), removed
    assert manager.ask(remove).ok  # and once more, well after it ended
    wait_for(lambda: rig.runtime.managed() == [], 10, what="the removed grant to be forgotten")
    # a late duplicate of the create (its frame held up somewhere) gets its old answer: nothing starts again
    late = manager.ask(protocol.Create(spec=rig.spec("g-rm"), op="op-c"))
    assert late == created
    manager.pump(0.5)
    assert rig.starts("g-rm") == 1 and rig.runtime.managed() == []
    # a new operation on the same grant is a new command: it runs
    anew = manager.ask(protocol.Create(spec=rig.spec("g-rm"), op="op-c2"))
    assert anew.ok and int(anew.result["container_id"]) != pid
    wait_for(lambda: rig.starts("g-rm") == 2, 5, what="the new operation's process to start")


def test_an_operation_id_reused_for_another_command_is_not_taken_for_a_repeat(rig, manager) -> None:
    """A restarted manager counts its operations from the start again: the same id with other content runs."""
    assert manager.ask(protocol.Create(spec=rig.spec("g-reuse"), op="op-7")).ok
    first = manager.ask(protocol.Resize(grant="g-reuse", gpu_memory=2 * GiB, op="op-8"))
    assert first.ok and first.result["gpu_memory"] == 2 * GiB
    second = manager.ask(protocol.Resize(grant="g-reuse", gpu_memory=3 * GiB, op="op-8"))
    assert second.ok and second.result["gpu_memory"] == 3 * GiB
    manager.epoch = Epoch(1_700_000_000_000, 9)  # another leader: its op-8 is its own, whatever it asks
    third = manager.ask(protocol.Resize(grant="g-reuse", gpu_memory=2 * GiB, op="op-8"))
    assert third.ok and rig.runtime.get("g-reuse").gpu_memory == 2 * GiB


def test_heartbeats_and_registrations_are_built_off_the_links_thread_and_keep_their_cadence(
        tmp_path, manager) -> None:
    rig = AgentRig(tmp_path, manager)
    built: list[tuple[str, threading.Thread]] = []
    slow, building = threading.Event(), threading.Event()
    for name in ("_register_message", "_heartbeat_message"):
        original = getattr(rig.agent, name)

        def recorded(original: Callable[[], Any] = original, name: str = name) -> Any:
            built.append((name, threading.current_thread()))
            if slow.is_set():  # a GPU or engine that takes its time
                building.set()
                time.sleep(3.0)
            return original()

        setattr(rig.agent, name, recorded)
    rig.start(manager)
    try:
        before = manager.heartbeats
        manager.pump(2.0)
        assert manager.heartbeats - before >= 2.0 / BEAT * 0.6, "heartbeats lost their cadence"
        assert {name for name, _ in built} == {"_register_message", "_heartbeat_message"}
        assert all(thread is not rig.owner for _, thread in built), "a message was built on the link's thread"
        slow.set()
        manager.until(building.is_set, what="a slow heartbeat to be built")
        started = time.monotonic()  # the link still answers at once: it does not wait for the sample
        reply = manager.ask(protocol.Logs(grant="g-none"), timeout=10)
        assert reply.error is not None and reply.error.code == "invalid_request"  # host processes keep no output
        assert time.monotonic() - started < 1.0, "a frame waited for a heartbeat's sample"
        slow.clear()
    finally:
        rig.stop()
