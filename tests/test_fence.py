"""Agents follow the leader among several managers and refuse every command of an older epoch."""

from __future__ import annotations

import shutil
import signal
import threading
from pathlib import Path

import msgpack
import pytest

from gpumgr.agent.fence import Fence, StaleEpoch
from gpumgr.agent.managers import ManagerSet, parse_managers
from gpumgr.manager.admission import Admission
from gpumgr.manager.link import ManagerLink
from gpumgr.wire import envelope, protocol
from gpumgr.wire.epoch import Epoch
from gpumgr.wire.errors import ProtocolError
from gpumgr.wire.link import Peer
from tests.procs import AgentProc, ManagerProc, Proc, free_port, wait_for

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
    again = Fence(tmp_path)
    assert again.highest == NEW
    with pytest.raises(StaleEpoch):
        again.admit(OLD)
    with pytest.raises(StaleEpoch, match="without an epoch"):
        again.admit(None)
    again.admit(NEXT_STORE)  # a rebuilt store: a later generation outranks every revision of the old one
    with pytest.raises(StaleEpoch):
        Fence(tmp_path).admit(NEW)


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
    from gpumgr.wire.link import Link, LinkHooks

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
