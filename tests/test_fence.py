"""Agents follow the leader among several managers and refuse every command of an older epoch."""

from __future__ import annotations

import logging
import shutil
import signal
import threading
import time
from pathlib import Path

import msgpack
import pytest

from gpumgr.agent.fence import Fence, FenceUnwritable, StaleEpoch
from gpumgr.agent.managers import ManagerSet, parse_managers
from gpumgr.manager.control.ha import DEPOSED
from gpumgr.manager.link.admission import Admission
from gpumgr.manager.link.link import ManagerLink
from gpumgr.wire import envelope, protocol
from gpumgr.wire.epoch import Epoch
from gpumgr.wire.errors import ProtocolError
from gpumgr.wire.link.link import Peer
from tests.procs import AgentProc, ManagerProc, Proc, free_port, wait_for
from tests.test_agent_ops import AgentRig, ScriptedManager

OLD, NEW, NEXT_STORE = Epoch(1_700_000_000_000, 5), Epoch(1_700_000_000_000, 10), Epoch(1_700_000_000_001, 2)


# --- the fence itself --------------------------------------------------------------------------------
def test_fence_keeps_the_highest_epoch_across_restarts(tmp_path) -> None:
    fence = Fence(tmp_path)
    fence.admit(None)  # a single manager: no epoch, nothing kept
    assert fence.highest is None and not (tmp_path / "fence.json").exists()
    fence.admit(NEW)
    fence.admit(NEW)
    with pytest.raises(StaleEpoch, match="newer leader"):
        fence.admit(OLD)
    fence.durable(NEW)  # what a command waits for before it acts
    again = Fence(tmp_path)
    assert again.highest == NEW
    with pytest.raises(StaleEpoch):
        again.admit(OLD)
    with pytest.raises(StaleEpoch, match="without an epoch"):
        again.admit(None)
    again.admit(NEXT_STORE)  # a rebuilt store: a later generation outranks every revision of the old one
    again.durable(NEXT_STORE)
    with pytest.raises(StaleEpoch):
        Fence(tmp_path).admit(NEW)


def test_a_fence_that_cannot_be_written_refuses_with_a_code_of_its_own_until_it_can(tmp_path) -> None:
    fence = Fence(tmp_path, write_wait=5)
    (tmp_path / "fence.json").mkdir()  # the write fails as on a full or read-only disk (root ignores modes)
    fence.admit(NEW)  # screening never touches the disk, so never fails for it
    with pytest.raises(FenceUnwritable, match=r"fence\.json") as refused:
        fence.durable(NEW)
    assert refused.value.code == "fence_unwritable" and not isinstance(refused.value, StaleEpoch)
    assert FenceUnwritable.code not in DEPOSED  # a manager told so keeps its lead
    with pytest.raises(StaleEpoch):  # the mark rose in memory all the same: the old leader is refused
        fence.admit(OLD)
    (tmp_path / "fence.json").rmdir()
    fence.durable(NEW)  # the next command tries the write again
    assert Fence(tmp_path).highest == NEW
    fence.close()


def test_a_damaged_fence_file_is_an_error_not_a_reset(tmp_path) -> None:
    (tmp_path / "fence.json").write_text('{"generation": "x"}')
    with pytest.raises(ValueError, match=r"fence\.json"):
        Fence(tmp_path)


# --- the envelope ------------------------------------------------------------------------------------
def test_epoch_travels_in_the_envelope_and_only_when_given() -> None:
    message = protocol.Reregister()
    plain = protocol.encode(message)
    assert "epoch" not in msgpack.unpackb(plain)  # a single manager's frames are what they always were
    assert protocol.decode(plain)[0].epoch is None
    head, _ = protocol.decode(protocol.encode(message, epoch=NEW))
    assert head.epoch is not None and Epoch(*head.epoch) == NEW


@pytest.mark.parametrize("bad", [[1], [1, 2, 3], [-1, 2], ["1", "2"], [True, 2], [1, 2**63], "1.2", {"a": 1}])
def test_a_malformed_epoch_is_a_protocol_error(bad) -> None:
    frame = envelope.pack("reregister", {}, epoch=bad)
    with pytest.raises(ProtocolError, match="epoch"):
        protocol.decode(frame)


