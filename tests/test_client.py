"""The Python client (``gpumgr.client``) against a real manager, a real agent and engine, simulated GPUs.

Every call of the client is made here, the API's errors included, and ``events()`` is followed across a
restart of the manager.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest

import gpumgr
from gpumgr.client import Client, ManagerUnreachable, NeverFits, Unauthorized
from gpumgr.client_types import Container, Event, Node
from gpumgr.wire.errors import Conflict, GpumgrError, InvalidRequest, NoAgents, NoFit, NotFound, PolicyDenied
from tests.procs import AgentProc, ManagerProc, free_port, wait_for

GiB = 1 << 30
NODE = "client23-a"
USAGE = "/tmp/use"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, docker_client, test_image):
    tmp = tmp_path_factory.mktemp("client")
    manager = ManagerProc(tmp)
    # the node's own policy (the operator's requests answer to it too) allows no host paths
    agent = AgentProc(tmp, manager, NODE, gpus="sim:2x8GiB", env={"GPUMGR_POLICY": "{}"})
    yield manager, agent, Client(manager.url)
    agent.stop()
    manager.stop()
    from tests.procs import remove_containers_of

    remove_containers_of(docker_client, NODE)


def job(image: str, command: str, **extra) -> dict:
    return {"image": image, "command": ["sh", "-c", command], **extra}


def test_from_env_reads_several_urls_and_goes_on_to_the_next(cluster):
    manager, _, _ = cluster
    dead = f"http://127.0.0.1:{free_port()}"
    client = Client.from_env({"GPUMGR_MANAGER": f"{dead}, {manager.url}/"})
    assert client.api.url == dead
    assert client.health()["status"] == "ok"
    assert client.api.url == manager.url  # later calls start with the one that answered
    assert [n.name for n in client.nodes.list()] == [NODE]
    assert gpumgr.Client is Client
    assert Client.from_env({}).api.url == "http://127.0.0.1:9400"
    with pytest.raises(InvalidRequest, match="tcp:// is an agent's link endpoint"):
        Client.from_env({"GPUMGR_MANAGER": "tcp://127.0.0.1:9401"})
    with pytest.raises(ManagerUnreachable, match="cannot reach the gpumgr manager") as caught:
        Client(f"{dead},http://127.0.0.1:{free_port()}").nodes.list()
    assert caught.value.code == "unreachable" and dead in str(caught.value)


def test_a_manager_that_goes_away_mid_session_fails_over_to_the_next(tmp_path):
    first, second = ManagerProc(tmp_path), ManagerProc(tmp_path)
    try:
        client = Client([first.url, second.url])
        assert client.nodes.list() == [] and client.api.url == first.url  # a kept-alive connection to the first
        first.stop()
        assert client.nodes.list() == [] and client.api.url == second.url
        with pytest.raises(NoAgents) as caught:  # a create goes on too: nothing was sent to the first
            client.containers.run("busybox", "true", gpu_memory="1GiB")
        assert (caught.value.code, caught.value.status) == ("no_agents", 503)
    finally:
        first.stop()
        second.stop()


def test_a_kept_connection_the_manager_closed_is_not_used_for_a_create(tmp_path):
    """A create is never sent again once sent, so the client must see beforehand that a manager that restarted
    (or closed an idle connection) closed the connection it keeps, and open a fresh one."""
    manager = ManagerProc(tmp_path)
    try:
        client = Client(manager.url)
        assert client.nodes.list() == []  # the connection is kept
        manager.stop()
        manager = ManagerProc(tmp_path, api_port=manager.api_port, agent_port=manager.agent_port)
        with pytest.raises(NoAgents):  # the manager's answer, not ManagerUnreachable's "outcome unknown"
            client.containers.run("busybox", "true", gpu_memory="1GiB")
    finally:
        manager.stop()


def test_nodes_are_typed_records_of_the_map(cluster):
    _, _, client = cluster
    node = client.nodes.get(NODE)
    assert isinstance(node, Node) and node.state == "ready" and node.runtime == "docker"
    assert [g.memory_total for g in node.gpus] == [8 * GiB, 8 * GiB] and node.gpus[0].index == 0
    assert node.raw["name"] == NODE
    with pytest.raises(NotFound, match="no node named"):
        client.nodes.get("client23-none")
    with pytest.raises(Conflict) as caught:  # a node that is up cannot be forgotten
        client.nodes.forget(NODE)
    assert caught.value.status == 409


def test_a_container_through_its_whole_life(cluster, test_image):
    _, _, client = cluster
    name = f"client23-{uuid.uuid4().hex[:8]}"
    box = client.containers.run(test_image, ["sh", "-c", f"echo {GiB} > {USAGE}; echo out; echo err >&2; "
                                                         "trap 'echo term; exit 3' TERM; sleep 300 & wait"],
                                gpu_memory="2GiB", name=name, labels={"team": "ml"},
                                env={"GPUMGR_SIM_USAGE_FILE": USAGE})
    assert isinstance(box, Container) and box.state == "running" and box.node == NODE
    assert box.gpu_memory == 2 * GiB and box.labels["team"] == "ml" and len(box.gpus) == 1
    assert client.containers.get(name).id == box.id == client.containers.get(box.id[:10]).id
    assert box.id in [c.id for c in client.containers.list(state="running", node=NODE)]
    assert box.id not in [c.id for c in client.containers.list(state="exited")]
    wait_for(lambda: box.reload().gpu_memory_used == GiB, 10, what="usage on the record")

    grown = client.containers.resize(name, "3GiB")
    assert grown.gpu_memory == 3 * GiB and client.nodes.get(NODE).gpus[grown.gpus[0].index].memory_reserved == 3 * GiB
    with pytest.raises(GpumgrError) as caught:  # below what it uses, without force
        box.resize(GiB // 2)
    assert caught.value.status == 409 and caught.value.code == "below_usage"
    assert box.resize("1GiB", force=True).gpu_memory == GiB

    wait_for(lambda: b"out" in box.logs(), 10, what="its output")
    assert box.logs(tail=1) in (b"err\n", b"out\n")
    frames = []
    for stream, data in client.containers.stream_logs(box.id, follow=False):
        frames.append((stream, data))
    assert (1, b"out\n") in frames and (2, b"err\n") in frames

    assert client.containers.wait(box.id, timeout=0.2).ended is False
    assert box.kill("SIGTERM") == "SIGTERM"
    end = box.wait(timeout=30)
    assert end.ended and end.state == "exited" and end.exit_code == 3
    with pytest.raises(Conflict, match="not running"):
        box.kill()
    removed = client.containers.remove(name)
    assert removed.state in ("removed", "exited") and removed.gpu_memory_held == 0
    assert all(g.memory_reserved == 0 for g in client.nodes.get(NODE).gpus)


def test_queued_requests_and_their_withdrawal(cluster, test_image):
    _, _, client = cluster
    big = client.containers.run(test_image, "sleep 300", gpu_memory="8GiB", gpus=2)
    try:
        with pytest.raises(NoFit) as caught:
            client.containers.run(test_image, "sleep 300", gpu_memory="1GiB")
        assert (caught.value.code, caught.value.status) == ("no_fit", 409)
        waiting = client.containers.run(test_image, "sleep 300", gpu_memory="1GiB", queue=True)
        assert waiting.state == "queued" and waiting.queue is not None and waiting.queue.position == 1
        withdrawn = waiting.remove()
        assert withdrawn.state != "queued" and withdrawn.queue is None
    finally:
        big.remove()


def test_api_errors_are_exceptions_with_the_apis_code_and_status(cluster, test_image):
    _, _, client = cluster
    cases = [
        (lambda: client.containers.run(test_image, gpu_memory="lots"), InvalidRequest, "invalid_request", 400),
        (lambda: client.containers.run(test_image, gpu_memory="9GiB"), NeverFits, "never_fits", 409),
        (lambda: client.containers.get("no-such-container"), NotFound, "not_found", 404),
        (lambda: client.containers.remove("no-such-container"), NotFound, "not_found", 404),
        (lambda: client.containers.resize("no-such-container", "1GiB"), NotFound, "not_found", 404),
        (lambda: client.containers.wait("no-such-container", timeout=1), NotFound, "not_found", 404),
        (lambda: client.containers.kill("no-such-container", "SIGNOPE;"), NotFound, "not_found", 404),
        (lambda: client.containers.logs("no-such/../../v1/nodes"), NotFound, "not_found", 404),
        (lambda: client.containers.list(state="sleepy"), InvalidRequest, "invalid_request", 400),
        (lambda: client.containers.run(test_image, gpu_memory="1GiB", unknown_field=1), InvalidRequest,
         "invalid_request", 400),
        (lambda: list(client.events(since=-1, follow=False)), InvalidRequest, "invalid_request", 400),
        (lambda: client.containers.run(test_image, "true", gpu_memory="1GiB", volumes=["/etc:/e:ro"]),
         PolicyDenied, "policy_denied", 403),
    ]
    for call, cls, code, status in cases:
        with pytest.raises(cls) as caught:
            call()
        assert (caught.value.code, caught.value.status) == (code, status), caught.value
        assert caught.value.message
    assert isinstance(caught.value, PolicyDenied) and caught.value.rule == "bind_paths"
    assert all(g.memory_reserved == 0 for g in client.nodes.get(NODE).gpus)


def test_a_token_is_sent_and_a_missing_one_is_unauthorized(tmp_path):
    manager = ManagerProc(tmp_path, "--token", "s3cret", env={"GPUMGR_TOKEN": ""})
    try:
        with pytest.raises(Unauthorized) as caught:
            Client(manager.url).nodes.list()
        assert caught.value.status == 401 and caught.value.code == "unauthorized"
        assert Client.from_env({"GPUMGR_MANAGER": manager.url, "GPUMGR_TOKEN": "s3cret"}).nodes.list() == []
    finally:
        manager.stop()


def test_events_follow_across_a_manager_restart(tmp_path, docker_client, test_image):
    node = "client23-ev"
    manager = ManagerProc(tmp_path)
    agent = AgentProc(tmp_path, manager, node, gpus="sim:1x8GiB")
    client = Client(manager.url)
    seen: list[Event] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def follow() -> None:
        try:
            for event in client.events(since=0, poll=0.1, reconnect_timeout=60):
                seen.append(event)
                if stop.is_set():
                    return
        except BaseException as exc:  # handed to the test's thread
            errors.append(exc)

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    try:
        first = client.containers.run(test_image, "sleep 300", gpu_memory="1GiB")
        wait_for(lambda: any(e.container == first.id and e.type == "started" for e in seen), 10,
                 what="the first container's events")
        manager.stop()
        time.sleep(0.5)  # the follower finds the manager gone at least once
        manager = ManagerProc(tmp_path, api_port=manager.api_port, agent_port=manager.agent_port)
        agent.wait_ready(30)
        second = client.containers.run(test_image, "sleep 300", gpu_memory="1GiB")
        wait_for(lambda: any(e.container == second.id and e.type == "started" for e in seen), 15,
                 what="the second container's events, after the restart")
        stop.set()
        client.containers.remove(second.id)
        reader.join(10)
        assert not errors, errors
        ids = [e.id for e in seen]
        assert ids == sorted(set(ids)), "an event was given twice or out of order"
        assert {e.type for e in seen if e.container == first.id} >= {"placed", "started"}
        assert min(e.id for e in seen if e.container == second.id) > max(e.id for e in seen
                                                                           if e.container == first.id)
        newest = max(ids)
        assert [e.id for e in client.events(since=newest - 1, follow=False)] == [newest]
        assert list(client.events(follow=False)) == []  # since None: only what comes from now on
    finally:
        stop.set()
        agent.stop()
        manager.stop()
        from tests.procs import remove_containers_of

        remove_containers_of(docker_client, node)


@pytest.mark.parametrize(("record", "shape"), [
    ("Container", "ContainerRecord"), ("GpuRef", "GpuRef"), ("QueuePlace", "QueuePlace"), ("Gpu", "GpuView"),
    ("Node", "NodeView"), ("Event", "Event"), ("WaitResult", "WaitResult"), ("Gang", "gangs.GangView"),
    ("GangQueuePlace", "gangs.GangQueuePlace"),
])
def test_each_typed_record_has_every_field_of_its_response_shape(record, shape):
    """The records mirror the API's documented answers (``manager/openapi.py``, and the modules it takes
    shapes from, such as ``gangs``), so they cannot drift apart unseen."""
    import dataclasses
    import operator

    from gpumgr import client_types
    from gpumgr.manager.api import openapi

    fields = {f.name for f in dataclasses.fields(getattr(client_types, record))} - {"raw", "_collection"}
    assert fields == set(operator.attrgetter(shape)(openapi).model_fields)


def test_the_readmes_example_runs(tmp_path, monkeypatch, docker_client, test_image, capsys):
    """The docs' client example (docs/api/python.md), run as written but for its image and command and a bounded
    events loop."""
    import re

    from tests.procs import ROOT, remove_containers_of

    text = (ROOT / "docs" / "api" / "python.md").read_text()
    block = re.search(r"^# From Python: `gpumgr.client`.*?```python\n(.*?)```", text, re.S | re.M)[1]
    # it runs a moment, so the example's resize finds it running however fast the create is answered
    block = block.replace('"pytorch:2", "python train.py"', f'"{test_image}", "sh -c \'sleep 2; echo hi; exit 3\'"')
    block = block.replace('types=["killed"])', 'types=["placed"], follow=False)')
    manager = ManagerProc(tmp_path)
    agent = AgentProc(tmp_path, manager, "client23-readme", gpus="sim:2x24GiB")
    monkeypatch.setenv("GPUMGR_MANAGER", manager.url)
    try:
        exec(compile(block, "docs/api/python.md", "exec"), {})
    finally:
        agent.stop()
        manager.stop()
        remove_containers_of(docker_client, "client23-readme")
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("client23-readme [0, 1]") and out[1] == "3 b'hi\\n'", out
    assert out[2].startswith("client23-readme ready") and "8GiB" in out[3], out


def test_answers_that_are_not_the_apis_are_errors_not_crashes():
    """A URL that is some other web server: a 200 that is not JSON, and an error page instead of the error shape."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Page(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status = 404 if "containers" in self.path else 200
            body = b"<html>not here</html>"
            self.send_response(status)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        client = Client(f"http://127.0.0.1:{server.server_address[1]}")
        with pytest.raises(GpumgrError, match="not JSON: is it a gpumgr manager") as caught:
            client.nodes.list()
        assert caught.value.code == "bad_answer"
        with pytest.raises(NotFound) as missing:
            client.containers.get("x")
        assert (missing.value.code, missing.value.status, missing.value.message) == ("http_404", 404,
                                                                                     "<html>not here</html>")
    finally:
        server.shutdown()
        server.server_close()
