"""``GET /v1/nodes``'s shared copy: ETag and 304, gzip, and a change on the map seen by the very next request."""

from __future__ import annotations

import gzip
import json
import random
import threading
import time

import pytest

from gpumgr.manager.api import nodes_cache
from gpumgr.manager.api.app import create_app
from gpumgr.manager.config import ManagerSettings
from gpumgr.manager.service import Manager
from gpumgr.manager.tenancy.tenants import TenantConfig
from tests.fake_agent import FakeAgent, GiB


@pytest.fixture
def served(fleet):
    manager, client, _ = fleet
    return manager, client


@pytest.fixture
def fleet(tmp_path):
    """A manager, its API's test client, and two fake agents of 8 GPUs (they answer, but heartbeat only when told)."""
    manager = Manager(ManagerSettings(agents="tcp://127.0.0.1:0", heartbeat_interval=0.5,
                                      state_dir=str(tmp_path / "state")))
    manager.start()
    manager.cluster.map_max_age = 30.0  # only a change of the map renews the copy while a test runs
    stop = threading.Event()
    agents = []
    for node in ("a", "b"):
        agent = FakeAgent(manager.link.bound_endpoint, manager.admission.token(), node=node, gpus=8)
        agent.register()
        agents.append((agent, agent.serve(stop)))
    yield manager, create_app(manager).test_client(), [agent for agent, _ in agents]
    stop.set()
    for agent, thread in agents:
        thread.join(2)
        agent.close()
    manager.stop()


def nodes(reply) -> dict[str, dict]:
    return {n["name"]: n for n in json.loads(reply.data)["nodes"]}


def test_an_unchanged_map_answers_304_to_its_etag_and_200_to_any_other(served) -> None:
    _, client = served
    first = client.get("/v1/nodes")
    assert first.status_code == 200 and set(nodes(first)) == {"a", "b"}
    tag = first.headers["ETag"]
    again = client.get("/v1/nodes", headers={"If-None-Match": tag})
    assert again.status_code == 304 and again.data == b"" and again.headers["ETag"] == tag
    for other in ('"not-ours"', "*x", "", '"' + "f" * 5000 + '"'):
        assert client.get("/v1/nodes", headers={"If-None-Match": other}).status_code == 200


def test_a_grant_changes_the_etag_and_is_seen_by_the_next_request(served) -> None:
    _, client = served
    tag = client.get("/v1/nodes").headers["ETag"]
    made = client.post("/v1/containers", json={"image": "img", "gpu_memory": "3GiB"})
    assert made.status_code == 201
    after = client.get("/v1/nodes", headers={"If-None-Match": tag})
    assert after.status_code == 200 and after.headers["ETag"] != tag
    gpus = [g for n in nodes(after).values() for g in n["gpus"]]
    assert sum(g["memory_reserved"] for g in gpus) == 3 * GiB


def test_gzip_only_when_asked_and_the_same_map(served) -> None:
    _, client = served
    plain = client.get("/v1/nodes", headers={"Accept-Encoding": "identity"})
    packed = client.get("/v1/nodes", headers={"Accept-Encoding": "gzip"})
    assert "Content-Encoding" not in plain.headers
    assert packed.headers["Content-Encoding"] == "gzip" and "Accept-Encoding" in packed.headers["Vary"]
    assert json.loads(gzip.decompress(packed.data)) == json.loads(plain.data)
    assert packed.headers["ETag"] == plain.headers["ETag"][:-1] + '-gzip"', "one ETag per encoding"
    for tag in (plain.headers["ETag"], packed.headers["ETag"]):  # either names the unchanged map
        assert client.get("/v1/nodes", headers={"Accept-Encoding": "gzip", "If-None-Match": tag}).status_code == 304
    refused = client.get("/v1/nodes", headers={"Accept-Encoding": "gzip;q=0"})
    assert "Content-Encoding" not in refused.headers and json.loads(refused.data) == json.loads(plain.data)


# --- ?since=<version>: the changes only -------------------------------------------------------------
def body(reply) -> dict:
    return json.loads(gzip.decompress(reply.data) if reply.headers.get("Content-Encoding") == "gzip" else reply.data)


def applied(held: dict[str, dict], answer: dict) -> dict[str, dict]:
    """What a client holds after taking ``answer``: the whole map, or its changes applied."""
    if answer["full"]:
        return {n["name"]: n for n in answer["nodes"]}
    held = dict(held)
    for name in answer["removed"]:
        held.pop(name)
    held.update({n["name"]: n for n in answer["nodes"]})
    return held


