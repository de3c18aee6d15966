"""A create whose outcome is unknown is resent with its ``Idempotency-Key`` and runs once (issue 31).

A real ``gpumgr manager`` and ``gpumgr agent`` (real engine, simulated GPUs) behind a small HTTP proxy
that, when told, forwards a create and then hides its answer: it says 502 ``outcome_unknown``, or it
cuts the connection. The client (and ``docker gpu run``) must resend with the same key, and the engine
must hold exactly one container. A proxy that never forwards gives an outcome that stays unknown.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from gpumgr import client_keyed
from gpumgr.client import Client
from gpumgr.client_http import api_error
from gpumgr.plugin import docker_gpu
from gpumgr.wire.errors import AgentFailed, OutcomeUnknown
from tests.procs import AgentProc, ManagerProc, remove_containers_of

NODE = "resend31-a"
UNKNOWN_BODY = json.dumps({"error": {"code": "outcome_unknown", "message": "the leader went away"}}).encode()


class Proxy:
    """Forwards every call to ``upstream``; a create meets the next fault of ``faults`` first, if any:
    ``unknown`` (forwarded, answered 502 outcome_unknown), ``cut`` (forwarded, connection closed unanswered),
    ``swallow`` (not forwarded, answered 502 outcome_unknown)."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.faults: list[str] = []
        self.always: str | None = None
        self.keys: list[str | None] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                proxy.handle(self)

            def do_POST(self) -> None:
                proxy.handle(self)

            def do_DELETE(self) -> None:
                proxy.handle(self)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def handle(self, call: BaseHTTPRequestHandler) -> None:
        data = call.rfile.read(int(call.headers.get("Content-Length") or 0))
        fault = None
        if call.command == "POST" and call.path == "/v1/containers":
            self.keys.append(call.headers.get("Idempotency-Key"))
            fault = self.always or (self.faults.pop(0) if self.faults else None)
        if fault != "swallow":
            headers = {k: v for k, v in call.headers.items() if k.lower() not in ("host", "content-length")}
            answer = requests.request(call.command, self.upstream + call.path, data=data, headers=headers, timeout=60)
        if fault == "cut":
            call.close_connection = True
            return
        status, body = (502, UNKNOWN_BODY) if fault else (answer.status_code, answer.content)
        call.send_response(status)
        call.send_header("Content-Type", "application/json")
        call.send_header("Content-Length", str(len(body)))
        call.end_headers()
        call.wfile.write(body)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def manager(tmp_path_factory, docker_client, test_image) -> Iterator[ManagerProc]:
    tmp = tmp_path_factory.mktemp("resend")
    manager = ManagerProc(tmp)
    agent = AgentProc(tmp, manager, NODE, gpus="sim:1x8GiB", env={"GPUMGR_POLICY": "{}"})
    yield manager
    agent.stop()
    manager.stop()
    remove_containers_of(docker_client, NODE)


@pytest.fixture
def proxy(manager) -> Iterator[Proxy]:
    proxy = Proxy(manager.url)
    yield proxy
    proxy.close()


def engine_has(docker_client, name: str) -> int:
    return len(docker_client.containers.list(all=True, filters={"label": f"gpumgr.node={NODE}", "name": name}))


@pytest.mark.parametrize("fault", ["unknown", "cut"])
def test_a_create_whose_answer_was_lost_is_resent_and_runs_once(manager, proxy, docker_client, test_image,
                                                                  fault) -> None:
    name = f"once-{fault}-{uuid.uuid4().hex[:6]}"
    proxy.faults = [fault]
    box = Client(proxy.url).containers.run(test_image, "sleep 30", gpu_memory="1GiB", name=name)
    assert box.name == name and box.state == "running"
    assert len(proxy.keys) == 2 and proxy.keys[0] == proxy.keys[1] and proxy.keys[0]
    assert engine_has(docker_client, name) == 1
    assert [c.id for c in manager.client.containers.list() if c.name == name] == [box.id]
    manager.client.containers.remove(box.id)


def test_a_caller_key_is_sent_as_given(manager, proxy, test_image) -> None:
    key = f"mine-{uuid.uuid4()}"
    box = Client(proxy.url).containers.run(test_image, "true", gpu_memory="1GiB", idempotency_key=key)
    assert proxy.keys == [key]
    again = Client(proxy.url).containers.run(test_image, "true", gpu_memory="1GiB", idempotency_key=key)
    assert again.id == box.id  # the first answer, nothing run again
    manager.client.containers.remove(box.id)


def test_an_outcome_that_stays_unknown_is_outcome_unknown_naming_the_key(proxy, monkeypatch) -> None:
    monkeypatch.setattr(client_keyed, "RESEND_FOR", 1.0)
    monkeypatch.setattr(client_keyed, "BACKOFF", 0.05)
    proxy.always = "swallow"
    with pytest.raises(OutcomeUnknown) as caught:
        Client(proxy.url).containers.run("busybox", "true", gpu_memory="1GiB")
    assert caught.value.code == "outcome_unknown" and caught.value.status == 502
    assert len(proxy.keys) >= 3 and len(set(proxy.keys)) == 1
    assert proxy.keys[0] in caught.value.message and "look before" in caught.value.message


def test_docker_gpu_run_exits_125_and_says_to_look_when_the_outcome_stays_unknown(proxy, monkeypatch,
                                                                                    capsys) -> None:
    monkeypatch.setattr(client_keyed, "RESEND_FOR", 1.0)
    monkeypatch.setattr(client_keyed, "BACKOFF", 0.05)
    proxy.always = "swallow"
    status = docker_gpu.main(["gpu", "--manager", proxy.url, "run", "--gpu-memory", "1GiB", "--name", "lost-one",
                              "busybox", "true"])
    err = capsys.readouterr().err
    assert status == 125, err
    assert "docker gpu ps" in err and "'lost-one'" in err and "outcome_unknown" in err
    assert len(proxy.keys) >= 3 and len(set(proxy.keys)) == 1


def test_docker_gpu_run_resends_and_runs_once(manager, proxy, docker_client, test_image, capsys) -> None:
    proxy.faults = ["unknown"]
    name = f"run-once-{uuid.uuid4().hex[:6]}"
    status = docker_gpu.main(["gpu", "--manager", proxy.url, "run", "-d", "--gpu-memory", "1GiB", "--name", name,
                              test_image, "sleep", "30"])
    assert status == 0, capsys.readouterr().err
    assert len(proxy.keys) == 2 and proxy.keys[0] == proxy.keys[1]
    assert engine_has(docker_client, name) == 1
    manager.client.containers.remove(name)


def test_502_is_outcome_unknown_unless_it_says_agent_failed() -> None:
    assert type(api_error(502, UNKNOWN_BODY)) is OutcomeUnknown
    failed = api_error(502, json.dumps({"error": {"code": "agent_failed", "message": "no image"}}).encode())
    assert type(failed) is AgentFailed
    assert type(api_error(502, b"<html>Bad Gateway</html>")) is OutcomeUnknown  # a proxy's: nobody knows
