"""What the guard adds to a ``docker run``, and how many decisions a second it makes.

Part 1, ``docker run``: two private engines started the same way (own data and exec roots, no bridge,
no iptables, the test image imported), one with ``--authorization-plugin`` naming a ``gpumgr guard``
child process, one without. ``--pairs`` interleaved trials, the order swapped every other pair:

  guarded:  docker run --rm --network none IMAGE true   (against the guarded engine)
  plain:    the same command against the plain engine

The whole CLI command is timed, as a user waits for it (about ten API calls, each sent to the guard
twice: request and response).

Part 2, decisions per second: create bodies recorded as docker-py builds them for a mix of requests
(plain, with binds and env, with labels, GPU requests the guard denies), judged by ``Guard.request``
in this process for ``--seconds``; and the same mix sent one after another over the guard's socket
(HTTP, as the engine sends it), timing each round trip.

    python bench/guard.py [--pairs 30] [--seconds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import docker

from bench.harness import IMAGE, machine, machine_line, median, save, summary, table
from gpumgr.agent.guard.guard import Guard, GuardState
from gpumgr.plugin.install.guard_install import UnixConnection
from gpumgr.wire.engine import gpudev
from tests.guard_dockerd import GuardEngine
from tests.guardproc import GuardProc
from tests.images import busybox_tar

RUN = ("run", "--rm", "--network", "none", IMAGE, "true")


def docker_runs(pairs: int) -> dict[str, list[float]]:
    """Interleaved ``docker run`` wall times on the guarded and the plain engine."""
    guard = GuardProc(Path(tempfile.mkdtemp(prefix="gpumgr-bench-guard-")))
    engines = {"guarded": GuardEngine(busybox_tar(), guard.name), "plain": GuardEngine(busybox_tar(), None)}
    times: dict[str, list[float]] = {name: [] for name in engines}
    try:
        for engine in engines.values():  # warm up: the image's first run, the CLI's config
            engine.docker(*RUN)
        for pair in range(pairs):
            order = list(engines) if pair % 2 == 0 else list(reversed(engines))
            for name in order:
                t0 = time.perf_counter()
                engines[name].docker(*RUN)
                times[name].append(time.perf_counter() - t0)
    finally:
        for engine in engines.values():
            engine.stop()
        guard.remove()
    return times


def recorded_bodies() -> list[bytes]:
    """Create bodies as docker-py builds them: what a guard judges most (plain) and what it denies."""
    api = docker.APIClient(base_url="unix:///nonexistent", version="1.41")
    host = api.create_host_config
    made = [
        api.create_container_config(IMAGE, ["true"], host_config=host(network_mode="none")),
        api.create_container_config(IMAGE, ["sh", "-c", "train"], environment={f"K{i}": "v" * 20 for i in range(20)},
                                    labels={f"team.label{i}": "x" for i in range(10)},
                                    host_config=host(binds=["/tmp:/data:ro", "cache:/cache"], network_mode="none")),
        api.create_container_config(IMAGE, ["true"], environment={"GPUMGR_REQUEST_MEMORY": "4GiB"},
                                    host_config=host(network_mode="none")),
        api.create_container_config(IMAGE, ["true"], host_config=host(device_requests=[
            docker.types.DeviceRequest(count=-1, capabilities=[["gpu"]])])),
        api.create_container_config(IMAGE, ["true"], host_config=host(privileged=True)),
        api.create_container_config(IMAGE, ["true"], environment={"NVIDIA_VISIBLE_DEVICES": "all"},
                                    host_config=host(binds=["/dev:/dev"])),
    ]
    return [json.dumps(body).encode() for body in made]


def plugin_requests() -> list[dict[str, Any]]:
    return [{"RequestMethod": "POST", "RequestUri": "/v1.41/containers/create",
             "RequestHeaders": {"Content-Type": "application/json"},
             "RequestBody": base64.b64encode(body).decode()} for body in recorded_bodies()]


def decisions_per_second(seconds: float) -> dict[str, float]:
    """``Guard.request`` on the recorded mix, in this process."""
    logging.getLogger("gpumgr").addHandler(logging.NullHandler())
    logging.getLogger("gpumgr").propagate = False  # each denial is logged, as in the guard, but not printed here
    guard = Guard(gpudev.Policy(majors=gpudev.gpu_majors(), default=gpudev.DefaultRuntime(frozenset({"runc"}), None)),
                  GuardState())
    requests = plugin_requests()
    denied = sum(not guard.request(r).allow for r in requests)
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for request in requests:
            guard.request(request)
        count += len(requests)
    return {"per_second": count / (time.perf_counter() - t0), "mix": len(requests), "denied_in_mix": denied}


def socket_round_trips(seconds: float) -> list[float]:
    """The same mix over a ``gpumgr guard`` process's socket, one keep-alive connection, as the engine sends it."""
    guard = GuardProc(Path(tempfile.mkdtemp(prefix="gpumgr-bench-guard-")))
    bodies = [json.dumps(r).encode() for r in plugin_requests()]
    times: list[float] = []
    try:
        connection = UnixConnection(str(guard.socket))
        t_end = time.perf_counter() + seconds
        while time.perf_counter() < t_end:
            for body in bodies:
                t0 = time.perf_counter()
                connection.request("POST", "/AuthZPlugin.AuthZReq", body=body,
                                   headers={"Content-Type": "application/json"})
                connection.getresponse().read()
                times.append(time.perf_counter() - t0)
        connection.close()
    finally:
        guard.remove()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=30)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--json")
    args = parser.parse_args()
    info = machine()
    runs = docker_runs(args.pairs)
    plain = median(runs["plain"])
    table([("docker run --rm ... true", "26"), ("median ms", "10,.1f"), ("p90 ms", "8,.1f"), ("ratio", "7.3f")],
          [(name, median(v) * 1000, summary(v)["p90"] * 1000, median(v) / plain) for name, v in runs.items()],
          note=f"   {args.pairs} interleaved pairs")
    rate = decisions_per_second(args.seconds)
    trips = socket_round_trips(args.seconds)
    print(f"decisions in process: {rate['per_second']:,.0f}/s over a mix of {rate['mix']} bodies "
          f"({rate['denied_in_mix']} denied)")
    print(f"over the socket: median {median(trips) * 1e6:,.0f} µs, p99 {summary(trips)['p99'] * 1e6:,.0f} µs "
          f"per AuthZReq ({len(trips)} calls)")
    print(machine_line(info))
    save(args.json, "guard", args, machine=info, runs={k: summary(v, 1000) for k, v in runs.items()},
         decisions=rate, socket_us=summary(trips, 1e6))


if __name__ == "__main__":
    main()
