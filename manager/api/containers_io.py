"""A running container's output, its end and its signals: ``/v1/containers/{id}/logs``, ``/wait`` and ``/kill``.

The output stays on the container's node: the manager asks its agent for one bounded piece at a
time over the link, keeping the cursor itself, and streams the pieces to the client as they come
(``follow``: until the container has ended and its last lines are out). Without ``Accept:
application/vnd.docker.multiplexed-stream`` the answer is the plain text of stdout and stderr
together; with it, Docker's own framing (an 8-byte header per piece naming its stream), so a client
can part the two exactly as ``docker logs`` does.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Iterator
from typing import Any

from flask import Blueprint, Response, jsonify, request, stream_with_context

from gpumgr.manager.api.routes import lookup, manager
from gpumgr.manager.model.records import Container
from gpumgr.wire import defaults, protocol
from gpumgr.wire.errors import (
    AgentFailed,
    AgentTimeout,
    Conflict,
    GpumgrError,
    InvalidRequest,
    NoAgents,
    NotFound,
    OutcomeUnknown,
)
from gpumgr.wire.names import LIVE, State
from gpumgr.wire.runspec import SIGNAL

bp = Blueprint("v1io", __name__, url_prefix="/v1")

MULTIPLEXED = "application/vnd.docker.multiplexed-stream"
#: Docker's frame header: stream id, three zero bytes, the payload's length (big-endian).
FRAME = struct.Struct(">BxxxI")
#: A followed stream whose node never says it ended stops once its record ended and it was quiet this long.
FOLLOW_GRACE = 5.0
#: How often a waiting request looks at the record (in memory) to see whether the container ended.
END_POLL = 0.05
#: The agent's error codes that are the caller's to fix, as REST errors.
AGENT_ERRORS: dict[str, type[GpumgrError]] = {"not_found": NotFound, "invalid_request": InvalidRequest,
                                              "conflict": Conflict}


@bp.get("/containers/<cid>/logs")
def container_logs(cid: str) -> Response:
    """The container's output; ``tail=N`` starts N lines from its end, ``follow`` streams until it ends."""
    record = _started(lookup(cid))
    follow = _flag("follow")
    tail = _tail()
    multiplexed = MULTIPLEXED in request.headers.get("Accept", "")
    cursor = {"session": protocol.new_id()} if follow else {}
    # errors before the stream starts are answered as JSON
    first = _piece(record, {**cursor, "tail": -1 if tail is None else tail})
    body = stream_with_context(_stream(record, first, cursor, multiplexed))
    response = Response(body, mimetype=MULTIPLEXED if multiplexed else "text/plain")
    response.headers["X-Content-Type-Options"] = "nosniff"
    return response


@bp.post("/containers/<cid>/wait")
def container_wait(cid: str) -> Response:
    """Wait until the container ends (at most ``timeout`` seconds): ``{id, state, exit_code, reason, ended}``."""
    record = lookup(cid)
    limit = _number("timeout", defaults.WAIT_MAX)
    deadline = time.monotonic() + limit
    cluster = manager().cluster
    while _live(record) and time.monotonic() < deadline:
        time.sleep(min(END_POLL, max(0.0, deadline - time.monotonic())))
        record = cluster.get(record.id)
    return jsonify({"id": record.id, "state": record.state, "exit_code": record.exit_code, "reason": record.reason,
                    "ended": not _live(record)})


@bp.post("/containers/<cid>/kill")
def container_kill(cid: str) -> Response:
    """Send ``signal`` (default SIGKILL; a name such as SIGINT or a number) to a running container."""
    record = lookup(cid)
    signal = request.args.get("signal", "SIGKILL")
    if not SIGNAL.fullmatch(signal):
        raise InvalidRequest(f"signal must be a name such as SIGINT or a number, not {signal[:32]!r}")
    if record.state is not State.RUNNING:
        raise Conflict(f"container {record.id} is {record.state}, not running")
    _ask(record, protocol.Signal(grant=record.id, signal=signal))
    return jsonify({"id": record.id, "signal": signal})


