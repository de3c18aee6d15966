"""Every wire message round-trips; malformed, unknown and oversized frames raise ProtocolError only."""

from __future__ import annotations

import contextlib

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpumgr.wire import defaults, protocol
from gpumgr.wire.errors import ProtocolError
from gpumgr.wire.policy import Policy
from gpumgr.wire.runspec import RunSpec

REPORT = protocol.ContainerReport(grant="g1", container_id="c" * 64, name="n", image="img", command=["a", "b"],
                                  gpus=["GPU-1"], gpu_memory=1 << 30, state="running", usage={"GPU-1": 5},
                                  labels={"k": "v"}, created_at=1.5)
SPEC = protocol.ContainerSpec(grant="g1", name="n", image="img", command=["sleep", "1"], env={"A": "1"},
                              labels={"k": "v"}, gpus=["GPU-1"], gpu_memory=1 << 30)
EXAMPLES = [
    protocol.Register(node="n1", runtime="docker",
                      gpus=[protocol.GpuInfo(uuid="GPU-1", index=0, name="Sim", memory_total=1 << 34)],
                      containers=[REPORT]),
    protocol.Registered(heartbeat_interval=1.0),
    protocol.Heartbeat(node="n1", gpus=[protocol.GpuSample(uuid="GPU-1", memory_used=3, memory_unmanaged=1)],
                       containers=[protocol.ContainerStatus(grant="g1", container_id="c" * 64, state="running",
                                                            usage={"GPU-1": 5})]),
    protocol.Reregister(),
    protocol.Create(spec=SPEC),
    protocol.Create(spec=SPEC.model_copy(update={"run": RunSpec.model_validate(
        {"volumes": ["/data:/data:ro"], "ports": {"80/tcp": ["127.0.0.1", 8080]}, "shm_size": "1g",
         "ulimits": [{"name": "memlock", "soft": -1}], "entrypoint": ["sh", "-c"]}),
        "policy": Policy(bind_paths={"/data": "ro"})})),
    protocol.Logs(grant="g1", since="1700000000.123456789", skip=2, tail=10),
    protocol.Signal(grant="g1", signal="SIGINT"),
    protocol.Remove(grant="g1", stop_grace=2.0),
    protocol.Resize(grant="g1", gpu_memory=8 << 30),
    protocol.ContainerEvent(node="n1", container=REPORT, detail={"observed": 7}),
    protocol.Reserve(container_id="c" * 64, gpu_memory=1 << 30, name="infer.1.abc", labels={"gpumgr.task": "t"},
                     node="n1"),
    protocol.Join(node="n1", proof="0" * 64),
    protocol.Refused(code="gpu_conflict", message="GPU-1 is held by node n2"),
    protocol.Reply(ok=True, result={"x": 1}),
    protocol.Reply(ok=True, result={"frames": [[1, b"out\n"], [2, b"\xff err"]], "since": "", "skip": 0}),
    protocol.Reply(ok=False, error=protocol.ErrorBody(code="agent_failed", message="no image")),
]


def test_every_message_type_has_an_example() -> None:
    assert {m.TYPE for m in EXAMPLES} == set(protocol.message_types())


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: m.TYPE)
def test_round_trip(message: protocol.Message) -> None:
    envelope, decoded = protocol.decode(protocol.encode(message, reply_to="abc"))
    assert decoded == message
    assert envelope.type == message.TYPE and envelope.reply_to == "abc" and envelope.v == protocol.VERSION


def _frame(**overrides) -> bytes:
    raw = {"v": 1, "type": "registered", "id": "x", "reply_to": None, "body": {"heartbeat_interval": 1.0}}
    raw.update(overrides)
    return msgpack.packb(raw)


@pytest.mark.parametrize("frame, words", [
    (b"\xc1", "undecodable"),
    (b"", "undecodable"),
    (msgpack.packb([1, 2, 3]), "envelope"),
    (_frame(v=2), "version"),
    (_frame(type="launch_missiles"), "unknown message type"),
    (_frame(body={"heartbeat_interval": "soon"}), "heartbeat_interval"),
    (_frame(body={"heartbeat_interval": 1.0, "extra": 1}), "extra"),
    (_frame(id=""), "envelope"),
    (msgpack.packb({"v": 1, "type": "remove", "id": "x", "body": {}}), "grant"),
    (msgpack.packb({1: 2}), "map key"),
    (msgpack.packb({"v": 1, "type": "reply", "id": "x", "body": {"ok": True}}, use_bin_type=True)[:-3], "undecodable"),
], ids=str)
def test_malformed_frames_raise_protocol_error(frame: bytes, words: str) -> None:
    with pytest.raises(ProtocolError, match=words):
        protocol.decode(frame)


def test_oversized_frames_are_refused_both_ways() -> None:
    with pytest.raises(ProtocolError, match="bound"):
        protocol.decode(b"\x00" * (defaults.MAX_MESSAGE_BYTES + 1))
    huge = protocol.Register(node="n", runtime="docker", gpus=[], containers=[REPORT.model_copy(update={"labels": {
        str(i): "x" * 1000 for i in range(defaults.MAX_MESSAGE_BYTES // 1000)}})])
    with pytest.raises(ProtocolError, match="bound"):
        protocol.encode(huge)


def test_field_bounds_inside_a_frame() -> None:
    long_string = msgpack.packb({"v": 1, "type": "reregister", "id": "x" * 70_000, "body": {}})
    with pytest.raises(ProtocolError):
        protocol.decode(long_string)


@given(st.binary(max_size=512))
def test_random_bytes_never_raise_anything_else(data: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        protocol.decode(data)


@given(st.recursive(st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=20),
       st.sampled_from(sorted(protocol.message_types())))
def test_random_bodies_never_raise_anything_else(body, kind: str) -> None:
    with contextlib.suppress(ProtocolError):
        protocol.decode(msgpack.packb({"v": 1, "type": kind, "id": "x", "body": body}))


def test_a_heartbeat_carries_grant_ids_and_figures_never_specs() -> None:
    """However long a container's command or labels, its heartbeat entry stays a few dozen bytes."""
    big = REPORT.model_copy(update={"command": ["x" * 60_000] * 10, "labels": {str(i): "y" * 1000 for i in range(50)}})
    beat = protocol.Heartbeat(node="n", gpus=[], containers=[big] * 100)
    assert len(protocol.encode(beat)) < 100 * 300
    _, decoded = protocol.decode(protocol.encode(beat))
    assert isinstance(decoded, protocol.Heartbeat) and decoded.containers[0].usage == {"GPU-1": 5}


def test_a_figure_msgpack_cannot_carry_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="cannot be encoded"):
        protocol.encode(protocol.Reply(ok=True, result={"used": 2**64}))
