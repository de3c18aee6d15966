"""Requests the agent could not take are a 400 at once: the API applies the wire's bounds (issue "Grant integrity" 2).

The scripted agent never answers a create here, so anything the API wrongly lets through to it shows
up as a 502 outcome_unknown after ``create_timeout`` (or a 500), never as the fast 400 these tests expect.
"""

from __future__ import annotations

import contextlib
import resource
import socket
import threading
import time

import pytest
import requests

from gpumgr.manager.api.app import create_app
from gpumgr.manager.config import ManagerSettings
from gpumgr.manager.service import Manager
from gpumgr.wire import defaults, protocol
from gpumgr.wire.units import parse_bytes
from tests.fake_agent import FakeAgent
from tests.procs import ManagerProc

KiB = 1024
FIELD = defaults.MAX_FIELD_BYTES
MAX_BYTES = 2**63 - 1  # int64: the largest size the API takes
#: The loose bound on answering: far below the create timeout, far above any real validation cost.
FAST = 1.0


@pytest.fixture
def stack(tmp_path):
    manager = Manager(ManagerSettings(agents="tcp://127.0.0.1:0", state_dir=str(tmp_path / "s"), create_timeout=3.0))
    manager.start()
    app = create_app(manager, {"MAX_CONTENT_LENGTH": 16 * 1024 * 1024})  # lets the message-size bound be reached
    agent = FakeAgent(manager.link.bound_endpoint, manager.admission.token(), node="fake", behaviour="silent")
    agent.register()
    stop = threading.Event()
    thread = agent.serve(stop)
    yield manager, app.test_client(), agent
    stop.set()
    thread.join(2)
    agent.close()
    manager.stop()


def refused(stack, *, json=None, data=None, words: str = "") -> dict:
    """POST it; assert a fast JSON 400 naming ``words``, and that nothing was placed, reserved or sent."""
    manager, client, agent = stack
    start = time.monotonic()
    if data is not None:
        response = client.post("/v1/containers", data=data, content_type="application/json")
    else:
        response = client.post("/v1/containers", json=json)
    elapsed = time.monotonic() - start
    assert response.status_code == 400, (response.status_code, response.get_data(as_text=True)[:500])
    assert response.is_json and response.json["error"]["code"] == "invalid_request"
    assert elapsed < FAST, f"answered after {elapsed:.2f}s"
    message = response.json["error"]["message"]
    assert words in message, message
    assert len(response.get_data()) < 4096, "the error echoes the request"
    assert manager.cluster.containers() == []
    assert all(g["memory_reserved"] == 0 for n in manager.cluster.nodes_view() for g in n["gpus"])
    assert not any(isinstance(m, protocol.Create) for m in agent.received)
    return response.json


def body(**extra) -> dict:
    return {"gpu_memory": "1GiB", "image": "img", **extra}


