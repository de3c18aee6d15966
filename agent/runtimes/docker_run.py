"""A request's :class:`~gpumgr.wire.runspec.RunSpec` as the Docker SDK's create options, and a container's output.

The node never takes a spec on trust: the policy the manager sent and the node's own are checked
again here, with every host path resolved on this host (``realpath``), and the resolved path is the
one handed to the engine. Output is read from the engine in bounded pieces with a cursor the caller
keeps (the engine's timestamp of the last line, and how many lines at that exact time it has).
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import docker
import docker.errors
from docker.types import LogConfig, Mount, Ulimit

from gpumgr.wire import defaults
from gpumgr.wire.errors import NotFound, RuntimeFailure
from gpumgr.wire.policy import Policy, check, on_node
from gpumgr.wire.protocol import ContainerSpec
from gpumgr.wire.runspec import RunSpec

#: The engine's stream ids in its multiplexed output.
STDOUT, STDERR = 1, 2
#: The engine's frame header: stream id, three zero bytes, the payload's length (big-endian).
FRAME = struct.Struct(">BxxxI")
#: Bytes read from the engine at a time (one read per line costs more than the line).
READ_BLOCK = 64 * 1024


def create_options(spec: ContainerSpec, network_mode: str | None, node_policy: Policy | None) -> dict[str, Any]:
    """The keyword arguments for ``containers.create`` that ``spec.run`` asks for; raises PolicyDenied."""
    run = check(spec.run or RunSpec(), spec.policy, on_node)
    if node_policy is not None:
        run = check(run, node_policy, on_node)
    options: dict[str, Any] = {
        "network_mode": run.network or network_mode,
        "mounts": [Mount(target=m.target, source=m.source, type=m.type, read_only=m.read_only) for m in run.mounts],
        "ports": {key: _binding(value) for key, value in run.ports.items()},
        "ulimits": [Ulimit(name=u.name, soft=u.soft, hard=u.soft if u.hard is None else u.hard) for u in run.ulimits],
        "log_config": LogConfig(type=run.log_config.type, config=run.log_config.config) if run.log_config else None,
        "shm_size": run.shm_size, "ipc_mode": run.ipc_mode, "pid_mode": run.pid_mode,
        "working_dir": run.working_dir, "user": run.user, "entrypoint": run.entrypoint, "nano_cpus": run.nano_cpus,
        "mem_limit": run.mem_limit, "cap_add": run.cap_add, "devices": run.devices, "privileged": run.privileged,
        "auto_remove": run.auto_remove, "stop_signal": run.stop_signal,
    }
    return {k: v for k, v in options.items() if v not in (None, [], {}, False)}


def _binding(value: Any) -> Any:
    """A host binding as docker-py takes it: a port, None, ``(ip, port)``, or ``(ip,)`` for any port on ``ip``."""
    if isinstance(value, list):
        return (value[0], value[1]) if value[1] is not None else (value[0],)
    return value


def read_logs(client: docker.DockerClient, container_id: str, *, since: str = "", skip: int = 0,
              tail: int | None = None, limit: int = defaults.LOGS_CHUNK) -> dict[str, Any]:
    """The next piece of the container's output after the cursor (``since``, ``skip``), at most ``limit`` bytes.

    Returns ``{frames: [[stream, bytes]], since, skip, more}``; ``more`` says a limit cut it short.
    """
    response = open_logs(client, container_id, since=since, tail=tail, follow=False)
    piece = Piece(since, skip, limit)
    try:
        for line in lines(response, since, skip):
            if not piece.take(*line):
                break
    finally:
        response.close()
    return piece.result()


def open_logs(client: docker.DockerClient, container_id: str, *, since: str, tail: int | None,
              follow: bool) -> Any:
    """The engine's multiplexed, timestamped output of the container from ``since`` (or its last ``tail`` lines)."""
    params: dict[str, Any] = {"stdout": 1, "stderr": 1, "timestamps": 1, "follow": int(follow),
                              "tail": "all" if tail is None else str(tail)}
    if since:
        params["since"] = since
    api: Any = client.api  # the SDK's public logs call drops which stream each line came from
    try:
        response = api._get(api._url("/containers/{0}/logs", container_id), params=params, stream=True,
                            timeout=None if follow else api.timeout)
        api._raise_for_status(response)
    except docker.errors.NotFound:
        raise NotFound(f"container {container_id[:12]} is gone from its node") from None
    except docker.errors.APIError as exc:
        raise RuntimeFailure(f"docker could not read the container's output: {exc.explanation}") from exc
    return response