def test_since_lists_only_the_node_a_grant_changed_and_nothing_once_unchanged(served) -> None:
    manager, client = served
    manager.cluster.reconciler.down_after = 60.0  # no heartbeats come: the nodes must not go down meanwhile
    whole = body(client.get("/v1/nodes"))
    assert whole["full"] is True and whole["removed"] == [] and set(nodes_of(whole)) == {"a", "b"}
    version = whole["version"]
    same = body(client.get(f"/v1/nodes?since={version}"))
    assert same == {"version": version, "since": version, "full": False, "removed": [], "nodes": []}
    made = client.post("/v1/containers", json={"image": "img", "gpu_memory": "3GiB", "node": "b"})
    assert made.status_code == 201
    delta = body(client.get(f"/v1/nodes?since={version}"))
    assert delta["full"] is False and delta["version"] != version and delta["since"] == version
    assert [n["name"] for n in delta["nodes"]] == ["b"] and delta["removed"] == []
    assert sum(g["memory_reserved"] for g in delta["nodes"][0]["gpus"]) == 3 * GiB
    now = body(client.get("/v1/nodes"))
    assert applied(nodes_of(whole), delta) == nodes_of(now) and now["version"] == delta["version"]


def nodes_of(answer: dict) -> dict[str, dict]:
    return {n["name"]: n for n in answer["nodes"]}


def test_changes_applied_one_after_another_always_equal_the_whole_map(fleet) -> None:
    _, client, agents = fleet
    rng = random.Random(7)
    first = body(client.get("/v1/nodes"))
    held, version, made = nodes_of(first), first["version"], []
    for step in range(40):
        for agent in agents:  # the nodes stay up however slow the machine is
            agent.heartbeat()
        if made and rng.random() < 0.4:
            assert client.delete(f"/v1/containers/{made.pop(rng.randrange(len(made)))}").status_code == 200
        else:
            reply = client.post("/v1/containers", json={"image": "img", "gpu_memory": f"{rng.randint(1, 9)}GiB",
                                                        "gpus": rng.choice([1, 1, 2, 4])})
            assert reply.status_code == 201, reply.data
            made.append(reply.json["id"])
        if rng.random() < 0.6:  # a poller that misses some versions still ends with the same map
            answer = body(client.get(f"/v1/nodes?since={version}", headers={"Accept-Encoding": "gzip"}))
            assert answer["full"] is False
            held, version = applied(held, answer), answer["version"]
            whole = body(client.get("/v1/nodes"))
            assert held == nodes_of(whole), f"step {step}: the changes applied differ from the whole map"
            assert whole["version"] == version


def test_a_removed_node_is_named_in_removed_and_an_unknown_version_gets_the_whole_map(served) -> None:
    _, client = served
    version = body(client.get("/v1/nodes"))["version"]
    # no heartbeats come in this test: the nodes go down, and a down node may be forgotten
    assert wait_until(lambda: client.delete("/v1/nodes/a").status_code == 200, 10)
    delta = body(client.get(f"/v1/nodes?since={version}"))
    assert delta["full"] is False and delta["removed"] == ["a"] and "a" not in nodes_of(delta)
    other = "0" * 8 if not version.startswith("0" * 8) else "f" * 8
    foreign = body(client.get(f"/v1/nodes?since={other}-1"))  # another manager process's version
    assert foreign["full"] is True and set(nodes_of(foreign)) == {"b"} and foreign["removed"] == []
    ahead = body(client.get(f"/v1/nodes?since={version.split('-')[0]}-99999"))  # a version not reached
    assert ahead["full"] is True


@pytest.mark.parametrize("since", ["", "12", "abc", "0a1b2c3d", "0a1b2c3d-", "0A1B2C3D-1", "0a1b2c3d-1x",
                                   "0a1b2c3d--1", "0a1b2c3d-" + "9" * 20, "x" * 5000])
def test_a_malformed_since_is_a_400_saying_so(served, since) -> None:
    _, client = served
    reply = client.get("/v1/nodes", query_string={"since": since})
    assert reply.status_code == 400 and reply.json["error"]["code"] == "invalid_request"
    assert "since" in reply.json["error"]["message"] and len(reply.data) < 400


def listed_since(client, version: str) -> list[dict]:
    return body(client.get(f"/v1/nodes?since={version}"))["nodes"]


