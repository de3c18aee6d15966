"""The link's thread only moves frames: handlers and callbacks run on lanes, and frames that cannot leave wait.

Real ROUTER and DEALER sockets under CURVE (the manager's own :class:`ManagerLink`). Each test here
failed before the link's owner thread stopped running handlers, future callbacks and failed sends'
follow-ups itself (issue "Network faults").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import zmq

from gpumgr.manager.link.link import ManagerLink
from gpumgr.wire import defaults, protocol, security
from gpumgr.wire.errors import NoAgents
from gpumgr.wire.link.lanes import Lanes
from gpumgr.wire.link.link import Peer
from tests.procs import wait_for


class Peers:
    """Scripted agents on real DEALER sockets, each with its own CURVE key."""

    def __init__(self, endpoint: str, server: security.KeyPair) -> None:
        self.endpoint, self.server = endpoint, server
        self.context = zmq.Context()

    def dealer(self, keys: security.KeyPair, **options: int) -> zmq.Socket[bytes]:
        sock = self.context.socket(zmq.DEALER)
        for option, value in options.items():
            sock.setsockopt(getattr(zmq, option), value)
        security.connect_curve(sock, keys, self.server.public)
        sock.connect(self.endpoint)
        return sock

    def close(self) -> None:
        self.context.destroy(linger=0)


@contextmanager
def router(handler, lanes: Lanes | None = None, **kw) -> Iterator[tuple[ManagerLink, Peers]]:
    server = security.KeyPair.generate()
    link = ManagerLink("tcp://127.0.0.1:0", handler, server, lanes=lanes, tick=0.05, **kw)
    link.start()
    peers = Peers(link.bound_endpoint, server)
    try:
        yield link, peers
    finally:
        peers.close()
        link.stop()


def hello(sock: zmq.Socket[bytes], node: str = "n") -> None:
    sock.send(protocol.encode(protocol.Heartbeat(node=node, gpus=[])))


def test_handlers_and_reply_callbacks_never_run_on_the_link_thread() -> None:
    """Before: both ran on the owner thread, so a callback that sent again re-entered its own flush."""
    threads: list[str] = []
    heard: list[Peer] = []

    def handler(peer, envelope, message) -> None:
        threads.append(threading.current_thread().name)
        heard.append(peer)

    with router(handler) as (link, peers):
        keys = security.KeyPair.generate()
        sock = peers.dealer(keys)
        hello(sock)
        wait_for(lambda: heard, 10, what="the first frame")
        future = link.request_async(heard[0].routing_id, protocol.Remove(grant="g"), 10, key=keys.public)
        called: list[str] = []
        future.add_done_callback(lambda _: called.append(threading.current_thread().name))
        assert sock.poll(10_000)
        envelope, _ = protocol.decode(sock.recv())
        sock.send(protocol.encode(protocol.Reply(ok=True), reply_to=envelope.id))
        assert future.result(10).ok
        wait_for(lambda: called, 5, what="the callback")
    assert threads and "agent-link" not in threads
    assert called and called[0] != "agent-link"


def test_a_node_whose_handling_blocks_never_holds_up_another_node() -> None:
    """A slow store read for one node (a Join against a slow etcd) once stalled every node's frames."""
    release = threading.Event()
    handled: list[str] = []

    def handler(peer, envelope, message) -> None:
        if message.node == "slow":
            release.wait(10)
        handled.append(message.node)

    lanes = Lanes(2, name="test-lane")
    with router(handler, lanes=lanes) as (_, peers):
        slow = peers.dealer(security.KeyPair.generate())
        hello(slow, "slow")
        time.sleep(0.2)
        quick = peers.dealer(security.KeyPair.generate())
        for _ in range(3):
            hello(quick, "quick")
        try:
            wait_for(lambda: handled.count("quick") == 3, 2, what="the quick node's frames, while the slow one blocks")
        finally:
            release.set()
        wait_for(lambda: "slow" in handled, 5, what="the slow node's frame")
    lanes.stop()


def test_a_command_for_a_reconnected_node_waits_for_its_next_frame_and_leaves_once() -> None:
    """Before: the send to the old routing id failed on the link thread (503), and a retry spun there."""
    heard: list[Peer] = []
    with router(lambda peer, envelope, message: heard.append(peer)) as (link, peers):
        keys = security.KeyPair.generate()
        first = peers.dealer(keys)
        hello(first)
        wait_for(lambda: heard, 10, what="the first connection")
        first.close(linger=0)  # a blip: the old routing id is gone
        time.sleep(0.2)
        future = link.request_async(heard[0].routing_id, protocol.Remove(grant="g"), 10, key=keys.public)
        time.sleep(0.3)
        assert not future.done()  # it waits: no 503, no retry
        second = peers.dealer(keys)
        hello(second)  # any frame of the key shows its new connection
        assert second.poll(5_000), "the waiting command never left on the new connection"
        envelope, message = protocol.decode(second.recv())
        assert isinstance(message, protocol.Remove) and message.grant == "g"
        assert not second.poll(300)  # once
        second.send(protocol.encode(protocol.Reply(ok=True), reply_to=envelope.id))
        assert future.result(5).ok
        assert link.take_lag() < 1.0