# --- the address list --------------------------------------------------------------------------------
def test_manager_addresses_parse_and_bad_ones_are_named() -> None:
    assert parse_managers("tcp://m1:9401, tcp://m2:9401,tcp://m1:9401") == ["tcp://m1:9401", "tcp://m2:9401"]
    assert parse_managers("ipc:///run/gpumgr.sock") == ["ipc:///run/gpumgr.sock"]
    for bad in ("", "m1:9401", "tcp://m1", "tcp://m1:9401,", "http://m1:9401", "tcp://m1:99999", "tcp://m1:1/x"):
        with pytest.raises(ValueError, match="manager address"):
            parse_managers(bad)
    ring = ManagerSet(["tcp://a:1", "tcp://b:1"])
    assert [ring.unanswered() for _ in range(4)] == [False, False, False, True]
    assert ring.advance("test") == "tcp://b:1" and ring.advance("test") == "tcp://a:1"


# --- a real agent process against a leader whose epoch the test sets -------------------------------
class EpochManager:
    """The manager end of a real CURVE link: admits one agent, registers it, sends commands with any epoch.

    A ``twin`` shares its key pair (copy its state directory first) and trusts its node bindings, as
    managers sharing a store do. One that is not ``leading`` refuses registrations with ``not_leader``.
    """

    def __init__(self, state: Path, twin: EpochManager | None = None) -> None:
        self.admission = Admission(state)
        self.twin = twin
        self.leading = True
        self.epoch: Epoch | None = None
        self.peer: Peer | None = None
        self.registered = threading.Event()
        self.heartbeats = 0
        self.link = ManagerLink("tcp://127.0.0.1:0", self._handle, self.admission.keys, epoch=lambda: self.epoch)
        self.link.start()

    def _bound(self, key: str, node: str) -> bool:
        return node in (self.admission.node_of(key), self.twin.admission.node_of(key) if self.twin else None)

    def _handle(self, peer: Peer, head: protocol.Envelope, message: protocol.Message) -> None:
        if isinstance(message, protocol.Join):
            self.admission.admit(peer.key, message.node, message.proof)
            self.link.send(peer.routing_id, protocol.Reply(ok=True), reply_to=head.id)
        elif isinstance(message, protocol.Register) and not self.leading:
            self.link.send(peer.routing_id, protocol.Refused(code="not_leader", message="another manager leads"))
        elif isinstance(message, protocol.Register) and self._bound(peer.key, message.node):
            self.peer = peer
            self.link.send(peer.routing_id, protocol.Registered(heartbeat_interval=1.0))
            self.registered.set()
        elif isinstance(message, protocol.Heartbeat):
            self.heartbeats += 1

    def command(self, epoch: Epoch | None) -> protocol.Reply:
        assert self.peer is not None
        self.epoch = epoch
        return self.link.request(self.peer.routing_id, protocol.Remove(grant="g-none", stop_grace=0), 10)


def agent_proc(tmp: Path, endpoint: str, token: str | None, name: str = "fence-a") -> Proc:
    join = ["--join", token] if token else []
    return Proc(["agent", "--manager", endpoint, "--node", name, "--gpus", "sim:1x8GiB", "--runtime", "process",
                 "--state-dir", str(tmp / "agent-state"), *join], tmp / f"agent-{name}.log")


def test_a_real_agent_refuses_older_epochs_across_its_restart(tmp_path) -> None:
    manager = EpochManager(tmp_path / "manager")
    agent = agent_proc(tmp_path, manager.link.bound_endpoint, manager.admission.token())
    try:
        assert manager.registered.wait(20), agent.output()
        accepted = manager.command(NEW)
        assert accepted.error is None or accepted.error.code != "stale_epoch"  # the agent ran it
        for stale in (OLD, None):
            refused = manager.command(stale)
            assert not refused.ok and refused.error is not None and refused.error.code == "stale_epoch"
        assert "newer leader" in agent.output()
        agent.stop()
        manager.registered.clear()
        agent = agent_proc(tmp_path, manager.link.bound_endpoint, None)
        manager.epoch = NEXT_STORE  # the restarted agent registers with a leader of a rebuilt store
        assert manager.registered.wait(20), agent.output()
        assert manager.command(NEW).error.code == "stale_epoch"  # type: ignore[union-attr]
        assert manager.command(NEXT_STORE).error.code != "stale_epoch"  # type: ignore[union-attr]
    finally:
        agent.stop()
        manager.link.stop()


