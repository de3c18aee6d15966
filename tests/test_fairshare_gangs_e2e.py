"""A gang in fair share end to end (issues 34 and 35): one account's preemptible burst fills an idle cluster; a
gang of a second account, within its fair share, waits and is reclaimed for as one request of its whole bytes, so
that it starts whole, and no more is stopped than it needs.

Real parts: a ``gpumgr manager`` process with ``accounts:`` in its YAML, four ``gpumgr agent`` processes of one
simulated GPU each driving the Docker engine, real containers stopped by reclaim, the members' rendezvous read
back with ``docker inspect``, and the invariant at the end.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import test_accounts_e2e as accounts_e2e
from tests.invariant import settles
from tests.procs import AgentProc, wait_for
from tests.test_accounts_e2e import MIN_RUNTIME, GiB, ask, held
from tests.test_gangs_e2e import env_of
from tests.test_tenants import ALICE, BOB, OPERATOR, POLITE, Client, operator_manager

NODES = [f"fairgang-{n}" for n in range(4)]
#: research as in the accounts' end-to-end test; prod's quota is exactly the gang's 3 x 4 GiB of the 32 GiB
ACCOUNTS = {**accounts_e2e.ACCOUNTS, "prod": {**accounts_e2e.ACCOUNTS["prod"], "quota": {"gpu_memory": "12GiB"}}}
TENANTS = {"alice": {"token": ALICE, "account": "research"}, "bob": {"token": BOB, "account": "prod"}}


@pytest.fixture
def cluster(tmp_path: Path, test_image, cleanup_containers):
    """A manager with accounts research (alice) and prod (bob), and four agents of one 8 GiB GPU each."""
    config = tmp_path / "manager.yaml"
    config.write_text(yaml.safe_dump({"token": OPERATOR, "accounts": ACCOUNTS, "tenants": TENANTS}))
    manager = operator_manager(tmp_path, config, env={"GPUMGR_QUEUE_AGING": "3600"})
    agents = [AgentProc(tmp_path, manager, node, gpus="sim:1x8GiB", wait=False) for node in NODES]
    for agent in agents:  # started together, waited for together
        agent.wait_ready()
    yield manager
    for agent in agents:
        agent.stop()
    manager.stop()


def records(client: Client, ids: list[str]) -> list[dict[str, Any]]:
    return [client.call("GET", f"/v1/containers/{c}").json() for c in ids]


def test_a_gang_below_its_fair_share_is_reclaimed_for_whole_and_nothing_more_is_stopped(
        cluster, test_image, docker_client) -> None:
    manager = cluster
    operator, alice, bob = Client(manager, OPERATOR), Client(manager, ALICE), Client(manager, BOB)
    burst = ask(alice, test_image, 8)  # two per GPU: the whole idle cluster, 24 of its 32 GiB borrowed
    wait_for(lambda: held(operator)["research"] == 32 * GiB, 60, what="the burst running")
    assert sum(r["over_quota"] for r in records(alice, burst)) == 6
    submitted = time.monotonic()
    answer = bob.call("POST", "/v1/gangs", json={"image": test_image, "gpu_memory": "4GiB", "replicas": 3,
                                                 "queue": True, "command": ["sh", "-c", POLITE]})
    assert answer.status_code == 202 and answer.json()["state"] == "queued", answer.text
    gid = answer.json()["id"]
    again = ask(alice, test_image, 3)  # research asks again at once, for as much as the gang needs
    shares = {a["name"]: a["fair_share"] for a in operator.call("GET", "/v1/accounts").json()["accounts"]}
    assert shares["research"] == 20 * GiB and shares["prod"] == 12 * GiB  # the gang's 12 GiB fit prod's share

    view = wait_for(lambda: (v := operator.call("GET", f"/v1/gangs/{gid}").json())["state"] == "running" and v,
                    MIN_RUNTIME + 30, what="the gang running")
    took = time.monotonic() - submitted
    members = records(operator, view["members"])
    assert [(m["state"], m["rank"], m["gang"], m["account"]) for m in members] == [
        ("running", rank, gid, "prod") for rank in range(3)]
    assert len({m["node"] for m in members}) == 3  # whole, one member per node
    for member in members:
        env = env_of(docker_client, member)
        assert (env["GPUMGR_GANG"], env["GPUMGR_GANG_RANK"], env["GPUMGR_GANG_SIZE"]) == (gid, str(member["rank"]), "3")

    # just enough: one over-quota container stopped on each node a member went to, research keeps the other five
    victims = [r for r in records(operator, burst) if r["state"] == "preempted"]
    assert len(victims) == 3 and {v["node"] for v in victims} == {m["node"] for m in members}
    for victim in victims:
        assert (victim["reason"], victim["reclaimed_for_account"]) == ("reclaimed", "prod")
        assert victim["preempted_for"] == gid  # the gang, not one of its members
        assert victim["over_quota"] and victim["container_id"] not in {c.id for c in docker_client.containers.list()}
    assert sum(r["state"] == "running" for r in records(operator, burst)) == 5
    assert held(operator) == {"research": 20 * GiB, "prod": 12 * GiB, "default": 0}
    assert {r["state"] for r in records(alice, again)} == {"queued"}  # the freed room went to the gang

    time.sleep(2 * MIN_RUNTIME)  # settled: nothing more is reclaimed while research keeps asking
    assert held(operator) == {"research": 20 * GiB, "prod": 12 * GiB, "default": 0}
    stopped = [e for e in operator.call("GET", "/v1/events", params={"type": "preempted"}).json()["events"]
               if e.get("final")]
    assert len(stopped) == 3 and {r["state"] for r in records(alice, again)} == {"queued"}
    print(f"the gang ran whole {took:.1f}s after its submit, {took - MIN_RUNTIME:.1f}s past reclaim_min_runtime "
          f"({MIN_RUNTIME}s)")
    settles(manager, docker_client, set(NODES))

    for cid in again:
        assert alice.call("DELETE", f"/v1/containers/{cid}").status_code == 200
    assert operator.call("DELETE", f"/v1/gangs/{gid}").json()["state"] == "removed"
    wait_for(lambda: {r["state"] for r in records(operator, view["members"])} == {"removed"}, 20,
             what="every member removed")
    assert not {m["container_id"] for m in members} & {c.id for c in docker_client.containers.list(all=True)}
    settles(manager, docker_client, set(NODES))
