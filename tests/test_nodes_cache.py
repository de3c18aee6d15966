"""``GET /v1/nodes``'s shared copy: ETag and 304, gzip, and a change on the map seen by the very next request."""

from __future__ import annotations

import gzip
import json
import threading

import pytest

from gpumgr.manager.app import create_app
from gpumgr.manager.config import ManagerSettings
from gpumgr.manager.service import Manager
from tests.fake_agent import FakeAgent, GiB


@pytest.fixture
def served(tmp_path):
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
    yield manager, create_app(manager).test_client()
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
    refused = client.get("/v1/nodes", headers={"Accept-Encoding": "gzip;q=0"})
    assert "Content-Encoding" not in refused.headers and json.loads(refused.data) == json.loads(plain.data)
