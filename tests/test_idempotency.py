"""``Idempotency-Key`` on ``POST /v1/containers`` (issue 31): an in-process manager on a real agent link,
with scripted agents on real sockets, its state directory on disk, and a clock the test moves by hand.

What a create carried out with a key answers to a repeat, per principal, for a day, across a restart.
"""

from __future__ import annotations

import threading
import uuid
from pathlib import Path
from typing import Any

import pytest

from gpumgr.manager.api.app import create_app
from gpumgr.manager.api.idempotent import PURGE_EVERY, SETTLE
from gpumgr.manager.clock import Clock
from gpumgr.manager.config import ManagerSettings
from gpumgr.manager.control.idempotency import FOLDER, TTL
from gpumgr.manager.service import Manager
from gpumgr.wire import protocol
from tests.fake_agent import FakeAgent, scripted_stack
from tests.procs import wait_for

OPERATOR = "operator-token-0123456789"
ALICE = "alice-token-0123456789abcdef"
BOB = "bob-token-0123456789abcdefgh"
UNKNOWN = {"outcome_unknown", "agent_timeout"}  # what a create nobody answered is called, before and after issue 31


class Hand(Clock):
    """A clock that moves only when the test says so (both its wall and its monotonic reading)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def monotonic(self) -> float:
        return super().monotonic() + self.offset

    def time(self) -> float:
        return super().time() + self.offset


def body(**extra):
    return {"gpu_memory": "1GiB", "image": "busybox", "command": ["true"], **extra}


def post(client, data, key=None, token=OPERATOR, **kw):
    headers = {"Authorization": f"Bearer {token}"}
    if key is not None:
        headers["Idempotency-Key"] = key
    return client.post("/v1/containers", json=data, headers=headers, **kw)


def creates(agent: FakeAgent) -> list[protocol.ContainerSpec]:
    return [m.spec for m in agent.received if isinstance(m, protocol.Create)]


@pytest.fixture
def stack(tmp_path):
    tenants = {"alice": {"token": ALICE}, "bob": {"token": BOB}}
    with scripted_stack(tmp_path, create_timeout=2.0, heartbeat_interval=0.2, token=OPERATOR,
                        tenants=tenants) as (manager, client, add_agent):
        clock = Hand()
        app = client.application
        app.extensions["gpumgr.idempotency"].clock = clock
        yield manager, client, add_agent, clock


def test_a_repeat_gets_the_first_answer_and_runs_nothing(stack) -> None:
    manager, client, add_agent, _ = stack
    agent = add_agent()
    key = str(uuid.uuid4())
    first = post(client, body(name="once"), key)
    assert first.status_code == 201, first.json
    assert "Idempotent-Replayed" not in first.headers
    again = post(client, body(name="once"), key)
    assert again.status_code == 201 and again.json == first.json
    assert again.headers["Idempotent-Replayed"] == "true"
    assert len(creates(agent)) == 1
    assert len(manager.cluster.containers()) == 1
    # the fields in another order are the same request
    reordered = dict(reversed(list(body(name="once").items())))
    assert post(client, reordered, key).json == first.json
    # a refusal once the key was claimed is the key's answer too: the same 409, and nothing placed
    big = str(uuid.uuid4())
    refused = post(client, body(gpu_memory="100GiB"), big)
    assert refused.status_code == 409 and refused.json["error"]["code"] == "never_fits"
    assert post(client, body(gpu_memory="100GiB"), big).json == refused.json


def test_the_same_key_with_another_body_is_422(stack) -> None:
    _, client, add_agent, _ = stack
    agent = add_agent()
    key = str(uuid.uuid4())
    assert post(client, body(name="first"), key).status_code == 201
    other = post(client, body(name="second"), key)
    assert other.status_code == 422, other.json
    assert other.json["error"]["code"] == "idempotency_mismatch" and "new key" in other.json["error"]["message"]
    assert [s.name for s in creates(agent)] == ["first"]


@pytest.mark.parametrize("value, words", [
    ("", "empty"),
    ("x" * 256, "256 characters"),
    ("has space", "printable ASCII"),
    ("caf\u00e9", "printable ASCII"),
])
def test_a_malformed_key_is_a_400_that_says_what(stack, value, words) -> None:
    _, client, add_agent, _ = stack
    agent = add_agent()
    headers = {"Authorization": f"Bearer {OPERATOR}", "Idempotency-Key": value.encode("utf-8").decode("latin-1")}
    answer = client.post("/v1/containers", json=body(), headers=headers)
    assert answer.status_code == 400, answer.json
    assert answer.json["error"]["code"] == "invalid_idempotency_key" and words in answer.json["error"]["message"]
    assert creates(agent) == []


def test_keys_are_per_principal(stack) -> None:
    _manager, client, add_agent, _ = stack
    agent = add_agent()
    key = "shared-key-1"
    answers = [post(client, body(), key, token=token) for token in (ALICE, BOB, OPERATOR)]
    assert [a.status_code for a in answers] == [201, 201, 201]
    assert len({a.json["id"] for a in answers}) == 3 and len(creates(agent)) == 3
    assert [a.json["tenant"] for a in answers] == ["alice", "bob", None]
    # each principal's repeat gets its own first answer
    assert post(client, body(), key, token=BOB).json == answers[1].json
    # the operator acting for alice is still the operator's key (so another body under it: a mismatch)
    assert post(client, body(tenant="alice"), key, token=OPERATOR).status_code == 422
    assert len(creates(agent)) == 3


def test_a_repeat_while_the_first_runs_is_409_in_progress(stack) -> None:
    manager, client, add_agent, _clock = stack
    agent = add_agent(behaviour="silent")
    key = str(uuid.uuid4())
    first: list = []
    thread = threading.Thread(target=lambda: first.append(post(client, body(), key)))
    thread.start()
    wait_for(lambda: creates(agent), what="the create at the agent")
    during = post(client, body(), key)
    assert during.status_code == 409, during.json
    assert during.json["error"]["code"] == "in_progress" and during.headers["Retry-After"] == "1"
    thread.join(10)
    assert first[0].status_code in (502, 504) and first[0].json["error"]["code"] in UNKNOWN
    # nobody knows: the key stays in progress, and a repeat is not run again while the create may still land
    after = post(client, body(), key)
    assert after.status_code == 409 and after.json["error"]["code"] == "in_progress", after.json
    assert len(creates(agent)) == 1
    # the create landed after all: once its node reports the container, the repeat is answered with that record
    # (whatever the manager did with it since: a container whose create timed out may have been removed)
    spec = creates(agent)[0]
    agent.reports[spec.grant] = protocol.ContainerReport(grant=spec.grant, container_id=spec.grant * 4,
                                                         name=spec.name, gpus=spec.gpus, gpu_memory=spec.gpu_memory,
                                                         state="running")
    agent.send(protocol.Register(node=agent.node, runtime="docker", gpus=agent.gpus,
                                 containers=list(agent.reports.values())))
    wait_for(lambda: manager.cluster.get(spec.grant).state != "creating", what="the late container on the map")
    ran = post(client, body(), key)
    assert ran.status_code == 201 and ran.json["id"] == spec.grant, ran.json
    assert ran.headers["Idempotent-Replayed"] == "true" and post(client, body(), key).json == ran.json
    assert len(creates(agent)) == 1


def test_keys_expire_after_a_day_and_are_purged(stack, tmp_path: Path) -> None:
    _manager, client, add_agent, clock = stack
    agent = add_agent()
    kept = tmp_path / "state" / FOLDER
    first = post(client, body(), "day-old")
    assert first.status_code == 201 and len(list(kept.glob("*.json"))) == 1
    clock.offset += TTL - 60
    assert post(client, body(), "day-old").json == first.json  # still within its day
    clock.offset += 120
    assert len(list(kept.glob("*.json"))) == 1  # the hourly purge has not run yet
    fresh = post(client, body(), "day-old")  # its day is over: the key is new again
    assert fresh.status_code == 201 and fresh.json["id"] != first.json["id"] and len(creates(agent)) == 2
    post(client, body(), "another")
    clock.offset += TTL + PURGE_EVERY
    post(client, body(name="late"), "third")  # the request that finds the hour over purges the expired keys
    assert len(list(kept.glob("*.json"))) == 1


def test_a_key_survives_a_restart_and_its_container_answers_the_repeat(tmp_path: Path) -> None:
    """A create sent just before the manager went away: the next manager finds the key in the state directory,
    the record id it names on the map once the node reports the container, and answers with it."""
    settings = ManagerSettings(agents="tcp://127.0.0.1:0", state_dir=str(tmp_path / "state"), create_timeout=1.0,
                               heartbeat_interval=60.0)  # the scripted agent sends no heartbeats
    first = Manager(settings)
    first.start()
    try:
        agent = FakeAgent(first.link.bound_endpoint, first.admission.token(), behaviour="silent")
        agent.register()
        stop = threading.Event()
        serving = agent.serve(stop)
        client = create_app(first).test_client()
        answers: dict[str, Any] = {}
        sends = [threading.Thread(target=lambda k=k, b=b: answers.update({k: client.post(
            "/v1/containers", json=b, headers={"Idempotency-Key": k})})) for k, b in (("k-restart", body()),
                                                                                    ("k-done", body(name="done")))]
        for send in sends:  # both at once: each waits out the create's timeout
            send.start()
        for send in sends:
            send.join(60)
        assert {answers[k].json["error"]["code"] in UNKNOWN for k in ("k-restart", "k-done")} == {True}
        stop.set()
        serving.join(2)
    finally:
        first.stop()
    sent = {s.name: s for s in creates(agent)}
    assert len(sent) == 2
    # the node ran the first create (it reports it), the second never reached its engine
    spec = next(s for name, s in sent.items() if name != "done")
    agent.close()
    second = Manager(settings)
    second.start()
    try:
        back = FakeAgent(second.link.bound_endpoint, second.admission.token(), keys=agent.keys)
        back.joined = True
        back.reports[spec.grant] = protocol.ContainerReport(
            grant=spec.grant, container_id=spec.grant * 4, name=spec.name, gpus=spec.gpus,
            gpu_memory=spec.gpu_memory, state="running")
        back.register()
        stop = threading.Event()
        back.serve(stop)
        client = create_app(second).test_client()
        repeat = client.post("/v1/containers", json=body(), headers={"Idempotency-Key": "k-restart"})
        assert repeat.status_code == 201, repeat.json
        assert repeat.json["id"] == spec.grant and repeat.headers["Idempotent-Replayed"] == "true"
        assert creates(back) == []
        # the key that never ran: in progress until the map has settled, then run by the repeat
        waiting = client.post("/v1/containers", json=body(name="done"), headers={"Idempotency-Key": "k-done"})
        assert waiting.status_code == 409 and waiting.json["error"]["code"] == "in_progress"
        hand = Hand()
        hand.offset = SETTLE + second.settings.create_timeout + 11
        client.application.extensions["gpumgr.idempotency"].clock = hand
        ran = client.post("/v1/containers", json=body(name="done"), headers={"Idempotency-Key": "k-done"})
        assert ran.status_code == 201 and ran.json["id"] != sent["done"].grant, ran.json
        assert [s.name for s in creates(back)] == ["done"]
        stop.set()
    finally:
        second.stop()