def test_a_command_for_a_node_that_never_speaks_again_fails_as_not_delivered_at_its_deadline() -> None:
    heard: list[Peer] = []
    with router(lambda peer, envelope, message: heard.append(peer)) as (link, peers):
        keys = security.KeyPair.generate()
        sock = peers.dealer(keys)
        hello(sock)
        wait_for(lambda: heard, 10, what="the first connection")
        sock.close(linger=0)
        time.sleep(0.2)
        started = time.monotonic()
        future = link.request_async(heard[0].routing_id, protocol.Remove(grant="g"), 0.5, key=keys.public)
        error = future.exception(5)
        assert isinstance(error, NoAgents) and "not delivered" in error.message
        assert 0.4 < time.monotonic() - started < 3


def test_a_full_pipe_parks_frames_instead_of_failing_them_and_the_loop_keeps_polling() -> None:
    """A peer that reads nothing fills its pipe (EAGAIN); once every such frame failed and was sent again at once."""
    heard: list[Peer] = []
    with router(lambda peer, envelope, message: heard.append(peer)) as (link, peers):
        keys = security.KeyPair.generate()
        sock = peers.dealer(keys, RCVHWM=1, RCVBUF=4096)
        hello(sock)
        wait_for(lambda: heard, 10, what="the first connection")
        futures = [link.request_async(heard[0].routing_id, protocol.Remove(grant=f"g{i}" + "x" * 2000), 30,
                                      key=keys.public) for i in range(3000)]
        time.sleep(1.0)
        failed = [f.exception() for f in futures if f.done()]
        # only what is beyond the bound of frames kept for one node gives way, and says so
        assert all(isinstance(e, NoAgents) and "too many" in e.message for e in failed), failed[:1]
        assert len(link._parking) == defaults.LINK_PARKED_MAX
        assert link.take_lag() < 1.0  # the loop kept polling
        other = peers.dealer(security.KeyPair.generate())
        hello(other, "other")
        wait_for(lambda: len(heard) > 1, 2, what="another node's frame while the first one's pipe is full")
        received = 0
        deadline = time.monotonic() + 20
        while len(link._parking) and time.monotonic() < deadline:  # the node reads again and speaks: they leave
            while sock.poll(0):
                sock.recv()
                received += 1
            hello(sock)
            time.sleep(0.05)
        assert len(link._parking) == 0 and received > 0


@pytest.mark.parametrize("count", [3])
def test_a_flood_from_one_key_is_bounded_and_never_drops_another_key(count: int) -> None:
    release = threading.Event()
    handled: list[str] = []

    def handler(peer, envelope, message) -> None:
        release.wait(10)
        handled.append(message.node)

    lanes = Lanes(2, name="flood", per_key=count)
    with router(handler, lanes=lanes) as (_, peers):
        flood = peers.dealer(security.KeyPair.generate())
        for _ in range(20):
            hello(flood, "flood")
        wait_for(lambda: lanes.dropped >= 20 - count, 5, what="the flood beyond the bound dropped")
        calm = peers.dealer(security.KeyPair.generate())
        hello(calm, "calm")
        release.set()
        wait_for(lambda: "calm" in handled, 5, what="the calm node's frame")
        assert handled.count("flood") == count
    lanes.stop()


def test_a_request_the_old_connection_took_unanswered_is_sent_once_more_on_the_new_one() -> None:
    """It may have died in the old pipe (the ROUTER had not seen the disconnect yet): the command's
    deadline ran out with its node never having it. The agent applies one delivered twice once."""
    heard: list[Peer] = []
    with router(lambda peer, envelope, message: heard.append(peer)) as (link, peers):
        keys = security.KeyPair.generate()
        first = peers.dealer(keys)
        hello(first)
        wait_for(lambda: heard, 10, what="the first connection")
        future = link.request_async(heard[0].routing_id, protocol.Remove(grant="g", op="o.1"), 10, key=keys.public)
        assert first.poll(5_000)
        sent, _ = protocol.decode(first.recv())
        first.close(linger=0)  # gone before it answered
        second = peers.dealer(keys)
        hello(second)
        assert second.poll(5_000), "the unanswered request was not sent on the new connection"
        again, message = protocol.decode(second.recv())
        assert again.id == sent.id and isinstance(message, protocol.Remove) and message.op == "o.1"
        hello(second)
        assert not second.poll(300)  # once per reconnect, not at every frame
        second.send(protocol.encode(protocol.Reply(ok=True), reply_to=again.id))
        assert future.result(5).ok