def _stream(record: Container, piece: dict[str, Any], cursor: dict[str, Any], multiplexed: bool) -> Iterator[bytes]:
    """Pieces of output until there is no more.

    Followed (a ``session``), until its node says the engine's follow stream ended, or the record has
    ended and no output came for ``FOLLOW_GRACE`` seconds; then whatever is left after the cursor is
    read with plain reads, as an engine's follow stream can end before the last lines of a container
    that stopped.
    """
    follow, ended, heard = bool(cursor.get("session")), False, time.monotonic()
    while True:
        for stream, data in piece["frames"]:
            yield FRAME.pack(stream, len(data)) + data if multiplexed else data
        if piece["frames"]:
            heard = time.monotonic()
        if not piece["more"]:
            if not follow:
                return
            if piece.get("ended") or (ended and time.monotonic() - heard > FOLLOW_GRACE):
                follow, cursor = False, {}
            elif ended:  # its last lines are on their way: look again soon
                time.sleep(END_POLL)
            else:
                ended = _ended_within(record.id, defaults.LOGS_POLL)
        try:
            piece = _piece(record, {**cursor, "since": piece["since"], "skip": piece["skip"]})
        except GpumgrError:  # the node went away mid-stream: the answer can only end
            return


def _ended_within(cid: str, seconds: float) -> bool:
    """Whether ``cid`` ends within ``seconds`` (its record is read, not its node: a cheap look every END_POLL)."""
    deadline = time.monotonic() + seconds
    while True:
        if not _live(manager().cluster.get(cid)):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(END_POLL)


def _piece(record: Container, cursor: dict[str, Any]) -> dict[str, Any]:
    result = _ask(record, protocol.Logs(grant=record.id, **cursor))
    frames = result.get("frames")
    if not isinstance(frames, list):
        raise AgentFailed(f"node {record.node} answered a logs request without output")
    return {"frames": [(int(s), bytes(d)) for s, d in frames], "since": str(result.get("since") or ""),
            "skip": int(result.get("skip") or 0), "more": bool(result.get("more")), "ended": bool(result.get("ended"))}


def _ask(record: Container, message: protocol.Message) -> dict[str, Any]:
    """Send ``message`` to ``record``'s node and return its result; the node's refusal as a REST error."""
    cluster = manager().cluster
    if not cluster.node_ready(record.node):
        raise NoAgents(f"node {record.node} is down; try again when it is back")
    try:
        reply = manager().link.request(cluster.routing_id(record.node), message, manager().settings.remove_timeout)
    except AgentTimeout as exc:  # a signal may have been delivered: nobody knows (a logs read changed nothing)
        if isinstance(message, protocol.Logs):
            raise
        raise OutcomeUnknown(f"node {record.node} did not answer in time: the signal may have been delivered") \
            from exc
    if not reply.ok:
        error = reply.error or protocol.ErrorBody(code="agent_failed", message="no reason given")
        raise AGENT_ERRORS.get(error.code, AgentFailed)(f"node {record.node}: {error.message}")
    return reply.result


def _started(record: Container) -> Container:
    if record.state is State.QUEUED or record.container_id is None:
        raise Conflict(f"container {record.id} is {record.state} and has no output yet")
    return record


def _live(record: Container) -> bool:
    return record.state in LIVE or record.state is State.QUEUED


def _flag(name: str) -> bool:
    value = request.args.get(name, "0").lower()
    if value not in ("0", "1", "true", "false", ""):
        raise InvalidRequest(f"{name} must be true or false, not {value[:16]!r}")
    return value in ("1", "true")


def _tail() -> int | None:
    value = request.args.get("tail", "all")
    if value == "all":
        return None
    if not (value.isascii() and value.isdigit()) or int(value) > defaults.MAX_ITEMS:
        raise InvalidRequest(f"tail must be 'all' or a number of lines up to {defaults.MAX_ITEMS}, not {value[:16]!r}")
    return int(value)


def _number(name: str, most: float) -> float:
    value = request.args.get(name)
    if value is None:
        return most
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not 0 <= number <= most:
        raise InvalidRequest(f"{name} must be a number of seconds from 0 to {most:g}, not {value[:16]!r}")
    return number
