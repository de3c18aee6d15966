"""The agent link with CURVE against without: round trip, messages/s, and REST placements/s through it.

The product has no plaintext mode, so the baseline is built here: the same ``gpumgr.wire.link.link.Link``
pair (a ROUTER bound on ``tcp://127.0.0.1:0``, a DEALER connected to it, each with a ZeroMQ context of
its own as in two processes) with a ``configure`` that applies no security, against one whose
ROUTER is a CURVE server (``security.serve_curve``, ZAP handler from ``security.start_authenticator``
on its own context) and whose DEALER is a CURVE client (``security.connect_curve``). Both pairs are
open side by side and measured in alternating blocks (ABBA: plain, CURVE, CURVE, plain, ...), so that
the load of a noisy machine falls on both alike; ``--rounds`` times on fresh pairs, ``--blocks``
blocks per arm each:

* round trip: ``--requests`` sequential ``Link.request(Create)`` from the ROUTER, answered by the
  DEALER's handler with a ``Reply`` (a container report) tied by ``reply_to``, as a create is;
* one-way throughput: ``--messages`` heartbeat-sized frames (``Heartbeat`` with ``--gpus`` samples and
  ``--containers`` reports, encoded once) sent from the DEALER with at most ``--window`` in flight and
  counted by the ROUTER's handler after ``protocol.decode`` (so the manager's validation is included);
* for reference, once per round, ``--raw`` ping-pongs of the Create and the heartbeat frame on bare
  sockets with the same security in one thread: what libzmq and CURVE cost without the link loop.

The table shows medians over blocks and CURVE/plain ratios of medians; "per-block ratio" is the
median of CURVE/plain over adjacent blocks, with its range. CPU µs per message is the whole
process's CPU time (all threads, both ends) over the count. ``--placements`` adds REST placements/s
through the real link: an in-process ``Manager``, ``create_app(manager).test_client()`` and a scripted
``tests.fake_agent.FakeAgent`` answering creates (the link is CURVE where ``gpumgr.wire.security``
exists; on an older checkout, without it, the same code measures the plaintext link).

    python bench/link.py [--rounds 3] [--blocks 10] [--requests 400] [--messages 2000] [--placements 500] [--json F]
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import zmq

from bench.harness import GiB, machine, machine_line, median, save, summary, table, wait_for
from gpumgr.wire import protocol
from gpumgr.wire.link.link import Link, Peer

SECURE = importlib.util.find_spec("gpumgr.wire.security") is not None
ARMS = ("plain", "curve")


class Pair:
    """A ROUTER and a DEALER ``Link`` on loopback, with or without CURVE; see the module docstring."""

    def __init__(self, curve: bool) -> None:
        self.contexts: list[zmq.Context[zmq.Socket[bytes]]] = [zmq.Context(), zmq.Context()]
        self.auth: Any = None
        self.count, self.cond = 0, threading.Condition()
        self.peer: Peer | None = None
        self.reply = protocol.Reply(ok=True, result=_report(0).model_dump())
        server: Callable[[zmq.Socket[bytes]], None] = _router_plain
        client: Callable[[zmq.Socket[bytes]], None] = lambda s: None  # noqa: E731
        if curve:
            from gpumgr.wire import security
            keys, mine = security.KeyPair.generate(), security.KeyPair.generate()
            self.auth = security.start_authenticator(self.contexts[0])

            def server(s: zmq.Socket[bytes]) -> None:
                security.serve_curve(s, keys)
                _router_plain(s)

            client = lambda s: security.connect_curve(s, mine, keys.public)  # noqa: E731
        t0 = time.perf_counter()
        self.router = Link(zmq.ROUTER, "tcp://127.0.0.1:0", self._on_router, bind=True, configure=server,
                           context=self.contexts[0], name="bench-router")
        self.router.start()
        self.dealer = Link(zmq.DEALER, self.router.bound_endpoint, self._on_dealer, bind=False, configure=client,
                           context=self.contexts[1], name="bench-dealer")
        self.dealer.start()
        self.dealer.send(b"", protocol.Heartbeat(node="hello", gpus=[]))
        wait_for(lambda: self.peer, 10, 0.0005, "the DEALER's first frame")
        self.setup_s = time.perf_counter() - t0
        assert self.peer is not None
        if curve and len(self.peer.key) != 40:
            raise RuntimeError(f"CURVE arm without a proven key (User-Id {self.peer.key!r})")

    def _on_router(self, peer: Peer, envelope: protocol.Envelope, message: protocol.Message) -> None:
        if self.peer is None:
            self.peer = peer
            return
        with self.cond:
            self.count += 1
            self.cond.notify()

    def _on_dealer(self, peer: Peer, envelope: protocol.Envelope, message: protocol.Message) -> None:
        if isinstance(message, protocol.Create):
            self.dealer.send(b"", self.reply, reply_to=envelope.id)

    def round_trips(self, n: int, create: protocol.Create) -> list[float]:
        """Seconds of each of ``n`` sequential requests from the ROUTER to the DEALER and back."""
        assert self.peer is not None
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            reply = self.router.request(self.peer.routing_id, create, 5.0)
            out.append(time.perf_counter() - t0)
            assert reply.ok
        return out

    def blast(self, n: int, frame: bytes, window: int, batch: int = 16) -> float:
        """Seconds for ``n`` copies of ``frame`` from the DEALER to be handled by the ROUTER (``window`` in flight)."""
        with self.cond:
            self.count = 0
        sent = 0

        def room() -> bool:
            return sent - self.count <= window - batch

        t0 = time.perf_counter()
        while sent < n:
            with self.cond:
                if not self.cond.wait_for(room, 10):
                    raise RuntimeError(f"messages lost: {sent} sent, {self.count} handled")
            for _ in range(min(batch, n - sent)):
                self.dealer.send_frame(b"", frame)
                sent += 1
        with self.cond:
            if not self.cond.wait_for(lambda: self.count >= n, 10):
                raise RuntimeError(f"messages lost: {n} sent, {self.count} handled")
        return time.perf_counter() - t0

    def close(self) -> None:
        self.dealer.stop()
        self.router.stop()
        if self.auth is not None:
            self.auth.stop()
        for ctx in self.contexts:
            ctx.term()


def raw_round_trip(curve: bool, frame: bytes, n: int) -> float:
    """Median µs of ``n`` ping-pongs of ``frame`` on bare sockets in one thread: libzmq (+ CURVE), no link loop."""
    ctxs: list[zmq.Context[zmq.Socket[bytes]]] = [zmq.Context(), zmq.Context()]
    router, dealer = ctxs[0].socket(zmq.ROUTER), ctxs[1].socket(zmq.DEALER)
    auth = None
    if curve:
        from gpumgr.wire import security
        keys, mine = security.KeyPair.generate(), security.KeyPair.generate()
        auth = security.start_authenticator(ctxs[0])
        security.serve_curve(router, keys)
        security.connect_curve(dealer, mine, keys.public)
    try:
        dealer.connect(f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}")
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            dealer.send(frame)
            peer, got = router.recv_multipart()
            router.send_multipart([peer, got])
            dealer.recv()
            times.append(time.perf_counter() - t0)
        return median(times[n // 10:]) * 1e6  # the first tenth includes the handshake
    finally:
        router.close(0)
        dealer.close(0)
        if auth is not None:
            auth.stop()
        for ctx in ctxs:
            ctx.term()


def _router_plain(sock: zmq.Socket[bytes]) -> None:
    """The manager ROUTER's options other than CURVE (manager/link.py), so that both arms differ only by it."""
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.SNDTIMEO, 0)


