"""A scripted agent on a real DEALER socket, for driving the manager's link and API without Docker."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import zmq

from gpumgr.wire import protocol, security

GiB = 1 << 30


class FakeAgent:
    """Registers ``node`` with simulated GPUs, then answers creates as ``behaviour`` says.

    ``behaviour`` is ``"ok"`` (answer with a running report), ``"fail"`` (answer with an error) or
    ``"silent"`` (never answer). Everything it receives is kept in ``received``.
    """

    def __init__(self, endpoint: str, token: str, node: str = "fake", gpus: int = 2, size: int = 24 * GiB,
                 behaviour: str = "ok", keys: security.KeyPair | None = None, gpu_prefix: str | None = None) -> None:
        self.node = node
        self.behaviour = behaviour
        prefix = gpu_prefix or node
        self.gpus = [protocol.GpuInfo(uuid=f"GPU-{prefix}-{i}", index=i, name="Fake", memory_total=size)
                     for i in range(gpus)]
        self.received: list[protocol.Message] = []
        self.reports: dict[str, protocol.ContainerReport] = {}
        server_public, self.join_secret = security.parse_token(token)
        self.keys = keys or security.KeyPair.generate()
        self._server_public, self._endpoint = server_public, endpoint
        self.socket = self._connect()
        self.joined = False
        self._lock = threading.Lock()

    def _connect(self) -> zmq.Socket:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        security.connect_curve(sock, self.keys, self._server_public)
        sock.connect(self._endpoint)
        return sock

    def blip(self) -> None:
        """Replace the connection, as a network blip does: same key, a new routing id at the manager, nothing sent."""
        with self._lock:
            self.socket.close(linger=0)
            self.socket = self._connect()

    def send(self, message: protocol.Message, reply_to: str | None = None) -> None:
        with self._lock:
            self.socket.send(protocol.encode(message, reply_to=reply_to))

    def send_raw(self, frame: bytes | list[bytes]) -> None:
        with self._lock:
            if isinstance(frame, list):
                self.socket.send_multipart(frame)
            else:
                self.socket.send(frame)

    def join(self, secret: str | None = None, node: str | None = None) -> protocol.Reply:
        """Prove the join secret (or ``secret``) for ``node`` (default: ours) and return the manager's answer."""
        proof = security.join_proof(secret or self.join_secret, self.keys.public, node or self.node)
        self.send(protocol.Join(node=node or self.node, proof=proof))
        reply = self.expect(protocol.Reply)
        self.joined = self.joined or reply.ok
        return reply

    def register(self) -> protocol.Registered:
        if not self.joined:
            reply = self.join()
            assert reply.ok, reply.error
        self.send(protocol.Register(node=self.node, runtime="docker", gpus=self.gpus,
                                    containers=list(self.reports.values())))
        return self.expect(protocol.Registered)

    def heartbeat(self, used: int = 0) -> None:
        samples = [protocol.GpuSample(uuid=g.uuid, memory_used=used, memory_unmanaged=used) for g in self.gpus]
        self.send(protocol.Heartbeat(node=self.node, gpus=samples, containers=list(self.reports.values())))

    def expect(self, kind: type, timeout: float = 5.0):
        """Receive until a message of ``kind`` arrives (answering creates on the way)."""
        while True:
            if not self.socket.poll(int(timeout * 1000)):
                raise AssertionError(f"no {kind.__name__} from the manager within {timeout}s")
            envelope, message = protocol.decode(self.socket.recv())
            self.received.append(message)
            self._answer(envelope, message)
            if isinstance(message, kind):
                return message

    def serve(self, stop: threading.Event) -> threading.Thread:
        """Answer in a background thread until ``stop`` is set."""
        def loop() -> None:
            while not stop.is_set():
                with self._lock:  # the socket may be replaced (blip) between two polls
                    frame = self.socket.recv() if self.socket.poll(20) else None
                if frame is not None:
                    envelope, message = protocol.decode(frame)
                    self.received.append(message)
                    self._answer(envelope, message)

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        self.socket.close(linger=0)

    def _answer(self, envelope: protocol.Envelope, message: protocol.Message) -> None:
        if isinstance(message, protocol.Reregister):  # as a real agent does: its whole report again
            self.send(protocol.Register(node=self.node, runtime="docker", gpus=self.gpus,
                                        containers=list(self.reports.values())))
        elif isinstance(message, protocol.Create):
            if self.behaviour == "silent":
                return
            if self.behaviour == "fail":
                error = protocol.ErrorBody(code="runtime_failed", message="image 'nope' is not on this node")
                self.send(protocol.Reply(ok=False, error=error), reply_to=envelope.id)
                return
            spec = message.spec
            report = protocol.ContainerReport(grant=spec.grant, container_id=spec.grant * 4, name=spec.name,
                                              gpus=spec.gpus, gpu_memory=spec.gpu_memory, state="running")
            self.reports[spec.grant] = report
            self.send(protocol.Reply(ok=True, result=report.model_dump()), reply_to=envelope.id)
        elif isinstance(message, protocol.Resize):  # as a real agent does: the new figure, enforced from now on
            report = self.reports.get(message.grant)
            if report is None:
                error = protocol.ErrorBody(code="not_found", message=f"no managed container holds {message.grant}")
                self.send(protocol.Reply(ok=False, error=error), reply_to=envelope.id)
                return
            self.reports[message.grant] = report.model_copy(update={"gpu_memory": message.gpu_memory})
            self.send(protocol.Reply(ok=True), reply_to=envelope.id)
        elif isinstance(message, protocol.Remove):
            self.reports.pop(message.grant, None)
            self.send(protocol.Reply(ok=True, result={"grant": message.grant}), reply_to=envelope.id)
        elif isinstance(message, protocol.Logs | protocol.Signal):
            # a container that printed one line (and would take any signal) while its grant lives
            if message.grant not in self.reports:
                error = protocol.ErrorBody(code="not_found", message=f"no managed container holds {message.grant}")
                self.send(protocol.Reply(ok=False, error=error), reply_to=envelope.id)
                return
            done = isinstance(message, protocol.Signal) or message.since
            result = {"grant": message.grant} if isinstance(message, protocol.Signal) else {
                "frames": [] if done else [[1, b"hello\n"]], "since": "1.000000000", "skip": 1, "more": False}
            self.send(protocol.Reply(ok=True, result=result), reply_to=envelope.id)


@contextmanager
def scripted_stack(tmp: Path, **settings: Any) -> Iterator[tuple[Any, Any, Callable[..., FakeAgent]]]:
    """An in-process manager on a real link (``settings`` over its defaults), its REST test client, and a
    function that adds a registered scripted agent serving in the background; all stopped on exit."""
    from gpumgr.manager.api.app import create_app
    from gpumgr.manager.config import ManagerSettings
    from gpumgr.manager.service import Manager

    manager = Manager(ManagerSettings(agents="tcp://127.0.0.1:0", state_dir=str(tmp / "state"), **settings))
    manager.start()
    stop = threading.Event()
    agents: list[FakeAgent] = []
    threads: list[threading.Thread] = []

    def add_agent(node: str = "fake", **kw: Any) -> FakeAgent:
        agent = FakeAgent(manager.link.bound_endpoint, manager.admission.token(), node=node, **kw)
        agent.register()
        threads.append(agent.serve(stop))
        agents.append(agent)
        return agent

    try:
        yield manager, create_app(manager).test_client(), add_agent
    finally:
        stop.set()
        for thread in threads:
            thread.join(2)
        for agent in agents:
            agent.close()
        manager.stop()
