"""The agent's link to the manager: one thread owns a ZeroMQ DEALER socket.

It registers with its GPUs and its managed containers, heartbeats every interval with a fresh
memory sample, runs create/remove commands on a small thread pool (so a slow Docker call never
delays a heartbeat), and reports container exits as they happen. ZeroMQ reconnects with capped
backoff on its own; registration is retried with the same backoff until the manager answers, and
repeated whenever the manager says it does not know this node (it restarted).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import zmq

from gpumgr.agent.enforcer import Enforcer, EnforcerSettings
from gpumgr.agent.gpus import GpuSource
from gpumgr.agent.hooklink import HookConnection, HookListener
from gpumgr.agent.meter import Sample, take_sample
from gpumgr.agent.runtime import Managed, Runtime, task_env
from gpumgr.wire import defaults, protocol
from gpumgr.wire.errors import GpumgrError, ProtocolError

log = logging.getLogger(__name__)
WORKERS = 8
DEFAULT_ENFORCEMENT = EnforcerSettings()
#: How long the runtime hook's request may wait for the manager before the hook is told no.
HOOK_TIMEOUT = 20.0
#: A task container that has not started this long after its grant gives the grant back.
TASK_START_TIMEOUT = 120.0


class Agent:
    """Connects ``node``'s GPUs (``source``) and containers (``runtime``) to the manager at ``endpoint``."""

    def __init__(self, node: str, endpoint: str, source: GpuSource, runtime: Runtime, *,
                 heartbeat_interval: float = defaults.HEARTBEAT_INTERVAL,
                 enforcement: EnforcerSettings | None = DEFAULT_ENFORCEMENT, hook_socket: str | None = None) -> None:
        self.node = node
        self.endpoint = endpoint
        self.source = source
        self.devices = source.devices()
        self.runtime = runtime
        self.interval = heartbeat_interval
        self.registered = threading.Event()
        self._ctx = zmq.Context.instance()
        self._outbox: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._wake_addr = f"inproc://gpumgr-agent-{id(self)}"
        self._wake_lock = threading.Lock()
        self._wake: zmq.Socket | None = None
        self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="agent-cmd")
        self._stop = threading.Event()
        self.hook_socket = hook_socket
        self._hook: HookListener | None = None
        self._reserving: dict[str, tuple[HookConnection, str, protocol.Reserve, float]] = {}
        self.enforcer = None if enforcement is None else Enforcer(source, self.devices, runtime, self.report_overrun,
                                                                  enforcement)

    # --- called from any thread --------------------------------------------------------------
    def report_change(self, managed: Managed) -> None:
        """Tell the manager at once that a managed container started or stopped (runtime callback)."""
        event = protocol.ContainerEvent(node=self.node, container=managed.report(), detail=managed.detail)
        self._queue(protocol.encode(event))

    def report_overrun(self, managed: Managed, detail: dict) -> None:
        """Tell the manager at once that a container went over its grant and what was done (enforcer callback)."""
        event = protocol.ContainerEvent(node=self.node, container=managed.report(), detail={"overrun": detail})
        self._queue(protocol.encode(event))

    def stop(self) -> None:
        """Ask the owner thread to finish."""
        self._stop.set()
        if self.enforcer is not None:
            self.enforcer.stop()
        self._poke()

    # --- owner thread ------------------------------------------------------------------------
    def run(self) -> None:
        """Serve until :meth:`stop`; the calling thread becomes the socket's owner."""
        if self.enforcer is not None:
            threading.Thread(target=self.enforcer.run, name="enforcer", daemon=True).start()
        pull = self._ctx.socket(zmq.PULL)
        pull.bind(self._wake_addr)
        dealer = self._connect()
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        poller.register(pull, zmq.POLLIN)
        if self.hook_socket:
            self._hook = self._bind_hook(self.hook_socket)
        watched: set[int] = set()
        backoff, next_register, next_beat = defaults.RECONNECT_MIN, 0.0, 0.0
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if not self.registered.is_set() and now >= next_register:
                    self._send(dealer, protocol.encode(self._register_message()))
                    next_register, backoff = now + backoff, min(backoff * 2, defaults.RECONNECT_MAX)
                if self.registered.is_set() and now >= next_beat:
                    self._send(dealer, protocol.encode(self._heartbeat_message()))
                    next_beat = now + self.interval
                due = next_beat if self.registered.is_set() else next_register
                if self._hook is not None:
                    watched = _watch(poller, watched, set(self._hook.descriptors()))
                events = dict(poller.poll(max(0, int((due - time.monotonic()) * 1000)) + 1))
                if pull in events:
                    while pull.poll(0):
                        pull.recv()
                self._flush(dealer)
                if dealer in events and self._drain(dealer):
                    backoff, next_beat = defaults.RECONNECT_MIN, 0.0
                if self._hook is not None:
                    ready = {fd for fd in events if isinstance(fd, int)}
                    if ready:
                        self._drain_hook(dealer, ready)
                    self._hook.expire()
                    self._expire_reservations()
        finally:
            dealer.close(linger=0)
            pull.close(linger=0)
            if self._hook is not None:
                self._hook.close()
            self._pool.shutdown(wait=False, cancel_futures=True)
            with self._wake_lock:
                if self._wake is not None:
                    self._wake.close(linger=0)
                    self._wake = None

    def _connect(self) -> zmq.Socket:
        dealer = self._ctx.socket(zmq.DEALER)
        for option, value in ((zmq.LINGER, 0), (zmq.IMMEDIATE, 1), (zmq.SNDHWM, 1000),
                              (zmq.RECONNECT_IVL, int(defaults.RECONNECT_MIN * 1000)),
                              (zmq.RECONNECT_IVL_MAX, int(defaults.RECONNECT_MAX * 1000)),
                              (zmq.MAXMSGSIZE, defaults.MAX_MESSAGE_BYTES)):
            dealer.setsockopt(option, value)
        dealer.connect(self.endpoint)
        return dealer

    def _bind_hook(self, path: str) -> HookListener | None:
        """The local socket the OCI runtime hook asks for task grants on (root only); None if it cannot be bound."""
        try:
            hook = HookListener(path, HOOK_TIMEOUT)
        except OSError as exc:
            log.warning("no Swarm task grants on this node: cannot bind the hook socket %s (%s)", path, exc)
            return None
        log.info("runtime hook socket on %s", path)
        return hook

    def _drain_hook(self, dealer: zmq.Socket, ready: set[int]) -> None:
        assert self._hook is not None
        for conn, frame in self._hook.ready(ready):
            try:
                envelope, message = protocol.decode(frame)
            except ProtocolError as exc:
                log.warning("dropped a malformed message from the runtime hook: %s", exc)
                self._hook.drop(conn)
                continue
            self._forward_reserve(dealer, conn, envelope, message)

    def _forward_reserve(self, dealer: zmq.Socket, hook_id: HookConnection, envelope: protocol.Envelope,
                         message: protocol.Message) -> None:
        if not isinstance(message, protocol.Reserve):
            self._answer_hook(hook_id, envelope.id, error=("protocol_error", f"unexpected {envelope.type}"))
        elif not self.registered.is_set():
            self._answer_hook(hook_id, envelope.id, error=("no_agents", "this agent is not registered with a manager"))
        elif not hasattr(self.runtime, "track_task"):
            self._answer_hook(hook_id, envelope.id, error=("invalid_request", "GPU tasks need the Docker runtime"))
        else:
            message.node = self.node
            forward_id = protocol.new_id()
            self._reserving[forward_id] = (hook_id, envelope.id, message, time.monotonic() + HOOK_TIMEOUT)
            self._send(dealer, protocol.encode(message, msg_id=forward_id))

    def _reserved(self, envelope: protocol.Envelope, reply: protocol.Reply) -> None:
        hook_id, hook_msg, request, _ = self._reserving.pop(envelope.reply_to or "", (None, "", None, 0))
        if request is None or hook_id is None:
            return
        if not reply.ok:
            error = reply.error or protocol.ErrorBody(code="error", message="unknown error")
            self._answer_hook(hook_id, hook_msg, error=(error.code, error.message))
            return
        managed = self.runtime.track_task(request.container_id, reply.result, request)
        self._answer_hook(hook_id, hook_msg, result={"grant": managed.grant, "gpus": managed.gpus,
                                                     "env": task_env(managed, self.node, self.runtime.mps)})

    def _expire_reservations(self) -> None:
        now = time.monotonic()
        for forward_id in [k for k, v in self._reserving.items() if v[3] < now]:
            hook_id, hook_msg, _, _ = self._reserving.pop(forward_id)
            self._answer_hook(hook_id, hook_msg, error=("agent_timeout", "the manager did not answer in time"))

    def _answer_hook(self, hook_id: HookConnection, msg_id: str, *, result: dict | None = None,
                     error: tuple[str, str] | None = None) -> None:
        reply = protocol.Reply(ok=error is None, result=result or {},
                               error=protocol.ErrorBody(code=error[0], message=error[1]) if error else None)
        if self._hook is not None:
            self._hook.answer(hook_id, protocol.encode(reply, reply_to=msg_id))

    def _register_message(self) -> protocol.Register:
        gpus = [protocol.GpuInfo(uuid=d.uuid, index=d.index, name=d.name, memory_total=d.memory_total)
                for d in self.devices]
        return protocol.Register(node=self.node, runtime=self.runtime.kind, gpus=gpus,
                                 containers=[m.report() for m in self.runtime.managed()])

    def _heartbeat_message(self) -> protocol.Heartbeat:
        if hasattr(self.runtime, "expire_creating"):
            self.runtime.expire_creating(TASK_START_TIMEOUT)
        sample = self._fresh_sample()
        containers = [m.report(sample.usage.get(m.grant)) for m in self.runtime.managed()]
        return protocol.Heartbeat(node=self.node, gpus=sample.gpus, containers=containers)

    def _fresh_sample(self) -> Sample:
        """The enforcer's newest full sample when it is recent enough, else a new one."""
        enforcer = self.enforcer
        # The enforcer samples every sample_interval (plus the sample's own time and up to one poll);
        # accept that age, so heartbeats do not take a second sample of their own.
        if enforcer is not None and enforcer.latest is not None and \
                time.monotonic() - enforcer.latest_at < self.interval + enforcer.settings.sample_interval:
            return enforcer.latest
        return take_sample(self.source, self.devices, self.runtime)

    def _send(self, dealer: zmq.Socket, frame: bytes) -> None:
        try:
            dealer.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            log.debug("manager not connected; dropped one outgoing message")

    def _flush(self, dealer: zmq.Socket) -> None:
        while True:
            try:
                self._send(dealer, self._outbox.get_nowait())
            except queue.Empty:
                return

    def _drain(self, dealer: zmq.Socket) -> bool:
        """Handle every waiting frame; True when the manager (re)accepted our registration."""
        accepted = False
        while True:
            try:
                frame = dealer.recv(zmq.NOBLOCK)
            except zmq.Again:
                return accepted
            try:
                envelope, message = protocol.decode(frame)
            except ProtocolError as exc:
                log.warning("dropped a malformed message from the manager: %s", exc)
                continue
            accepted = self._handle(envelope, message) or accepted

    def _handle(self, envelope: protocol.Envelope, message: protocol.Message) -> bool:
        if isinstance(message, protocol.Registered):
            self.interval = message.heartbeat_interval
            self.registered.set()
            log.info("registered with the manager at %s", self.endpoint)
            return True
        if isinstance(message, protocol.Reply):
            self._reserved(envelope, message)
        elif isinstance(message, protocol.Reregister):
            log.info("the manager does not know this node (it restarted?): registering again")
            self.registered.clear()
        elif isinstance(message, protocol.Create):
            self._pool.submit(self._answer, envelope.id, self._create, message.spec)
        elif isinstance(message, protocol.Remove):
            self._pool.submit(self._answer, envelope.id, self._remove, message)
        else:
            log.warning("dropped an unexpected %s message from the manager", envelope.type)
        return False

    # --- worker threads ----------------------------------------------------------------------
    def _create(self, spec: protocol.ContainerSpec) -> dict:
        return self.runtime.create(spec).report().model_dump()

    def _remove(self, message: protocol.Remove) -> dict:
        self.runtime.remove(message.grant, message.stop_grace)
        return {"grant": message.grant}

    def _answer(self, request_id: str, work, argument) -> None:
        try:
            reply = protocol.Reply(ok=True, result=work(argument))
        except GpumgrError as exc:
            reply = protocol.Reply(ok=False, error=protocol.ErrorBody(code=exc.code, message=exc.message))
        except Exception as exc:  # report every failure to the manager rather than lose it
            log.exception("command failed")
            reply = protocol.Reply(ok=False, error=protocol.ErrorBody(code="runtime_failed", message=str(exc)))
        self._queue(protocol.encode(reply, reply_to=request_id))

    def _queue(self, frame: bytes) -> None:
        self._outbox.put(frame)
        self._poke()

    def _poke(self) -> None:
        with self._wake_lock:
            if self._wake is None:
                self._wake = self._ctx.socket(zmq.PUSH)
                self._wake.setsockopt(zmq.LINGER, 0)
                self._wake.connect(self._wake_addr)
            with contextlib.suppress(zmq.Again):
                self._wake.send(b"w", zmq.NOBLOCK)