def test_a_real_agent_answers_every_kind_of_frame_from_a_lower_epoch_with_its_own_epoch(tmp_path) -> None:
    """Issue 31, item 7: not only commands. A ``Registered`` or ``Reregister`` of a leader below the agent's fence
    (an etcd restored from a snapshot) was dropped in silence, and that leader never learnt why no node followed it."""
    manager = EpochManager(tmp_path / "manager")
    agent = agent_proc(tmp_path, manager.link.bound_endpoint, manager.admission.token())
    try:
        assert manager.registered.wait(20), agent.output()
        manager.command(NEW)  # the agent's fence is now NEW
        assert manager.peer is not None
        manager.epoch = OLD
        for message in (protocol.Registered(heartbeat_interval=1.0), protocol.Reregister()):
            told = manager.link.request(manager.peer.routing_id, message, 10)
            assert not told.ok and told.error is not None and told.error.code == "stale_epoch", (message, told)
            assert Epoch.from_wire(told.result["epoch"]) == NEW
    finally:
        agent.stop()
        manager.link.stop()


def test_an_agent_keeps_a_connection_to_every_manager_and_refuses_a_deposed_leader_on_its_own(tmp_path) -> None:
    """Issue 21: one CURVE connection per manager given; registration and heartbeats go to the leader only.

    The deposed leader still holds its connection, so what it sends after losing the lead reaches the
    agent and is answered ``stale_epoch`` there (with one connection at a time, the agent had left it:
    the command could not be delivered, and the old leader never heard why).
    """
    first = EpochManager(tmp_path / "first")
    shutil.copytree(tmp_path / "first", tmp_path / "second")
    second = EpochManager(tmp_path / "second", twin=first)
    first.epoch, second.epoch = OLD, NEW
    agent = agent_proc(tmp_path, f"{first.link.bound_endpoint},{second.link.bound_endpoint}",
                       first.admission.token())
    try:
        assert first.registered.wait(20), agent.output()
        ran = first.command(OLD)
        assert ran.error is None or ran.error.code != "stale_epoch"
        # the first manager loses the lead: it asks the agent to register again, then refuses it
        first.leading = False
        assert first.peer is not None
        first.link.send(first.peer.routing_id, protocol.Reregister())
        assert second.registered.wait(20), agent.output()
        assert "leaving the manager at" in agent.output()
        accepted = second.command(NEW)
        assert accepted.error is None or accepted.error.code != "stale_epoch"
        # the deposed leader's command arrives on its own connection and is refused there
        refused = first.command(OLD)
        assert not refused.ok and refused.error is not None and refused.error.code == "stale_epoch", refused
        # heartbeats go to the leader only
        before = first.heartbeats, second.heartbeats
        wait_for(lambda: second.heartbeats >= before[1] + 2, 10, what="heartbeats to the new leader")
        assert first.heartbeats == before[0], "the agent heartbeats a manager it no longer follows"
    finally:
        agent.stop()
        first.link.stop()
        second.link.stop()


def test_a_reply_from_a_deposed_leader_fails_the_request_at_once(tmp_path) -> None:
    """Not only commands: a grant answered by a deposed leader (a Swarm task's reserve) never reaches the hook."""
    import zmq

    from gpumgr.wire import security
    from gpumgr.wire.link.link import Link, LinkHooks

    keys = security.KeyPair.generate()
    epoch: list[Epoch] = [OLD]

    def answer(peer: Peer, head: protocol.Envelope, message: protocol.Message) -> None:
        server.send(peer.routing_id, protocol.Reply(ok=True, result={"grant": "g1"}), reply_to=head.id)

    server = ManagerLink("tcp://127.0.0.1:0", answer, keys, epoch=lambda: epoch[0])
    server.start()
    fence = Fence(tmp_path)
    fence.admit(NEW)

    def screen(peer: Peer, head: protocol.Envelope, message: protocol.Message) -> Exception | None:
        try:
            fence.admit(None if head.epoch is None else Epoch(*head.epoch))
        except StaleEpoch as exc:
            return exc
        return None

    client = Link(zmq.DEALER, server.bound_endpoint, lambda *_: None, bind=False, hooks=LinkHooks(screen=screen),
                  configure=lambda s: security.connect_curve(s, security.KeyPair.generate(), keys.public))
    client.start()
    try:
        reserve = protocol.Reserve(container_id="c" * 64, gpu_memory=1 << 30)
        refused = client.request_async(b"", reserve, 30).exception(10)  # failed at once, not after 30 s
        assert isinstance(refused, StaleEpoch)
        epoch[0] = NEW
        assert client.request(b"", reserve, 10).result == {"grant": "g1"}
    finally:
        client.stop()
        server.stop()


# --- real managers: an agent given several addresses follows the one that answers -----------------
class Both:
    """Looks like one ManagerProc to AgentProc, but gives the agent several addresses."""

    def __init__(self, endpoints: str, first: ManagerProc) -> None:
        self.endpoint = endpoints
        self.first = first

    def token(self) -> str:
        return self.first.token()

    def node(self, name: str):
        return self.first.node(name)


