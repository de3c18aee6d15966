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
from gpumgr.plugin import docker_gpu
from tests.fake_agent import scripted_stack
from tests.procs import AgentProc, ManagerProc

GiB = 1 << 30
OPERATOR = "operator-token-accounts-0123"
ALICE = "alice-token-accounts-01234567"
BOB = "bob-token-accounts-0123456789"
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