def build_runtime(kind: str, on_change, *, network_mode: str | None, device_requests: str, gpu_kind: str,
                  log_dir: str, mps: bool = False, node: str = "") -> Runtime:
    """The runtime ``kind`` (``auto`` picks Docker when the engine answers, else host processes)."""
    from gpumgr.agent.runtime import DockerRuntime, ProcessRuntime, docker_answers

    if kind == "auto":
        kind = "docker" if docker_answers() else "process"
    if kind == "process":
        return ProcessRuntime(on_change, log_dir=log_dir, mps=mps)
    use_requests = device_requests == "always" or (device_requests == "auto" and gpu_kind == "nvml" and _has_nvidia())
    return DockerRuntime(on_change, node=node, network_mode=network_mode, device_requests=use_requests, mps=mps)


def _has_nvidia() -> bool:
    import docker

    try:
        return "nvidia" in docker.from_env().info().get("Runtimes", {})
    except Exception:  # no engine info means no NVIDIA runtime to use
        return False


def _watch(poller: zmq.Poller, watched: set[int], wanted: set[int]) -> set[int]:
    """Make ``poller`` watch exactly the plain descriptors in ``wanted`` for input; returns ``wanted``."""
    for fd in watched - wanted:
        poller.unregister(fd)
    for fd in wanted - watched:
        poller.register(fd, zmq.POLLIN)
    return wanted