def test_an_agent_skips_a_dead_address_and_follows_a_killed_managers_twin(tmp_path) -> None:
    first = ManagerProc(tmp_path)
    dead = f"tcp://127.0.0.1:{free_port()}"
    port = free_port()
    agent = AgentProc(tmp_path, Both(f"{dead},{first.endpoint},tcp://127.0.0.1:{port}", first),  # type: ignore[arg-type]
                      "follow-a", runtime="process")
    twin = None
    try:
        # a twin holding the same key pair, secret and bindings, as managers sharing a store do
        api_port = free_port()
        state = tmp_path / f"manager-state-{api_port}"
        shutil.copytree(first.state_dir, state)
        twin = ManagerProc(tmp_path, api_port=api_port, agent_port=port)
        first.stop(signal.SIGKILL)
        ready = wait_for(lambda: (twin.node("follow-a") or {}).get("state") == "ready", 30, interval=0.2,
                         what=f"the agent to register with the surviving manager:\n{agent.output()}")
        assert ready
        assert "leaving the manager at" in agent.output()
    finally:
        agent.stop()
        if twin is not None:
            twin.stop()
        first.stop()


# --- a real agent in this process: the fence is written off the link's thread, and a failed write kills nothing
def test_the_fence_is_written_off_the_links_thread_before_a_command_acts(tmp_path, monkeypatch) -> None:
    from gpumgr.agent import fence as fence_module

    writes: list[tuple[threading.Thread, int]] = []
    original = fence_module.security.write_private

    def recorded(path: Path, data: dict) -> None:
        if path.name == "fence.json":
            writes.append((threading.current_thread(), rig.starts("g-fenced")))
        original(path, data)

    monkeypatch.setattr(fence_module.security, "write_private", recorded)
    manager = ScriptedManager()
    rig = AgentRig(tmp_path, manager)
    try:
        manager.epoch = NEW
        rig.start(manager)
        created = manager.ask(protocol.Create(spec=rig.spec("g-fenced"), op="op-f"))
        assert created.ok, created
        assert writes, "the fence was never written"
        assert all(thread is not rig.owner for thread, _ in writes), "the fence was written on the link's thread"
        assert writes[0][1] == 0, "the command acted before its epoch was on disk"
        assert Fence(rig.state).highest == NEW
    finally:
        rig.stop()
        manager.close()


def test_an_agent_whose_fence_cannot_be_written_refuses_the_new_leader_and_lives_on(tmp_path, caplog) -> None:
    """A full or read-only disk: the write fails, is logged, and the new leader's commands are refused with
    ``fence_unwritable``; the agent keeps its link, heartbeats and runs that leader's commands once it can."""
    manager = ScriptedManager()
    rig = AgentRig(tmp_path, manager)
    (rig.state / "fence.json").mkdir()  # after the agent read its fence: a write there fails
    try:
        manager.epoch = NEW  # the new leader's registration answer carries its epoch
        with caplog.at_level(logging.ERROR, logger="gpumgr.agent.fence"):
            rig.start(manager)
            msg_id, frame = manager.frame(protocol.Create(spec=rig.spec("g-unwritable"), op="op-u"))
            manager.deliver(frame)
            refused = manager.answer(msg_id)
        assert not refused.ok and refused.error is not None and refused.error.code == "fence_unwritable", refused
        assert "fence.json" in refused.error.message
        assert any("cannot write the fence" in r.getMessage() for r in caplog.records)
        assert rig.starts("g-unwritable") == 0 and rig.runtime.managed() == []
        before = manager.heartbeats
        manager.pump(1.0)
        assert manager.heartbeats - before >= 3, "the agent stopped heartbeating"
        assert rig.owner.is_alive() and not rig.agent.link.stopped
        manager.epoch = OLD  # the leader it left is still refused: the mark rose in memory
        stale = manager.ask(protocol.Remove(grant="g-none", op="op-old"))
        assert stale.error is not None and stale.error.code == "stale_epoch"
        manager.epoch = NEW
        (rig.state / "fence.json").rmdir()  # the disk is fixed: the same command, sent again, now runs
        manager.replies.clear()
        manager.deliver(frame)
        ran = manager.answer(msg_id)
        assert ran.ok, ran
        wait_for(lambda: rig.starts("g-unwritable") == 1, 5, what="the command to run")
        assert Fence(rig.state).highest == NEW
        time.sleep(0.2)
        assert rig.owner.is_alive()
    finally:
        rig.stop()
        manager.close()