# --- the wire's per-field and per-list bounds ----------------------------------------------------
@pytest.mark.parametrize("extra, words", [
    ({"command": ["echo", "x" * (FIELD + 1)]}, "command.1: is 65537 bytes in UTF-8, over the wire's bound of 65536"),
    ({"command": ["€" * 30_000]}, "command.0: is 90000 bytes"),  # 30,000 characters, but 3 bytes each
    ({"command": "echo " + "x" * (FIELD + 1)}, "command string may be at most 65536 characters"),
    ({"env": {f"V{i}": "x" for i in range(20_000)}}, "env: Dictionary should have at most 16384 items"),
    ({"labels": {f"l{i}": "" for i in range(defaults.MAX_ITEMS + 1)}}, "labels: Dictionary should have at most"),
    ({"labels": {"big": "x" * (100 * KiB)}}, "labels.big: is 102400 bytes"),
    ({"labels": {"k" * (100 * KiB): "v"}}, "is 102400 bytes"),
    ({"env": {"A": "é" * (FIELD // 2 + 1)}}, "env.A: is 65538 bytes"),
    ({"command": ["x"] * 4097}, "command: List should have at most 4096 items"),
    ({"node": "n" * 254}, "node: String should have at most 253 characters"),
])
def test_over_a_wire_bound_is_400_at_once(stack, extra, words) -> None:
    refused(stack, json=body(**extra), words=words)


def test_strings_exactly_at_the_field_bound_pass_validation(stack) -> None:
    # at the bound the request reaches the agent (which stays silent here: 502 outcome_unknown after the create timeout)
    _, client, _ = stack
    response = client.post("/v1/containers", json=body(command=["x" * FIELD]))
    assert response.status_code == 502


@pytest.mark.parametrize("extra, words", [
    ({"command": ["ok", "\ud800"]}, "command.1: is not valid Unicode text"),
    ({"env": {"A": "\udfff"}}, "env.A: is not valid Unicode text"),
    ({"labels": {"\ud800": "v"}}, "is not valid Unicode text"),
    ({"command": ["a\0b"]}, "command.0: must not hold a NUL"),
    ({"env": {"A": "x\0"}}, "env.A: must not hold a NUL"),
    ({"env": {"A=B": "x"}}, "name must be non-empty and hold no '='"),
    ({"env": {"": "x"}}, "name must be non-empty"),
])
def test_text_the_agent_cannot_carry_or_run_is_400(stack, extra, words) -> None:
    refused(stack, json=body(**extra), words=words)


def test_the_whole_create_message_is_bounded(stack) -> None:
    # 40 values of 60 KiB: each under the field bound, 2.4 MB together: over a quarter of the 4 MiB frame
    refused(stack, json=body(env={f"V{i}": "x" * (60 * KiB) for i in range(40)}), words="bytes, over the bound of")
    # and over the frame bound itself: was a 500 after the grant was made
    refused(stack, json=body(labels={f"l{i}": "x" * (60 * KiB) for i in range(80)}), words="create message")


def test_many_errors_are_summed_up_not_listed(stack) -> None:
    message = refused(stack, json=body(env={f"V{i}": i for i in range(2000)}), words="more errors")["error"]["message"]
    assert message.count("env.") == 5


# --- gpu_memory: ASCII digits, exact, bounded ----------------------------------------------------
@pytest.mark.parametrize("memory, words", [
    ("１GiB", "cannot read"),  # fullwidth digit one
    ("٣GiB", "cannot read"),  # Arabic-Indic three
    ("²", "cannot read"),
    ("1" * 400, "cannot read"),
    (int("1" * 400), "at most 9223372036854775807"),
    (2**63, "at most 9223372036854775807"),
    ("9999999999TiB", "at most"),
    ("9223372036854775808", "at most"),
    ("1e3", "cannot read"),
    ("1GiB\x00", "cannot read"),
], ids=lambda v: ascii(v)[:24])
def test_gpu_memory_is_ascii_and_bounded(stack, memory, words) -> None:
    message = refused(stack, json=body(gpu_memory=memory), words=words)["error"]["message"]
    assert message.startswith("gpu_memory: ")


def test_parse_bytes_is_exact_ascii_and_bounded() -> None:
    assert parse_bytes("9223372036854775807") == MAX_BYTES  # exact: a float would round it
    assert parse_bytes("9007199254740993") == 9007199254740993
    assert parse_bytes("0.5KiB") == 512 and parse_bytes(" 8 GiB ") == 8 << 30 and parse_bytes("8G") == 8 * 10**9
    for bad in ("１", "٣GiB", "²", "①", "1" * 400, MAX_BYTES + 1, "8EiB", "1GiB\u2003", "1.0000000001B"):
        with pytest.raises(ValueError):
            parse_bytes(bad)


# --- query parameters ----------------------------------------------------------------------------
@pytest.mark.parametrize("query, words", [
    ("since=①", "since must be a non-negative integer"),
    ("since=²", "since must be a non-negative integer"),
    ("since=３", "since must be a non-negative integer"),
    ("since=9223372036854775808", "since must be a non-negative integer of at most"),
    ("since=" + "9" * 400, "since: at most 19 characters"),
    ("type=" + "x" * 2000, "type: at most 1024 characters"),
], ids=lambda v: ascii(v)[:24])
def test_events_query_is_checked(stack, query, words) -> None:
    _, client, _ = stack
    response = client.get(f"/v1/events?{query}")
    assert response.status_code == 400 and response.is_json, response.get_data(as_text=True)[:300]
    assert words in response.json["error"]["message"]


def test_events_since_at_the_int64_bound_is_fine(stack) -> None:
    _, client, _ = stack
    assert client.get(f"/v1/events?since={MAX_BYTES}").json == {"events": []}


@pytest.mark.parametrize("query, words", [
    ("node=" + "n" * 254, "node: at most 253 characters"),
    ("service=" + "s" * (FIELD + 1), "service: at most 65536 characters"),
    ("state=" + "s" * 65, "state: at most 64 characters"),
], ids=lambda v: ascii(v)[:24])
def test_container_filters_are_bounded(stack, query, words) -> None:
    _, client, _ = stack
    response = client.get(f"/v1/containers?{query}")
    assert response.status_code == 400 and response.is_json
    assert words in response.json["error"]["message"]


# --- idle and slow clients -----------------------------------------------------------------------
IDLE, SLOW = 300, 60


def test_idle_and_slow_connections_do_not_starve_the_api(tmp_path) -> None:
    """With hundreds of idle sockets and half-sent requests open, new requests are answered within seconds.

    waitress's defaults (100 connections, idle ones closed after 120 s) stop accepting at the 101st
    connection, so every request waited for an idle one to time out.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = IDLE + SLOW + 200
    if soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            pytest.skip(f"needs {need} open files, the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    manager = ManagerProc(tmp_path)
    held: list[socket.socket] = []
    try:
        for i in range(IDLE + SLOW):
            sock = socket.create_connection(("127.0.0.1", manager.api_port), timeout=5)
            if i >= IDLE:  # slowloris: a request line and some headers, never the blank line that ends them
                sock.sendall(b"GET /v1/nodes HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            held.append(sock)
        time.sleep(0.5)  # let the server take them all
        for sock in held[IDLE:]:
            sock.sendall(b"a")  # still sending, slowly
        with requests.Session() as fresh:
            for path in ("/healthz", "/v1/nodes", "/v1/events", "/healthz"):
                start = time.monotonic()
                response = fresh.get(manager.url + path, timeout=5)
                elapsed = time.monotonic() - start
                assert response.status_code == 200, (path, response.status_code)
                assert elapsed < 3.0, f"{path} answered after {elapsed:.2f}s"
        # a fresh connection per request too (no keep-alive)
        for _ in range(5):
            assert requests.get(manager.url + "/healthz", timeout=5, headers={"Connection": "close"}).ok
        manager.popen.poll()
        assert manager.popen.returncode is None, manager.output()
    finally:
        for sock in held:
            with contextlib.suppress(OSError):
                sock.close()
        manager.stop()


def test_what_the_http_server_refuses_itself_is_answered_in_json(tmp_path) -> None:
    """A raw non-ASCII request line or an oversized body never reaches the app: the answer is still JSON."""
    import json

    manager = ManagerProc(tmp_path)
    try:
        answers = []
        for request in ("GET /v1/events?since=① HTTP/1.1\r\nHost: x\r\n\r\n".encode(),
                        b"POST /v1/containers HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: 3000000\r\n\r\n"):  # declared over the cap: refused before it is sent
            with socket.create_connection(("127.0.0.1", manager.api_port), timeout=10) as sock:
                sock.sendall(request)
                raw = b""
                while chunk := sock.recv(65536):
                    raw += chunk
            head, _, body = raw.partition(b"\r\n\r\n")
            answers.append((head.split(b" ", 2)[1], b"application/json" in head, json.loads(body)))
        assert [(status, is_json) for status, is_json, _ in answers] == [(b"400", True), (b"413", True)]
        assert all(body["error"]["code"] and body["error"]["message"] for _, _, body in answers)
    finally:
        manager.stop()
