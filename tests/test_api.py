"""The REST API and the manager's use cases over a real agent link, with a scripted agent."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from gpumgr.manager.api.app import create_app
from gpumgr.manager.config import ManagerSettings
from gpumgr.manager.service import Manager
from gpumgr.wire.protocol import ContainerReport, Reregister
from tests.fake_agent import FakeAgent, GiB, scripted_stack
from tests.procs import wait_for


@pytest.fixture
def stack(tmp_path):
    with scripted_stack(tmp_path, create_timeout=1.0, heartbeat_interval=0.2) as parts:
        yield parts


def post(client, body, **kw):
    return client.post("/v1/containers", json=body, **kw)


@pytest.mark.parametrize("body, words", [
    ({}, "gpu_memory: Field required"),
    ({"gpu_memory": "lots", "image": "x"}, "cannot read 'lots'"),
    ({"gpu_memory": 0, "image": "x"}, "positive"),
    ({"gpu_memory": -5, "image": "x"}, "positive"),
    ({"gpu_memory": "1.5B", "image": "x"}, "whole number"),
    ({"gpu_memory": True, "image": "x"}, "boolean"),
    ({"gpu_memory": "1GiB", "image": 5}, "image"),
    ({"gpu_memory": "1GiB", "image": "x", "gpus": "2"}, "gpus"),
    ({"gpu_memory": "1GiB", "image": "x", "gpus": 0}, "gpus"),
    ({"gpu_memory": "1GiB", "image": "x", "command": [1]}, "command"),
    ({"gpu_memory": "1GiB", "image": "x", "env": {"A": 1}}, "env"),
    ({"gpu_memory": "1GiB", "image": "x", "placement": "random"}, "placement"),
    ({"gpu_memory": "1GiB", "image": "x", "name": "bad name!"}, "name"),
    ({"gpu_memory": "1GiB", "image": "x", "colour": "red"}, "colour: unknown field"),
    ({"gpu_memory": "1GiB", "image": "x", "labels": {"gpumgr.grant": "x"}}, "reserved"),
    ({"gpu_memory": "1GiB"}, "image is required"),
])
def test_invalid_bodies_are_400_with_a_reason_and_grant_nothing(stack, body, words) -> None:
    manager, client, add_agent = stack
    add_agent()
    response = post(client, body)
    assert response.status_code == 400, response.json
    assert response.json["error"]["code"] == "invalid_request"
    assert words in response.json["error"]["message"]
    assert all(g["memory_reserved"] == 0 for n in manager.cluster.nodes_view() for g in n["gpus"])


def test_malformed_json_and_wrong_content_type(stack) -> None:
    _, client, _ = stack
    assert client.post("/v1/containers", data="{nope", content_type="application/json").status_code == 400
    response = client.post("/v1/containers", data="gpu_memory=1")
    assert response.status_code == 400 and "JSON" in response.json["error"]["message"]
    assert client.post("/v1/containers", json=[1, 2]).status_code == 400


def test_unknown_paths_and_ids_are_json_404(stack) -> None:
    _, client, _ = stack
    for response in (client.get("/v1/containers/nope"), client.delete("/v1/containers/nope"), client.get("/v2/x")):
        assert response.status_code == 404 and response.json["error"]["code"] in {"not_found"}
    assert client.get("/v1/containers?state=sleepy").status_code == 400
    assert client.get("/v1/events?since=-1").status_code == 400


def test_no_agents_is_503(stack) -> None:
    _, client, _ = stack
    response = post(client, {"gpu_memory": "1GiB", "image": "x"})
    assert response.status_code == 503 and response.json["error"]["code"] == "no_agents"


def test_create_list_get_delete_and_the_map(stack) -> None:
    manager, client, add_agent = stack
    add_agent()
    response = post(client, {"gpu_memory": "6GiB", "image": "img", "command": "python serve.py", "labels": {"a": "b"}})
    assert response.status_code == 201, response.json
    record = response.json
    assert record["state"] == "running" and record["gpu_memory"] == 6 * GiB
    assert record["command"] == ["python", "serve.py"]
    assert record["gpus"][0]["index"] is not None and record["container_id"]
    uuid = record["gpus"][0]["uuid"]
    gpu = next(g for n in client.get("/v1/nodes").json["nodes"] for g in n["gpus"] if g["uuid"] == uuid)
    assert gpu["memory_reserved"] == 6 * GiB and gpu["memory_free"] == 18 * GiB and gpu["containers"] == [record["id"]]
    assert client.get(f"/v1/containers/{record['id']}").json["id"] == record["id"]
    assert [c["id"] for c in client.get("/v1/containers?state=running").json["containers"]] == [record["id"]]
    deleted = client.delete(f"/v1/containers/{record['id']}")
    assert deleted.status_code == 200 and deleted.json["state"] == "removed"
    assert all(g["memory_reserved"] == 0 for n in manager.cluster.nodes_view() for g in n["gpus"])
    kinds = [e["type"] for e in client.get("/v1/events").json["events"]]
    assert kinds[:1] == ["node_up"] and [k for k in kinds if k != "node_up"] == ["placed", "started", "removed"]


def test_no_fit_is_409_with_the_largest_free(stack) -> None:
    _, client, add_agent = stack
    add_agent(gpus=1, size=8 * GiB)
    response = post(client, {"gpu_memory": "9GiB", "image": "x"})
    assert response.status_code == 409 and "8GiB" in response.json["error"]["message"]


def test_agent_failure_is_502_and_releases_the_grant(stack) -> None:
    manager, client, add_agent = stack
    add_agent(behaviour="fail")
    response = post(client, {"gpu_memory": "1GiB", "image": "nope"})
    assert response.status_code == 502 and "not on this node" in response.json["error"]["message"]
    assert all(g["memory_reserved"] == 0 for n in manager.cluster.nodes_view() for g in n["gpus"])
    assert client.get("/v1/containers?state=failed").json["containers"][0]["reason"]


def test_agent_timeout_is_502_outcome_unknown_and_a_late_success_runs(stack) -> None:
    """An unanswered create keeps its grant (the container may exist) until its node's report settles it; the
    caller was told the outcome is unknown, not that it failed, so a container that shows up runs (issue 31)."""
    manager, client, add_agent = stack
    agent = add_agent(behaviour="silent")
    response = post(client, {"gpu_memory": "1GiB", "image": "x"})
    # sent and never answered: nobody knows whether it runs (issue 31: never a 504, never a plain retry)
    assert response.status_code == 502 and response.json["error"]["code"] == "outcome_unknown"
    pending = client.get("/v1/containers?state=creating").json["containers"][0]
    assert pending["desired_state"] == "running" and pending["operation"] is None
    assert sum(g["memory_reserved"] for n in manager.cluster.nodes_view() for g in n["gpus"]) == GiB
    # the agent finishes the create after all: its next heartbeat reports it, and it runs with its grant
    agent.reports[pending["id"]] = ContainerReport(grant=pending["id"], container_id="late", gpu_memory=GiB,
                                                   gpus=[g["uuid"] for g in pending["gpus"]], state="running")
    agent.heartbeat()
    wait_for(lambda: client.get(f"/v1/containers/{pending['id']}").json["state"] == "running", 5,
             what="the late container to be taken as running")
    assert pending["id"] in agent.reports
    assert sum(g["memory_reserved"] for n in manager.cluster.nodes_view() for g in n["gpus"]) == GiB

def test_concurrent_requests_never_share_bytes(stack) -> None:
    manager, client, add_agent = stack
    add_agent(gpus=2, size=10 * GiB)
    app_client = client

    def one(_: int) -> int:
        return post(app_client, {"gpu_memory": "3GiB", "image": "x"}).status_code

    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(one, range(12)))
    assert sorted(codes) == [201] * 6 + [409] * 6
    for node in manager.cluster.nodes_view():
        for gpu in node["gpus"]:
            assert gpu["memory_reserved"] == 9 * GiB and len(gpu["containers"]) == 3


def test_nodes_go_down_after_missed_heartbeats_and_come_back(stack) -> None:
    _manager, client, add_agent = stack
    agent = add_agent()
    wait_for(lambda: client.get("/v1/nodes").json["nodes"][0]["state"] == "down", 5, what="node down")
    assert post(client, {"gpu_memory": "1GiB", "image": "x"}).status_code == 503
    agent.heartbeat()
    wait_for(lambda: client.get("/v1/nodes").json["nodes"][0]["state"] == "ready", 5, what="node ready again")
    kinds = [e["type"] for e in client.get("/v1/events").json["events"]]
    assert kinds == ["node_up", "node_down", "node_up"]


def test_malformed_agent_messages_are_dropped_and_the_link_keeps_serving(stack) -> None:
    _manager, client, add_agent = stack
    agent = add_agent()
    agent.send_raw(b"\xc1garbage")
    agent.send_raw([b"two", b"frames"])
    agent.send_raw(b"\x00" * 100_000)
    agent.heartbeat(used=2 * GiB)
    wait_for(lambda: client.get("/v1/nodes").json["nodes"][0]["gpus"][0]["memory_unmanaged"] == 2 * GiB, 5,
             what="the heartbeat after garbage to be applied")
    assert post(client, {"gpu_memory": "1GiB", "image": "x"}).status_code == 201


def test_unknown_node_heartbeat_gets_reregister(stack) -> None:
    manager, _, _ = stack
    agent = FakeAgent(manager.link.bound_endpoint, manager.admission.token(), node="stranger")
    try:
        assert agent.join().ok  # admitted, but never registered
        agent.heartbeat()
        agent.expect(Reregister)
    finally:
        agent.close()


def test_token_is_required_when_configured(tmp_path) -> None:
    manager = Manager(ManagerSettings(agents="tcp://127.0.0.1:0", token="s3cret", state_dir=str(tmp_path)))
    client = create_app(manager).test_client()
    refused = client.get("/v1/nodes")
    assert refused.status_code == 401 and refused.headers["WWW-Authenticate"].startswith("Bearer")
    assert refused.json["error"]["code"] == "unauthorized"
    assert client.get("/v1/nodes", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.get("/v1/nodes", headers={"Authorization": "s3cret"}).status_code == 401  # the raw token
    assert client.get("/v1/nodes", headers={"Authorization": "Basic s3cret"}).status_code == 401
    assert client.get("/v1/nodes", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert client.get("/healthz").status_code == 200


def test_delete_while_the_create_is_under_way_keeps_the_grant(stack) -> None:
    """A DELETE answered while the node was still creating freed bytes the container was about to use."""
    manager, client, add_agent = stack
    add_agent(behaviour="silent")
    pending = threading.Thread(target=post, args=(client, {"gpu_memory": "5GiB", "image": "x"}))
    pending.start()
    record = wait_for(lambda: client.get("/v1/containers?state=creating").json["containers"], 5,
                      what="the create under way")[0]
    response = client.delete(f"/v1/containers/{record['id']}")
    assert response.status_code == 202, response.json
    assert sum(g["memory_reserved"] for n in manager.cluster.nodes_view() for g in n["gpus"]) == 5 * GiB
    pending.join(30)


def test_a_request_cannot_set_the_variables_that_carry_a_grant(stack) -> None:
    """A REST container setting GPUMGR_REQUEST_MEMORY got a second grant from the runtime hook."""
    _, client, add_agent = stack
    add_agent()
    for name in ("GPUMGR_REQUEST_MEMORY", "GPUMGR_GRANT", "GPUMGR_GPU_MEMORY"):
        response = post(client, {"gpu_memory": "1GiB", "image": "x", "env": {name: "1GiB"}})
        assert response.status_code == 400 and name in response.json["error"]["message"], response.json
    assert post(client, {"gpu_memory": "1GiB", "image": "x", "env": {"GPUMGR_SIM_USAGE_FILE": "/u"}}).status_code \
        == 201
