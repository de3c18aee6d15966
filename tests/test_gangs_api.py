"""``POST /v1/gangs`` at the REST edge (issue 35): a bad body is a 400 saying what was wrong, the names gpumgr sets
(``GPUMGR_GANG*``, ``PET_*``) are refused, and the operator's policy must allow a gang's network (a 403 otherwise).

An in-process manager on a real agent link with a scripted agent of two GPUs that starts whatever it is sent
(``tests/fake_agent.py``): a refused body must reach no node, and an allowed one is placed and its creates read.
"""

from __future__ import annotations

from typing import Any

import pytest

from gpumgr.manager.tenancy.tenants import TenantConfig
from gpumgr.wire import protocol
from gpumgr.wire.policy import Policy
from tests.fake_agent import FakeAgent, scripted_stack

OPERATOR = "operator-token-0123456789"
ALICE = "alice-token-0123456789abcdef"
BOB = "bob-token-0123456789abcdefgh"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """Alice is under the default policy (the network ``train`` only); Bob's own policy allows host networking."""
    tenants = {"alice": TenantConfig(token=ALICE), "bob": TenantConfig(token=BOB, policy=Policy(host_network=True))}
    with scripted_stack(tmp_path_factory.mktemp("gangs-api"), token=OPERATOR, tenants=tenants,
                        policy=Policy(networks=["train"])) as (manager, client, add_agent):
        yield manager, client, add_agent("fake", gpus=2)


def post(stack, token: str, **fields: Any):
    _, client, _ = stack
    body = {"image": "img", "gpu_memory": "1GiB", "replicas": 2, "one_per_node": False, **fields}
    return client.post("/v1/gangs", json=body, headers={"Authorization": f"Bearer {token}"})


def creates(agent: FakeAgent) -> list[protocol.Create]:
    return [m for m in list(agent.received) if isinstance(m, protocol.Create)]


BAD = [
    ({"replicas": 1}, ["replicas"]),
    ({"replicas": 257}, ["replicas"]),
    ({"replicas": "2"}, ["replicas"]),
    ({"replicas": None}, ["replicas"]),
    ({"restart": "always"}, ["restart"]),
    ({"max_restarts": 2}, ["max_restarts", "restart: gang"]),
    ({"restart": "gang", "max_restarts": -1}, ["max_restarts"]),
    ({"one_per_node": "yes"}, ["one_per_node"]),
    ({"queue": True, "queue_timeout": -1}, ["queue_timeout"]),
    ({"compute_share": 50}, ["compute_share"]),
    # the prefixes are reserved, not only the names gpumgr sets today
    ({"env": {"PET_MASTER_PORT": "1", "PET_LOCAL_ADDR": "x", "GPUMGR_GANGWAY": "y", "PETS": "ok"}},
     ["PET_MASTER_PORT", "PET_LOCAL_ADDR", "GPUMGR_GANGWAY"]),
]


@pytest.mark.parametrize(("fields", "words"), BAD)
def test_a_bad_gang_body_is_a_400_naming_what_is_wrong_and_reaches_no_node(stack, fields, words) -> None:
    manager, _, agent = stack
    before, gangs = len(creates(agent)), len(manager.cluster.gangs.gangs)
    response = post(stack, OPERATOR, **fields)
    assert response.status_code == 400, response.json
    error = response.json["error"]
    assert error["code"] == "invalid_request" and all(w in error["message"] for w in words), error
    assert "PETS" not in error["message"]  # a name that only looks alike is the user's own
    assert len(creates(agent)) == before and len(manager.cluster.gangs.gangs) == gangs


def test_the_operators_policy_must_allow_a_gangs_network(stack) -> None:
    _, client, agent = stack
    for token, network, rule in ((ALICE, "host", "host_network"), (ALICE, "elsewhere", "networks")):
        refused = post(stack, token, network=network)
        assert refused.status_code == 403, refused.json
        assert (refused.json["error"]["code"], refused.json["error"]["rule"]) == ("policy_denied", rule)
    sent = len(creates(agent))
    for token, network in ((BOB, "host"), (ALICE, "train")):
        made = post(stack, token, network=network, name=f"job-{network}")
        assert made.status_code == 201, made.json
        members = [m.spec for m in creates(agent)[sent:]]
        sent += len(members)
        assert [m.name for m in members] == [f"job-{network}-0", f"job-{network}-1"]
        masters = {m.env["PET_MASTER_ADDR"] for m in members}
        # host networking: rank 0's node at its agent's address, NCCL kept off Docker's bridges and loopback;
        # a named network: rank 0's container name on it
        assert masters == ({"job-train-0"} if network == "train" else {made.json["master_addr"]}), masters
        assert {m.env.get("NCCL_SOCKET_IFNAME") for m in members} == {"^docker,lo" if network == "host" else None}
        assert client.delete(f"/v1/gangs/{made.json['id']}",
                             headers={"Authorization": f"Bearer {token}"}).json["state"] == "removed"


def test_a_member_create_no_node_answers_is_a_502_as_a_containers_and_the_gang_ends_without_restarting(tmp_path):
    with scripted_stack(tmp_path, create_timeout=1.0, remove_timeout=1.0) as (_, client, add_agent):
        add_agent("silent", gpus=2, behaviour="silent")  # an agent that never answers a create
        answer = client.post("/v1/gangs", json={"image": "img", "gpu_memory": "1GiB", "replicas": 2,
                                                "one_per_node": False, "restart": "gang", "max_restarts": 1})
        assert answer.status_code == 502 and answer.json["error"]["code"] == "outcome_unknown", answer.json
        (gang,) = client.get("/v1/gangs").json["gangs"]
        assert gang["state"] == "removed" and gang["restart_count"] == 0  # ended whole, not placed again
        for cid in gang["members"]:  # each member is to be removed, as an unanswered container's DELETE is
            assert client.get(f"/v1/containers/{cid}").json["desired_state"] == "removed"