def lines(response: Any, since: str, skip: int) -> Iterator[tuple[int, str, bytes]]:
    """``(stream, cursor, data)`` per line, leaving out the ``skip`` lines at exactly ``since`` already read."""
    seen = 0
    for stream, payload in _frames(response):
        stamp, _, data = payload.partition(b" ")
        key = _cursor(stamp)
        if since and key == since and seen < skip:
            seen += 1
            continue
        yield stream, key, data[:defaults.MAX_FIELD_BYTES]


class Piece:
    """One reply's worth of output, and the cursor after it."""

    def __init__(self, since: str, skip: int, limit: int) -> None:
        self.frames: list[list[Any]] = []
        self.size, self.limit, self.since, self.skip, self.more = 0, limit, since, skip, False

    def fits(self, data: bytes) -> bool:
        """Whether one more line fits (the first always does)."""
        return not self.frames or (self.size + len(data) <= self.limit and len(self.frames) < defaults.LOGS_LINES)

    def take(self, stream: int, key: str, data: bytes) -> bool:
        """Add a line; False (and ``more``) when it does not fit."""
        if not self.fits(data):
            self.more = True
            return False
        _append(self.frames, stream, data)
        self.size += len(data)
        self.since, self.skip = (self.since, self.skip + 1) if key == self.since else (key, 1)
        return True

    def result(self, **extra: Any) -> dict[str, Any]:
        """The reply's result: ``{frames, since, skip, more}`` and ``extra``."""
        frames = [[stream, bytes(data)] for stream, data in self.frames]
        return {"frames": frames, "since": self.since, "skip": self.skip, "more": self.more, **extra}


def _append(frames: list[list[Any]], stream: int, data: bytes) -> None:
    """Add one line, joined to the last frame when it is of the same stream and the join stays in bounds."""
    if frames and frames[-1][0] == stream and len(frames[-1][1]) + len(data) <= defaults.MAX_FIELD_BYTES:
        frames[-1][1] += data
    else:
        frames.append([stream, bytearray(data)])


def _frames(response: Any) -> Iterator[tuple[int, bytes]]:
    """``(stream, payload)`` from the engine's multiplexed answer, read in blocks within its HTTP framing."""
    buffer = bytearray()
    for block in response.iter_content(READ_BLOCK):
        buffer += block
        offset = 0
        while len(buffer) - offset >= FRAME.size:
            stream, length = FRAME.unpack_from(buffer, offset)
            end = offset + FRAME.size + length
            if end > len(buffer):
                break
            yield stream, bytes(buffer[offset + FRAME.size:end])
            offset = end
        del buffer[:offset]


@functools.lru_cache(maxsize=4)
def _seconds(head: str, zone: str) -> int | None:
    try:
        return int(datetime.fromisoformat(head + (zone if zone != "Z" else "+00:00")).timestamp())
    except ValueError:
        return None


def _cursor(stamp: bytes) -> str:
    """The engine's RFC 3339 timestamp (nanoseconds) as the ``seconds.nanoseconds`` its ``since`` takes."""
    text = stamp.decode("ascii", "replace")
    head, _, rest = text.partition(".")
    digits = rest.rstrip("Z").partition("+")[0].partition("-")[0]
    seconds = _seconds(head, rest[len(digits):] or "Z")
    return "" if seconds is None or not digits.isdigit() else f"{seconds}.{digits[:9].ljust(9, '0')}"
