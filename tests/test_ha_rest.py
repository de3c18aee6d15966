"""Any manager answers: REST on a follower, with and without a leader, and clients given several managers."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from werkzeug.serving import make_server

from gpumgr.manager import forward
from gpumgr.manager.api.app import create_app
from gpumgr.manager.config import ManagerSettings
from gpumgr.manager.control.leadership import Leadership
from gpumgr.manager.service import Manager
from gpumgr.plugin.docker_gpu import Manager as Client
from gpumgr.plugin.docker_gpu import PluginError
from tests.ha_procs import shared_state
from tests.procs import free_port, wait_for


def started(tmp_path: Any, url: str, name: str, **extra: Any) -> Manager:
    manager = Manager(ManagerSettings(store=url, state_dir=shared_state(tmp_path, name),
                                      agents=f"tcp://127.0.0.1:{free_port()}",
                                      advertise_api=f"http://127.0.0.1:{free_port()}", **extra))
    manager.start()
    return manager


@pytest.fixture
def store_url(etcd) -> str:
    return "etcd://" + etcd.endpoints[0].removeprefix("http://") + "/rest"


@pytest.fixture
def served(tmp_path, store_url) -> Iterator[Manager]:
    """A leading manager whose API is served at the URL it advertises."""
    leader = started(tmp_path, store_url, "leader")
    wait_for(lambda: leader.leading.loaded, 10, what="the leader to lead")
    api = leader.settings.advertise_api or ""
    server = make_server("127.0.0.1", int(api.rsplit(":", 1)[1]), create_app(leader), threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield leader
    server.shutdown()
    leader.stop()


def test_a_follower_forwards_calls_and_says_who_leads(served, tmp_path, store_url) -> None:
    follower = started(tmp_path, store_url, "follower")
    try:
        wait_for(lambda: follower.plane.leader() is not None, 10, what="the follower to see the leader")
        client = create_app(follower).test_client()
        nodes = client.get("/v1/nodes")
        assert nodes.status_code == 200 and nodes.get_json()["nodes"] == []
        bad = client.post("/v1/containers", json={"gpu_memory": "lots"})  # the leader's own 4xx comes back
        assert bad.status_code == 400 and bad.get_json()["error"]["code"]
        health = client.get("/healthz").get_json()
        assert health["role"] == "follower" and health["leader"] == served.settings.advertise_api
        assert health["epoch"] is None and health["version"] and "warning" not in health
        mine = create_app(served).test_client().get("/healthz").get_json()
        assert mine["role"] == "leader" and mine["epoch"] == str(served.plane.epoch)
        assert mine["tenants_digest"] == health["tenants_digest"]
    finally:
        follower.stop()


def test_a_follower_with_other_tenants_says_so_loudly(served, tmp_path, store_url, caplog) -> None:
    odd = started(tmp_path, store_url, "odd", token="another-operator-token-0123456789")
    try:
        wait_for(lambda: odd.plane.leader() is not None, 10, what="the follower to see the leader")
        health = create_app(odd).test_client().get("/healthz").get_json()
        assert health["tenants_digest"] != forward.tenants_digest(served)
        assert "differ from the leader's" in health["warning"]
        assert any("differ from the leader's" in r.getMessage() for r in caplog.records if r.levelname == "ERROR")
    finally:
        odd.stop()


def test_a_follower_whose_tenants_differ_logs_it_unasked_until_they_match(served, tmp_path, store_url, caplog,
                                                                          monkeypatch) -> None:
    """Issue 21: the mismatch is said loudly in the follower's log, without anyone reading its /healthz."""
    monkeypatch.setattr(forward, "DIGEST_EVERY", 0.2)

    def said(text: str, level: str) -> bool:
        return any(text in r.getMessage() for r in caplog.records if r.levelname == level)

    odd = started(tmp_path, store_url, "odd", token="another-operator-token-0123456789")
    try:
        wait_for(lambda: said("differ from the leader's", "ERROR"), 10, what="the follower's error line")
        errors = sum("differ from the leader's" in r.getMessage() for r in caplog.records)
        odd.reload_tenants(odd.settings.model_copy(update={"token": served.settings.token}))  # the file fixed
        wait_for(lambda: said("match the leader's again", "WARNING"), 10, what="the follower to say they match")
        assert odd._digests is not None and odd._digests.mismatch is None
        later = sum("differ from the leader's" in r.getMessage() for r in caplog.records)
        assert later == errors, "a mismatch said again after the tenants were fixed"
    finally:
        odd.stop()


def test_while_no_manager_leads_a_call_is_held_then_answered_503_no_leader(etcd, tmp_path, store_url,
                                                                           monkeypatch) -> None:
    # a leader that publishes no API: nobody to forward to, as while a dead leader's lease runs out
    ghost = Leadership(etcd.client(), "ghost", prefix="/rest/")
    ghost.start()
    wait_for(lambda: ghost.is_leader, 10, what="the ghost to lead")
    monkeypatch.setattr(forward, "HOLD", 0.5)
    follower = started(tmp_path, store_url, "follower")
    try:
        wait_for(lambda: follower.plane.leader() is not None, 10, what="the follower to see the ghost")
        answer = create_app(follower).test_client().post("/v1/containers", json={"gpu_memory": "1GiB"})
        assert answer.status_code == 503 and answer.get_json()["error"]["code"] == "no_leader"
        assert answer.headers["Retry-After"] == "1"
    finally:
        follower.stop()
        ghost.stop()


def test_the_plugin_tries_the_next_manager_it_was_given(manager) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    client = Client(f"{dead}, {manager.url}")
    assert "nodes" in client.call("GET", "/v1/nodes")
    assert client.client.api.url == manager.url
    with pytest.raises(PluginError, match="GPUMGR_MANAGER"):
        Client(f"{dead},http://127.0.0.1:{free_port()}").call("GET", "/v1/nodes")


def test_the_tenants_digest_is_keyed_by_the_managers_secret_key(tmp_path) -> None:
    # /healthz is open: with the same tenants and token, only managers holding the same key pair agree
    same = {"token": "weak", "agents": "tcp://127.0.0.1:1"}
    one = Manager(ManagerSettings(state_dir=str(tmp_path / "one"), **same))
    other = Manager(ManagerSettings(state_dir=str(tmp_path / "other"), **same))
    twin = Manager(ManagerSettings(state_dir=shared_state(tmp_path, "twin"), **same))
    twin_too = Manager(ManagerSettings(state_dir=shared_state(tmp_path, "twin-too"), **same))
    assert forward.tenants_digest(one) != forward.tenants_digest(other)
    assert forward.tenants_digest(twin) == forward.tenants_digest(twin_too)
