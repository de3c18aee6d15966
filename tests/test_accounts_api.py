"""Seeing accounts (issue 34): ``GET /v1/accounts``, the records' account fields, ``/metrics``, ``docker gpu
accounts``.

Real parts: a ``gpumgr manager`` process with accounts and tenants in its YAML config, a ``gpumgr agent``
process driving the Docker engine on one simulated 8 GiB GPU, real sockets, each tenant with its own
token; the document checks run an in-process manager over a real link with a scripted agent.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import requests
import schemathesis
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gpumgr.client import Client
from gpumgr.manager.tenancy.accounts import AccountConfig
from gpumgr.manager.tenancy.tenants import TenantConfig
from gpumgr.plugin import docker_gpu
from gpumgr.wire import protocol
from tests.fake_agent import FakeAgent, scripted_stack
from tests.procs import AgentProc, ManagerProc, wait_for

GiB = 1 << 30
OPERATOR = "operator-token-accounts-0123"
ALICE = "alice-token-accounts-01234567"
BOB = "bob-token-accounts-0123456789"
CAROL = "carol-token-accounts-012345678"
POLITE = "trap 'exit 0' TERM; while :; do sleep 1; done"
ACCOUNTS = {
    "research": {"quota": {"gpu_memory": "4GiB"}, "over_quota_weight": 3},
    "research/vision": {"quota": {"gpu_memory": "4GiB"}},
    "research/nlp": {},
    "prod": {"quota": {"gpu_memory": "2GiB"}},
}
#: What the stack's accounts show once alice holds 2 GiB and waits for 4 GiB more and bob borrows 3 GiB
#: of an 8 GiB GPU: quotas first (research 4, prod 2, of what each requests), then the 2 GiB left by
#: weight, 3 to 1 (research 1.5, prod 0.5); research's 5.5 all goes to vision, the one child asking.
EXPECTED = {  # name: (parent, fair share, allocated, requested, waiting), in GiB
    "default": (None, 0, 0, 0, 0),
    "prod": (None, 2.5, 3, 3, 0),
    "research": (None, 5.5, 2, 6, 4),
    "research/nlp": ("research", 0, 0, 0, 0),
    "research/vision": ("research", 5.5, 2, 6, 4),
}


def job(image: str, memory: str, **extra: Any) -> dict[str, Any]:
    return {"image": image, "gpu_memory": memory, "command": ["sh", "-c", POLITE], **extra}


def session(token: str) -> requests.Session:
    http = requests.Session()
    http.headers["Authorization"] = f"Bearer {token}"
    return http


@pytest.fixture
def stack(tmp_path: Path, test_image: str, cleanup_containers: None):
    """A manager with ``ACCOUNTS`` (alice in research/vision, bob in prod) and one agent with one 8 GiB GPU,
    in the state ``EXPECTED`` describes; yields the manager and the ids of alice's and bob's running containers."""
    config = tmp_path / "manager.yaml"
    config.write_text(yaml.safe_dump({"token": OPERATOR, "accounts": ACCOUNTS, "tenants": {
        "alice": {"token": ALICE, "account": "research/vision"}, "bob": {"token": BOB, "account": "prod"}}}))
    manager = ManagerProc(tmp_path, "--config", str(config), env={"GPUMGR_QUEUE_AGING": "3600"})
    manager.http.headers["Authorization"] = f"Bearer {OPERATOR}"
    agent = AgentProc(tmp_path, manager, "accounts-node", gpus="sim:1x8GiB")
    alice, bob = session(ALICE), session(BOB)
    mine = alice.post(manager.url + "/v1/containers", json=job(test_image, "2GiB"), timeout=90)
    assert mine.status_code == 201, mine.text
    borrowed = bob.post(manager.url + "/v1/containers", json=job(test_image, "3GiB", preemptible=True), timeout=90)
    assert borrowed.status_code == 201, borrowed.text
    waits = alice.post(manager.url + "/v1/containers", json=job(test_image, "4GiB", queue=True), timeout=90)
    assert waits.status_code == 202, waits.text
    yield manager, mine.json(), borrowed.json()
    agent.stop()
    manager.stop()


def test_accounts_list_the_tree_with_fair_shares_and_a_tenant_sees_only_its_path(stack):
    manager, mine, borrowed = stack
    accounts = manager.get("/v1/accounts").json()["accounts"]
    shown = {a["name"]: (a["parent"], a["fair_share"] / GiB, a["allocated"] / GiB, a["requested"] / GiB,
                         a["waiting"] / GiB) for a in accounts}
    assert shown == EXPECTED
    research = next(a for a in accounts if a["name"] == "research")
    assert research["quota"] == {"gpu_memory": 4 * GiB} and research["limit"] == {"gpu_memory": None}
    assert research["over_quota_weight"] == 3 and research["priority"] == 0 and research["reclaim_min_runtime"] == 60
    alice = session(ALICE).get(manager.url + "/v1/accounts", timeout=30).json()["accounts"]
    assert [a["name"] for a in alice] == ["research", "research/vision"]
    assert [a["name"] for a in session(BOB).get(manager.url + "/v1/accounts", timeout=30).json()["accounts"]] == \
        ["prod"]
    # the records say where each is counted and whether it borrows; none was reclaimed
    assert (mine["account"], mine["over_quota"], mine["reclaimed_for_account"]) == ("research/vision", False, None)
    assert (borrowed["account"], borrowed["over_quota"]) == ("prod", True)
    assert manager.get(f"/v1/containers/{borrowed['id']}").json()["over_quota"] is True
    # past its quota, prod borrows only with preemptible requests: one that will not wait is a 409 of its own
    # (what prod borrows uses none of its quota: 3 GiB more of its own 2 GiB is past it)
    refused = session(BOB).post(manager.url + "/v1/containers", json=job("unused", "3GiB"), timeout=90)
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "over_quota", refused.text
    # the Python client gives the same, typed
    typed = Client(manager.url, OPERATOR).accounts()
    assert {a.name: a.fair_share for a in typed} == {a["name"]: a["fair_share"] for a in accounts}
    assert next(a for a in typed if a.name == "prod").limit is None
    assert Client(manager.url, BOB).containers.get(borrowed["id"]).over_quota is True


def test_metrics_export_each_accounts_fair_share_allocation_and_request(stack):
    manager, _, _ = stack
    response = manager.get("/metrics")
    assert response.status_code == 200, response.text
    samples = {(s.name, s.labels.get("account")): s.value
               for family in text_string_to_metric_families(response.text) for s in family.samples
               if s.name.startswith("gpumgr_account_")}
    for name, (_, fair, allocated, requested, _) in EXPECTED.items():
        assert samples[("gpumgr_account_fair_share_bytes", name)] == fair * GiB, name
        assert samples[("gpumgr_account_allocated_bytes", name)] == allocated * GiB, name
        assert samples[("gpumgr_account_requested_bytes", name)] == requested * GiB, name
    assert len(samples) == 3 * len(EXPECTED)


def test_docker_gpu_accounts_prints_the_table_and_json(stack, monkeypatch, capsys):
    manager, _, _ = stack
    monkeypatch.setenv("GPUMGR_TOKEN", OPERATOR)
    assert docker_gpu.main(["gpu", "--manager", manager.url, "accounts"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "PARENT", "QUOTA", "LIMIT", "WEIGHT", "PRIORITY", "FAIR", "SHARE",
                                "ALLOCATED", "REQUESTED", "WAITING"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:]}
    assert list(rows) == list(EXPECTED)
    assert rows["research"] == ["-", "4GiB", "-", "3", "0", "5.5GiB", "2GiB", "6GiB", "4GiB"]
    assert rows["research/vision"][0] == "research" and rows["prod"][5:] == ["2.5GiB", "3GiB", "3GiB", "0B"]
    assert docker_gpu.main(["gpu", "--manager", manager.url, "accounts", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == manager.get("/v1/accounts").json()["accounts"]
    monkeypatch.setenv("GPUMGR_TOKEN", ALICE)
    assert docker_gpu.main(["gpu", "--manager", manager.url, "accounts", "--format=json"]) == 0
    assert [a["name"] for a in json.loads(capsys.readouterr().out)] == ["research", "research/vision"]
    assert docker_gpu.main(["gpu", "--manager", manager.url, "accounts", "--format", "yaml"]) == 1
    assert "usage: docker gpu accounts" in capsys.readouterr().err


def test_without_accounts_the_list_is_empty_and_nothing_is_exported(manager, monkeypatch, capsys):
    assert manager.get("/v1/accounts").json() == {"accounts": []}
    assert "gpumgr_account_" not in manager.get("/metrics").text
    assert docker_gpu.main(["gpu", "--manager", manager.url, "accounts"]) == 0
    assert capsys.readouterr().out == "no accounts are configured (the manager's YAML has no accounts: section)\n"
    assert docker_gpu.main(["gpu", "--manager", manager.url, "accounts", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == []


@pytest.mark.parametrize("accounts", [{"default": {"quota": {"gpu_memory": "1GiB"}}}, {}])
def test_the_answers_match_the_document(tmp_path, accounts):
    """The accounts list, a 201 record counted in an account, and the 409 over_quota, as the document says."""
    with scripted_stack(tmp_path, heartbeat_interval=60.0, accounts=accounts) as (_, client, add_agent):
        add_agent()
        doc = schemathesis.openapi.from_wsgi("/openapi.json", client.application)
        listed = client.get("/v1/accounts")
        doc["/v1/accounts"]["GET"].validate_response(listed)
        assert [a["name"] for a in listed.json["accounts"]] == (["default"] if accounts else [])
        made = client.post("/v1/containers", json={"image": "img", "gpu_memory": "2GiB", "preemptible": True})
        assert made.status_code == 201, made.json
        doc["/v1/containers"]["POST"].validate_response(made)
        assert (made.json["account"], made.json["over_quota"]) == (("default", True) if accounts else (None, False))
        refused = client.post("/v1/containers", json={"image": "img", "gpu_memory": "2GiB"})
        if accounts:  # default's quota is 1 GiB: a request past it borrows only if preemptible
            assert refused.status_code == 409 and refused.json["error"]["code"] == "over_quota", refused.json
        doc["/v1/containers"]["POST"].validate_response(refused)


def test_the_typed_account_has_every_field_of_its_response_shape():
    from gpumgr import client_types
    from gpumgr.manager.api import openapi

    fields = {f.name for f in dataclasses.fields(client_types.Account)} - {"raw"}
    assert fields == set(openapi.AccountView.model_fields)


def hook_grant(agent: FakeAgent, container: str, tenant: str = "") -> str:
    """The grant ``agent``'s runtime hook gets for ``container`` (one letter): as a ``hook_tenant`` node forwards a
    plain ``docker run`` (``tenant``), or a Swarm task (no tenant: the operator's)."""
    before = len(agent.received)
    agent.send(protocol.Reserve(container_id=container * 64, gpu_memory=GiB, node=agent.node, tenant=tenant))
    reply = wait_for(lambda: next((m for m in list(agent.received)[before:] if isinstance(m, protocol.Reply)
                                   and m.result.get("grant")), None), 10, what=f"the hook grant for {container}")
    return str(reply.result["grant"])


def test_who_is_counted_where_and_a_tenant_cap_is_not_an_account_quota(tmp_path):
    """Issue 34's rules of belonging on one manager: a hook grant counts in its ``hook_tenant``'s account; a
    Swarm task's, the operator's own request and a tenant without ``account`` count in ``default``. A tenant
    past its own hard cap gets ``403 quota_exceeded`` (queue or not, preemptible or not); a request that passes
    its account's quota, not preemptible, gets ``409 over_quota``, and with ``queue: true`` waits (202)."""
    accounts = {"research": AccountConfig(quota={"gpu_memory": "4GiB"}),
                "default": AccountConfig(quota={"gpu_memory": "4GiB"})}
    tenants = {"alice": TenantConfig(token=ALICE, account="research", gpu_memory="3GiB"),
               "bob": TenantConfig(token=BOB, account="research"), "carol": TenantConfig(token=CAROL)}
    with scripted_stack(tmp_path, heartbeat_interval=60.0, token=OPERATOR, accounts=accounts,
                        tenants=tenants) as (_, client, add_agent):
        agent = add_agent("hooked", gpus=1, size=16 * GiB)

        def post(token: str, memory: str, **extra: Any) -> Any:
            return client.post("/v1/containers", json={"image": "img", "gpu_memory": memory, **extra},
                               headers={"Authorization": f"Bearer {token}"})

        def record(cid: str) -> tuple[str | None, str | None]:
            shown = client.get(f"/v1/containers/{cid}", headers={"Authorization": f"Bearer {OPERATOR}"}).json
            return shown["tenant"], shown["account"]

        assert record(hook_grant(agent, "a", tenant="alice")) == ("alice", "research")
        assert record(hook_grant(agent, "b")) == (None, "default")  # a Swarm task: the operator's
        for token, tenant in ((OPERATOR, None), (CAROL, "carol")):
            made = post(token, "1GiB")
            assert made.status_code == 201, made.json
            assert (made.json["tenant"], made.json["account"]) == (tenant, "default")
        # alice holds 1 GiB (her hook grant) of her own 3 GiB cap: 3 GiB more passes it, though research has room
        for extra in ({}, {"queue": True}, {"preemptible": True}):
            capped = post(ALICE, "3GiB", **extra)
            assert capped.status_code == 403 and capped.json["error"]["code"] == "quota_exceeded", (extra, capped.json)
        # bob has no cap, but research (quota 4 GiB) holds 1 GiB: 4 GiB more passes its quota; preemptible, it
        # borrows the idle room (which uses none of the quota); not preemptible, it is refused, or waits
        borrows = post(BOB, "4GiB", preemptible=True)
        assert borrows.status_code == 201 and borrows.json["over_quota"] is True, borrows.json
        refused = post(BOB, "4GiB")
        assert refused.status_code == 409 and refused.json["error"]["code"] == "over_quota", refused.json
        waits = post(BOB, "4GiB", queue=True)
        assert waits.status_code == 202 and waits.json["state"] == "queued", waits.json
        assert (waits.json["tenant"], waits.json["account"]) == ("bob", "research")
        shown = {a["name"]: a for a in client.get("/v1/accounts", headers={"Authorization": f"Bearer {OPERATOR}"})
                 .json["accounts"]}
        assert (shown["default"]["allocated"], shown["default"]["waiting"]) == (3 * GiB, 0)
        assert (shown["research"]["allocated"], shown["research"]["waiting"]) == (5 * GiB, 4 * GiB)
