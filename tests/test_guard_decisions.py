"""The guard's decisions on the engine's plugin requests, made in process (the engine tests drive the same code)."""

from __future__ import annotations

import base64
import json
import logging
import socket

import pytest

from gpumgr.agent.guard.guard import TICKET_LABEL, Guard, GuardState
from gpumgr.agent.guard.guard_server import GuardServer
from gpumgr.wire.engine import gpudev

IMAGE_ID = "sha256:" + "ab" * 32
#: an engine whose default runtime is runc, as the guard learns it from dockerd's files
POLICY = gpudev.Policy(default=gpudev.DefaultRuntime(frozenset({"runc"}), None))


def plugin_request(uri: str, body: object | None = None, method: str = "POST") -> dict:
    request = {"RequestMethod": method, "RequestUri": uri, "RequestHeaders": {}}
    if body is not None:
        request["RequestBody"] = base64.b64encode(json.dumps(body).encode()).decode()
    return request


@pytest.fixture
def guard(tmp_path) -> Guard:
    return Guard(POLICY, GuardState(tmp_path / "guard.json"), frozenset({IMAGE_ID}))


@pytest.mark.parametrize("uri", ["/v1.41/containers/create", "/containers/create?name=x",
                                 "//v1.41//containers/create", "/v1.41/containers%2Fcreate",
                                 "/v1.41/containers/./create", "/v1.41/x/../containers/create"])
def test_every_spelling_of_the_create_path_is_judged(guard, uri):
    assert not guard.request(plugin_request(uri, {"Image": "x", "HostConfig": {"Privileged": True}})).allow


def test_reads_and_other_calls_pass_without_a_body(guard):
    for uri, method in (("/v1.41/containers/json", "GET"), ("/_ping", "HEAD"), ("/v1.41/plugins", "GET"),
                        ("/v1.41/containers/abc/wait", "POST"), ("/v1.41/images/create?fromImage=x", "POST")):
        assert guard.request(plugin_request(uri, method=method)).allow, uri


def test_plugin_changes_are_denied_whatever_the_method_case(guard):
    for method in ("POST", "post", "DELETE"):
        assert not guard.request(plugin_request("/v1.41/plugins/gpumgr-guard/disable", method=method)).allow


def test_an_allowed_image_id_passes_and_is_logged_but_not_for_the_guards_own_files(guard, caplog):
    body = {"Image": IMAGE_ID, "HostConfig": {"DeviceRequests": [{"Count": -1, "Capabilities": [["gpu"]]}],
                                              "Privileged": True}}
    with caplog.at_level(logging.WARNING):
        assert guard.request(plugin_request("/v1.41/containers/create", body)).allow
    assert any("guard_allow" in r.message and IMAGE_ID in r.message for r in caplog.records)
    assert not guard.request(plugin_request("/v1.41/containers/create", {**body, "Image": "tagged:latest"})).allow
    body["HostConfig"]["Binds"] = ["/etc/docker:/x"]
    assert not guard.request(plugin_request("/v1.41/containers/create", body)).allow


def test_a_ticketed_container_starts_once_and_is_remembered_across_guard_restarts(guard, tmp_path):
    guard.state.add_ticket("t" * 32)
    create = plugin_request("/v1.41/containers/create?name=job", {"Image": "x", "Labels": {TICKET_LABEL: "t" * 32},
                                                                  "Env": ["NVIDIA_VISIBLE_DEVICES=GPU-1"]})
    assert guard.request(create).allow
    response = {**create, "ResponseStatusCode": 201,
                "ResponseBody": base64.b64encode(json.dumps({"Id": "f" * 64}).encode()).decode()}
    assert guard.response(response).allow
    assert guard.request(plugin_request(f"/v1.41/containers/{'f' * 64}/start")).allow
    restarted = Guard(POLICY, GuardState(tmp_path / "guard.json"))
    restarted.state.load()
    for ref in ("f" * 64, "fff", "job", "/job"):
        decision = restarted.request(plugin_request(f"/v1.41/containers/{ref}/start"))
        assert not decision.allow and "grant has ended" in decision.message
    assert restarted.request(plugin_request("/v1.41/containers/other/start")).allow
    # once the gpumgr container is gone, its name may go to a plain container, which then starts freely
    plain = plugin_request("/v1.41/containers/create?name=job", {"Image": "x"})
    assert restarted.request(plain).allow
    restarted.response({**plain, "ResponseStatusCode": 201,
                        "ResponseBody": base64.b64encode(json.dumps({"Id": "e" * 64}).encode()).decode()})
    assert restarted.request(plugin_request("/v1.41/containers/job/start")).allow
    assert not restarted.request(plugin_request(f"/v1.41/containers/{'f' * 64}/start")).allow


def test_a_legacy_start_body_is_judged_and_a_missing_one_denied(guard):
    assert not guard.request(plugin_request("/v1.23/containers/c/start", {"Privileged": True})).allow
    assert guard.request(plugin_request("/v1.23/containers/c/start", {"Dns": ["1.1.1.1"]})).allow
    unread = plugin_request("/v1.23/containers/c/start")
    assert not guard.request(unread).allow  # a body the engine would read but did not pass on
    unread["RequestHeaders"] = {"Content-Length": "0"}
    assert guard.request(unread).allow
    assert guard.request(plugin_request("/v1.41/containers/c/start")).allow


def test_garbage_from_the_engine_fails_closed(guard):
    bad = plugin_request("/v1.41/containers/create")
    bad["RequestBody"] = "not base64 !!"
    assert not guard.request(bad).allow
    assert not guard.request({"RequestMethod": "POST", "RequestUri": "/v1.41/services/create"}).allow


def _exchange(path: str, raw: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(path)
        sock.sendall(raw)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
            if b"\r\n\r\n" in data and len(data.split(b"\r\n\r\n", 1)[1]) >= int(
                    data.split(b"Content-Length: ", 1)[1].split(b"\r\n", 1)[0]):
                break
    return data


def test_the_plugin_socket_answers_garbage_with_a_refusal_and_keeps_serving(guard, tmp_path):
    server = GuardServer(guard, str(tmp_path / "plugin.sock"), None).start()
    try:
        path = str(tmp_path / "plugin.sock")
        assert b" 400 " in _exchange(path, b"GET / HTTP/1.1\r\n\r\n")
        assert b" 400 " in _exchange(path, b"POST /AuthZPlugin.AuthZReq HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n")
        denied = _exchange(path, b"POST /AuthZPlugin.AuthZReq HTTP/1.1\r\nContent-Length: 8\r\n\r\nnot json")
        assert b'"Allow": false' in denied
        activate = _exchange(path, b"POST /Plugin.Activate HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}")
        assert json.loads(activate.split(b"\r\n\r\n", 1)[1]) == {"Implements": ["authz"]}
    finally:
        server.close()
