"""The chaos proxy of tests/chaos/proxy.py: forwarding, cuts, silent partitions and delays on real loopback sockets,
and the blip it exists for: a ZeroMQ DEALER that reconnects after a cut gets a new routing id at its ROUTER."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from tests.chaos.proxy import ChaosProxy
from tests.procs import ROOT, wait_for

#: how long a test waits for bytes or a close that should come
PATIENCE = 2.0
POLL_MS = int(PATIENCE * 1000)


class EchoServer:
    """A loopback TCP server that echoes every byte back and keeps, in order, every byte it received."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.05)
        self.port: int = self.listener.getsockname()[1]
        self.received = bytearray()
        self.accepted = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted += 1
            thread = threading.Thread(target=self._echo, args=(conn,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _echo(self, conn: socket.socket) -> None:
        conn.settimeout(0.05)
        with conn:
            while not self._stop.is_set():
                try:
                    data = conn.recv(65536)
                except TimeoutError:
                    continue
                except OSError:
                    return
                if not data:
                    return
                self.received += data
                try:
                    conn.sendall(data)
                except OSError:
                    return

    def close(self) -> None:
        """Stop serving and close every connection."""
        self._stop.set()
        for thread in list(self._threads):
            thread.join(PATIENCE)
        self.listener.close()


@pytest.fixture
def echo() -> Iterator[EchoServer]:
    server = EchoServer()
    yield server
    server.close()


@pytest.fixture
def proxy(echo: EchoServer) -> Iterator[ChaosProxy]:
    with ChaosProxy(("127.0.0.1", echo.port)) as chaos:
        yield chaos


def connect(proxy: ChaosProxy) -> socket.socket:
    return socket.create_connection(("127.0.0.1", proxy.port), timeout=PATIENCE)


def receive(sock: socket.socket, size: int) -> bytes:
    """Exactly ``size`` bytes from ``sock``; fails on an early end of stream."""
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        assert chunk, f"end of stream after {len(data)} of {size} bytes"
        data += chunk
    return bytes(data)


def round_trip(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(payload)
    assert receive(sock, len(payload)) == payload


def closed_by_peer(sock: socket.socket, within: float = PATIENCE) -> bool:
    """Whether the other end closed or reset ``sock`` within ``within`` seconds (nothing else may arrive)."""
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def turned_away(proxy: ChaosProxy) -> bool:
    """Whether a connection to ``proxy`` is closed at once (the reset may even beat connect() back)."""
    try:
        with connect(proxy) as sock:
            return closed_by_peer(sock, within=0.3)
    except ConnectionError:
        return True


def test_bytes_round_trip_through_the_proxy_and_are_counted(echo: EchoServer, proxy: ChaosProxy) -> None:
    payload = os.urandom(300_000)
    with connect(proxy) as one, connect(proxy) as two:
        round_trip(one, payload)
        round_trip(two, b"second connection")
        assert proxy.connections == 2
        assert echo.accepted == 2
    assert proxy.address == f"tcp://127.0.0.1:{proxy.port}"
    # the proxy counts a write after it returned, which may be after the client read it
    total = len(payload) + len(b"second connection")
    wait_for(lambda: proxy.bytes_up == proxy.bytes_down == total, PATIENCE, what="the counters")
    wait_for(lambda: proxy.connections == 0, PATIENCE, what="both connections to end")


def test_stop_closes_live_and_delayed_connections_without_hanging(echo: EchoServer) -> None:
    proxy = ChaosProxy(("127.0.0.1", echo.port)).start()
    client = connect(proxy)
    round_trip(client, b"live")
    proxy.delay(5.0)
    client.sendall(b"waiting in the delay queue")
    started = time.monotonic()
    proxy.stop()
    assert time.monotonic() - started < 1.0
    assert closed_by_peer(client)
    client.close()


def test_cut_resets_live_connections_then_refuses_new_ones_for_a_while(echo: EchoServer, proxy: ChaosProxy) -> None:
    with connect(proxy) as client:
        round_trip(client, b"before the cut")
        proxy.cut()
        assert closed_by_peer(client)
    assert proxy.connections == 0
    with connect(proxy) as fresh:
        round_trip(fresh, b"after the cut")
        window_ends = time.monotonic() + 0.5
        proxy.cut(refuse_for=0.5)
        assert closed_by_peer(fresh)
    accepted = echo.accepted
    assert turned_away(proxy), "a connection during the refusal was not closed at once"
    assert echo.accepted == accepted, "a refused connection reached the target"
    time.sleep(max(0.0, window_ends - time.monotonic()) + 0.05)
    with connect(proxy) as after:
        round_trip(after, b"after the window")


def test_swallow_up_is_a_silent_partition_that_heal_ends_with_a_reset(echo: EchoServer, proxy: ChaosProxy) -> None:
    with connect(proxy) as client:
        round_trip(client, b"before")
        proxy.swallow("up")
        client.sendall(b"into the void")
        wait_for(lambda: proxy.swallowed == len(b"into the void"), PATIENCE, what="the bytes to be swallowed")
        assert not closed_by_peer(client, within=0.2), "the partition closed the connection"
        assert bytes(echo.received) == b"before"
        assert proxy.connections == 1
        proxy.heal()
        assert closed_by_peer(client), "heal() kept a connection whose stream lost bytes"
    with connect(proxy) as fresh:
        round_trip(fresh, b"healed")
    assert bytes(echo.received) == b"beforehealed"


def test_swallow_down_lets_up_through_and_heal_can_keep_the_connection(echo: EchoServer, proxy: ChaosProxy) -> None:
    with connect(proxy) as client:
        proxy.swallow("down")
        client.sendall(b"heard")
        wait_for(lambda: bytes(echo.received) == b"heard", PATIENCE, what="the target to receive")
        wait_for(lambda: proxy.swallowed == len(b"heard"), PATIENCE, what="the echo to be swallowed")
        proxy.heal(reset_swallowed=False)
        round_trip(client, b"still open")
    wait_for(lambda: proxy.bytes_down == len(b"still open"), PATIENCE, what="only the later echo to be delivered")


def test_delay_down_holds_each_reply_back_in_order_and_leaves_up_alone(echo: EchoServer, proxy: ChaosProxy) -> None:
    chunks = [bytes([65 + i]) * 1000 for i in range(5)]
    proxy.delay(0.3, "down")
    with connect(proxy) as client:
        started = time.monotonic()
        for chunk in chunks:
            client.sendall(chunk)
            time.sleep(0.01)
        wait_for(lambda: len(echo.received) == 5000, PATIENCE, interval=0.01, what="the target to receive")
        assert time.monotonic() - started < 0.25, "the delay held back the other direction"
        first = receive(client, 1)
        assert time.monotonic() - started >= 0.25
        assert first + receive(client, 4999) == b"".join(chunks)


def test_a_cut_gives_a_reconnecting_dealer_a_new_routing_id() -> None:
    context = zmq.Context()
    try:
        router = context.socket(zmq.ROUTER)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        with ChaosProxy(("127.0.0.1", port)) as proxy:
            dealer = context.socket(zmq.DEALER)
            dealer.setsockopt(zmq.RECONNECT_IVL, 50)
            dealer.connect(proxy.address)
            dealer.send(b"before")
            assert router.poll(POLL_MS), "the first message did not arrive"
            before, body = router.recv_multipart()
            assert body == b"before"
            proxy.cut()
            wait_for(lambda: proxy.connections == 1, PATIENCE, what="the dealer to reconnect")
            dealer.send(b"after")
            assert router.poll(POLL_MS), "no message after the reconnect"
            after, body = router.recv_multipart()
            assert body == b"after"
            assert after != before, "the reconnected dealer kept its routing id"
            router.send_multipart([after, b"reply"])
            assert dealer.poll(POLL_MS)
            assert dealer.recv() == b"reply"
    finally:
        context.destroy(linger=0)


@pytest.mark.parametrize("target", [("10.0.0.1", 80), ("192.168.1.1", 80), ("8.8.8.8", 53), ("::1", 80),
                                    ("example.com", 80), ("127.0.0.1", 0)])
def test_a_target_outside_loopback_is_refused(target: tuple[str, int]) -> None:
    with pytest.raises(ValueError):
        ChaosProxy(target)


def test_a_listen_address_outside_loopback_is_refused() -> None:
    with pytest.raises(ValueError):
        ChaosProxy(("127.0.0.1", 80), listen_host="0.0.0.0")


def test_the_command_line_prints_its_address_and_serves_until_interrupted(echo: EchoServer) -> None:
    command = [sys.executable, "-m", "tests.chaos.proxy", "--target", f"127.0.0.1:{echo.port}"]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        address = process.stdout.readline().strip()
        host, port = address.removeprefix("tcp://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as client:  # a loaded CI: not a speed test
            round_trip(client, b"by hand")
        process.send_signal(signal.SIGINT)
        _, errors = process.communicate(timeout=30)  # it ends cleanly; how fast is not the point (a loaded CI)
        assert process.returncode == 0, errors
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