def test_a_change_no_code_path_named_still_reaches_the_answers(served, monkeypatch) -> None:
    manager, client = served
    manager.cluster.reconciler.down_after = 60.0  # no heartbeats come: the nodes must not go down meanwhile
    monkeypatch.setattr(nodes_cache, "SCAN_EVERY", 0.2)  # every node compared whole within 0.2 s
    manager.cluster.map_max_age = 0.05
    version = body(client.get("/v1/nodes"))["version"]
    with manager.cluster.ledger.lock:
        manager.cluster.ledger.nodes["a"].gpus[0].used = 5 * GiB  # behind the ledger's back
    assert wait_until(lambda: listed_since(client, version), 5)
    listed = listed_since(client, version)
    assert [n["name"] for n in listed] == ["a"] and listed[0]["gpus"][0]["memory_used"] == 5 * GiB


def test_last_seen_alone_relists_a_node_only_after_its_step(served) -> None:
    manager, client = served
    manager.cluster.reconciler.down_after = 60.0  # no heartbeats come: the nodes must not go down meanwhile
    manager.cluster.map_max_age = 0.05
    version = body(client.get("/v1/nodes"))["version"]
    node = manager.cluster.ledger.nodes["a"]
    with manager.cluster.ledger.lock:
        node.last_seen += 0.5 * nodes_cache.SEEN_STEP  # a heartbeat that changed nothing else
    time.sleep(0.5)  # the background thread looked several times meanwhile
    assert listed_since(client, version) == []
    with manager.cluster.ledger.lock:
        node.last_seen += 1.6 * nodes_cache.SEEN_STEP
    assert wait_until(lambda: listed_since(client, version), 5)
    relisted = listed_since(client, version)
    assert [n["name"] for n in relisted] == ["a"] and relisted[0]["last_seen"] == node.last_seen


def test_a_tenant_gets_its_whole_view_with_since(tmp_path) -> None:
    """A tenant's view is filtered for it: never a delta of the operator's map, and a bad since is still a 400."""
    operator, alice = "operator-token-0123456789", "alice-token-0123456789abcdef"
    manager = Manager(ManagerSettings(agents="tcp://127.0.0.1:0", state_dir=str(tmp_path / "state"), token=operator,
                                      tenants={"alice": TenantConfig(token=alice)}))
    manager.start()
    try:
        client = create_app(manager).test_client()
        as_operator, as_alice = ({"Authorization": f"Bearer {t}"} for t in (operator, alice))
        version = body(client.get("/v1/nodes", headers=as_operator))["version"]
        assert body(client.get(f"/v1/nodes?since={version}", headers=as_operator))["full"] is False
        mine = body(client.get(f"/v1/nodes?since={version}", headers=as_alice))
        assert mine["full"] is True and mine["removed"] == [] and mine["nodes"] == []
        assert client.get("/v1/nodes?since=nonsense", headers=as_alice).status_code == 400
    finally:
        manager.stop()


def wait_until(check, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("seen", [2.0, 1795705017.462123, 3, 1e-7])
def test_a_spliced_last_seen_is_what_encoding_the_view_gives(seen) -> None:
    """The background pass splices a new last_seen into a node's bytes; a name made to look like keys cannot fool it."""
    view = {"name": 'n,"last_seen":1,"runtime":"x"', "state": "ready", "last_seen": 1.5, "runtime": "docker",
            "gpus": [{"uuid": "GPU-1", "containers": ['c,"runtime":']}]}
    assert nodes_cache._with_seen(nodes_cache._encode(view), seen) == nodes_cache._encode({**view, "last_seen": seen})


def test_a_gpu_turning_unhealthy_is_listed_by_the_next_since_answer(served) -> None:
    """A health change is a change of the map: the next ``since`` answer names its node at once (it
    once waited for the rolling comparison, up to ten seconds)."""
    manager, client = served
    manager.cluster.reconciler.down_after = 60.0
    version = body(client.get("/v1/nodes"))["version"]
    with manager.cluster.lock:
        gpu = manager.cluster.ledger.nodes["a"].gpus[3]
        assert manager.cluster.ledger.set_health(gpu, "Xid 79: fallen off the bus")
    delta = body(client.get(f"/v1/nodes?since={version}"))
    assert [n["name"] for n in delta["nodes"]] == ["a"]
    shown = delta["nodes"][0]["gpus"][3]
    assert shown["healthy"] is False and "Xid 79" in shown["health"]