def _report(i: int) -> protocol.ContainerReport:
    return protocol.ContainerReport(grant=f"{i:016x}", container_id=f"{i:064x}", name=f"job-{i}", image="busybox",
                                    command=["sleep", "36000"], gpus=[f"GPU-bench-{i % 8}"], gpu_memory=2 * GiB,
                                    state="running", usage={f"GPU-bench-{i % 8}": GiB}, labels={"team": "bench"})


def heartbeat(gpus: int, containers: int) -> bytes:
    """One encoded heartbeat as an agent with ``gpus`` GPUs and ``containers`` containers sends it."""
    samples = [protocol.GpuSample(uuid=f"GPU-bench-{i}", memory_used=GiB, memory_unmanaged=0) for i in range(gpus)]
    frame: bytes = protocol.encode(protocol.Heartbeat(node="bench", gpus=samples,
                                                      containers=[_report(i) for i in range(containers)]))
    return frame


def link_arms(args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    """Both arms in alternating blocks (ABBA) on pairs open side by side; per arm the figures of each block."""
    create = protocol.Create(spec=protocol.ContainerSpec(grant="0" * 16, name="bench", image="busybox",
                                                         command=["sleep", "36000"], gpus=["GPU-bench-0"],
                                                         gpu_memory=GiB))
    frame = heartbeat(args.gpus, args.containers)
    print(f"heartbeat frame: {len(frame):,} B ({args.gpus} GPU samples, {args.containers} reports); "
          f"Create frame {len(protocol.encode(create)):,} B")
    arms: list[str] = [a for a in ARMS if a == "plain" or SECURE]
    out: dict[str, dict[str, list[float]]] = {a: {} for a in ARMS}

    def add(arm: str, **figures: float) -> None:
        for key, value in figures.items():
            out[arm].setdefault(key, []).append(value)

    for rnd in range(args.rounds):
        order = arms if rnd % 2 == 0 else arms[::-1]
        pairs = {arm: Pair(arm == "curve") for arm in order}
        try:
            for arm, pair in pairs.items():
                pair.round_trips(args.warmup, create)
                pair.blast(args.warmup, frame, args.window)
                add(arm, setup_ms=pair.setup_s * 1e3)
            for block in range(args.blocks):
                for arm in order if block % 2 == 0 else order[::-1]:
                    c0 = time.process_time()
                    rtt = pairs[arm].round_trips(args.requests, create)
                    c1 = time.process_time()
                    dt = pairs[arm].blast(args.messages, frame, args.window)
                    s = summary(rtt, 1e6)
                    add(arm, rtt_p50_us=s["p50"], rtt_p99_us=s["p99"], rtt_mean_us=s["mean"],
                        rtt_cpu_us=(c1 - c0) / len(rtt) * 1e6, msgs_per_s=args.messages / dt,
                        msg_cpu_us=(time.process_time() - c1) / args.messages * 1e6)
        finally:
            for pair in pairs.values():
                pair.close()
        for arm in order if args.raw else ():
            add(arm, **{f"raw_{size}_us": raw_round_trip(arm == "curve", f, args.raw)
                        for size, f in (("small", protocol.encode(create)), ("heartbeat", frame))})
        print(f"  round {rnd + 1}/{args.rounds}: " + ", ".join(
            f"{arm} rtt p50 {median(out[arm]['rtt_p50_us'][-args.blocks:]):.0f} us "
            f"{median(out[arm]['msgs_per_s'][-args.blocks:]):,.0f} msg/s" for arm in arms), file=sys.stderr)
    return out


def rest_placements(args: argparse.Namespace) -> dict[str, list[float]]:
    """Placements/s of sequential ``POST /v1/containers`` through an in-process manager and a scripted agent."""
    from gpumgr.manager.api.app import create_app
    from gpumgr.manager.config import ManagerSettings
    from gpumgr.manager.service import Manager
    from tests.fake_agent import FakeAgent

    tmp = tempfile.mkdtemp(prefix="gpumgr-bench-link-")
    settings: dict[str, Any] = {"agents": "tcp://127.0.0.1:0", "heartbeat_interval": 60.0}
    manager = Manager(ManagerSettings(**settings, **({"state_dir": tmp} if SECURE else {})))
    manager.start()
    stop = threading.Event()
    token = (manager.admission.token(),) if SECURE else ()  # before the CURVE change FakeAgent took no token
    scripted: Any = FakeAgent
    agent = scripted(manager.link.bound_endpoint, *token, node="bench", gpus=8, size=1 << 50)
    rates: dict[str, list[float]] = {}
    try:
        agent.register()
        thread = agent.serve(stop)
        client = create_app(manager).test_client()
        body = {"gpu_memory": "1GiB", "image": "busybox", "command": ["sleep", "36000"]}
        for rep in range(args.reps + 1):  # the first is a warm-up
            times = []
            t0 = time.perf_counter()
            for _ in range(args.placements):
                t1 = time.perf_counter()
                response = client.post("/v1/containers", json=body)
                times.append(time.perf_counter() - t1)
                if response.status_code != 201:
                    raise RuntimeError(f"POST /v1/containers answered {response.status_code}: {response.json}")
            dt = time.perf_counter() - t0
            if rep:
                rates.setdefault("placements_per_s", []).append(args.placements / dt)
                rates.setdefault("p50_ms", []).append(summary(times, 1e3)["p50"])
                rates.setdefault("p99_ms", []).append(summary(times, 1e3)["p99"])
                print(f"  rest rep {rep}/{args.reps}: {args.placements / dt:,.0f} placements/s", file=sys.stderr)
        stop.set()
        thread.join(2)
    finally:
        stop.set()
        agent.close()
        manager.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return rates


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="fresh pairs of links, each measured in --blocks")
    parser.add_argument("--blocks", type=int, default=10, help="blocks per arm and round, alternating ABBA")
    parser.add_argument("--requests", type=int, default=400, help="timed round trips per block")
    parser.add_argument("--messages", type=int, default=2000, help="heartbeats per block")
    parser.add_argument("--warmup", type=int, default=200, help="untimed round trips and messages first")
    parser.add_argument("--window", type=int, default=256, help="heartbeats in flight at most (< the HWM of 1000)")
    parser.add_argument("--gpus", type=int, default=8, help="GPU samples per heartbeat")
    parser.add_argument("--containers", type=int, default=32, help="container reports per heartbeat")
    parser.add_argument("--raw", type=int, default=2000, help="bare-socket ping-pongs per size and round (0: skip)")
    parser.add_argument("--placements", type=int, default=500, help="REST placements per repetition (0: skip)")
    parser.add_argument("--reps", type=int, default=6, help="REST repetitions, after one for warm-up")
    parser.add_argument("--only", choices=("link", "rest"), help="run only the link arms or only REST")
    parser.add_argument("--target", type=float, default=1.2, help="CURVE/plain ratio goal")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    info = machine(zmq=zmq.zmq_version(), pyzmq=zmq.__version__, curve=SECURE)

    arms = link_arms(args) if args.only != "rest" else {}
    rest = rest_placements(args) if args.only != "link" and args.placements else {}

    ratios: dict[str, float] = {}
    if arms:
        names = {"rtt_p50_us": "round trip p50 (us)", "rtt_p99_us": "round trip p99 (us)",
                 "rtt_mean_us": "round trip mean (us)", "rtt_cpu_us": "CPU per round trip (us)",
                 "msgs_per_s": "heartbeats/s, one way", "msg_cpu_us": "CPU per heartbeat (us)",
                 "setup_ms": "pair start to first frame (ms)", "raw_small_us": "bare zmq ping-pong, Create (us)",
                 "raw_heartbeat_us": "bare zmq ping-pong, heartbeat (us)"}
        names = {k: v for k, v in names.items() if k in arms["plain"]}
        rows = []
        for key, title in names.items():
            plain = median(arms["plain"][key])
            curve = median(arms["curve"].get(key, [float("nan")]))
            ratios[key] = curve / plain
            paired = [c / p for c, p in zip(arms["curve"].get(key, []), arms["plain"][key], strict=False)] or [0.0]
            rows.append([title, plain, curve, ratios[key], median(paired), f"{min(paired):.2f}-{max(paired):.2f}"])
        table([("measurement (median of blocks)", "34"), ("plain", "12,.1f"), ("CURVE", "12,.1f"),
               ("CURVE/plain", "12.3f"), ("per-block ratio", "15.3f"), ("range", "10")], rows, lead="\n")
        slow = {"rtt_p50_us": ratios["rtt_p50_us"], "msgs_per_s": 1 / ratios["msgs_per_s"]}
        print(f"\ngoal CURVE <= {args.target}x plaintext: round trip p50 {slow['rtt_p50_us']:.3f}x, "
              f"throughput {slow['msgs_per_s']:.3f}x (plain/CURVE msg/s) -> "
              f"{'MET' if max(slow.values()) <= args.target else 'MISSED'}")
    if rest:
        table([("REST, " + ("CURVE" if SECURE else "plaintext") + " link (median of reps)", "40"),
               ("placements/s", "13,.0f"), ("p50 ms", "8.2f"), ("p99 ms", "8.2f")],
              [["POST /v1/containers -> 201", median(rest["placements_per_s"]), median(rest["p50_ms"]),
                median(rest["p99_ms"])]], lead="\n")
    print(machine_line(info))
    save(args.json, "link", args, machine=info, arms=arms, ratios=ratios, rest=rest, curve=SECURE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
