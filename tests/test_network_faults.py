"""Network faults on the real CURVE link: a blip gives an agent a new routing id, a pipe fills, a peer goes silent.

Each test here reproduces a defect that wedged the manager (issue "Network faults"): a frame that
could not leave was failed on the link thread, its failure re-planned the same command, and the
link thread never polled again. They drive the in-process manager over real ZeroMQ sockets with
scripted agents, and end with the invariant.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from gpumgr.wire import protocol
from tests.fake_agent import FakeAgent, GiB, scripted_stack
from tests.invariant import model_violations
from tests.procs import wait_for

#: a call to a healthy node answers within this, whatever another node's network does
HEALTHY_CALL = 2.0


@pytest.fixture
def stack(tmp_path):
    with scripted_stack(tmp_path, create_timeout=2.0, remove_timeout=3.0, heartbeat_interval=5.0) as parts:
        yield parts


def _timed(pool: ThreadPoolExecutor, call, limit: float):
    """Run ``call`` on ``pool`` and return ``(response, seconds)``; fails (instead of hanging) past ``limit``."""
    started = time.monotonic()
    response = pool.submit(call).result(limit)
    return response, time.monotonic() - started


def test_a_delete_after_a_blip_is_carried_out_and_never_wedges_the_link(stack) -> None:
    """Before the fix: the DELETE answered 503, the link thread re-sent the Remove to the dead routing id
    forever (one core, 15,000 dropped frames a second), and a POST to a healthy node timed out."""
    manager, client, add_agent = stack
    a = add_agent("a")
    record = client.post("/v1/containers", json={"gpu_memory": "2GiB", "image": "img", "node": "a"}).json
    assert record["state"] == "running", record
    b = add_agent("b")
    a.blip()  # a new routing id for a's key; the manager has not heard from it yet
    with ThreadPoolExecutor(2) as pool:
        deleting = pool.submit(client.delete, f"/v1/containers/{record['id']}")
        time.sleep(0.3)
        # a healthy node is placed on at once, while a's command waits for a's next frame
        placed, took = _timed(pool, lambda: client.post("/v1/containers", json={
            "gpu_memory": "1GiB", "image": "img", "node": "b"}), HEALTHY_CALL + 1)
        assert placed.status_code == 201, placed.json
        assert took < HEALTHY_CALL
        a.heartbeat()  # a's first frame on its new connection: the Remove leaves on it
        deleted = deleting.result(10)
    assert deleted.status_code in (200, 202), deleted.json
    wait_for(lambda: record["id"] not in a.reports, 5, what="a's container to be removed after the blip")
    wait_for(lambda: client.get(f"/v1/containers/{record['id']}").json["state"] == "removed", 5,
             what="its record to end")
    assert b.reports  # b runs what it was given
    commands = [m for m in a.received if isinstance(m, protocol.Create | protocol.Remove)]
    assert len(commands) == 2 and all(m.op for m in commands)  # each names its operation, for the agent's dedupe
    assert len({m.op for m in commands}) == 2
    metrics = client.get("/metrics").get_data(as_text=True)
    lag = next(line for line in metrics.splitlines() if line.startswith("gpumgr_link_loop_lag_seconds "))
    assert float(lag.split()[1]) < 1.0  # the loop kept polling all along
    assert model_violations(manager, engines(a, b)) == []


def engines(*agents: FakeAgent) -> dict[str, dict[str, tuple[str, int]]]:
    """What each scripted agent runs, as the invariant reads an engine's truth."""
    return {agent.node: {grant: (report.state, report.gpu_memory) for grant, report in agent.reports.items()}
            for agent in agents}


def test_a_shrink_after_a_blip_waits_for_the_node_and_never_wedges_the_link(stack) -> None:
    """The same trap without a DELETE: a PATCH's failed send counted as not definitive and was sent again at once."""
    manager, client, add_agent = stack
    a = add_agent("a")
    record = client.post("/v1/containers", json={"gpu_memory": "4GiB", "image": "img", "node": "a"}).json
    b = add_agent("b")
    a.blip()
    with ThreadPoolExecutor(2) as pool:
        shrinking = pool.submit(client.patch, f"/v1/containers/{record['id']}", json={"gpu_memory": "2GiB"})
        time.sleep(0.3)
        placed, took = _timed(pool, lambda: client.post("/v1/containers", json={
            "gpu_memory": "1GiB", "image": "img", "node": "b"}), HEALTHY_CALL + 1)
        assert placed.status_code == 201 and took < HEALTHY_CALL, placed.json
        a.heartbeat()
        shrunk = shrinking.result(10)
    assert shrunk.status_code == 200 and shrunk.json["gpu_memory"] == 2 * GiB, shrunk.json
    assert a.reports[record["id"]].gpu_memory == 2 * GiB  # applied once, on the new connection
    assert model_violations(manager, engines(a, b)) == []


def test_a_delete_for_a_node_that_went_silent_answers_202_and_runs_when_it_returns(stack) -> None:
    """Its host died less than the down timeout ago: the Remove waits out its deadline, never a 503, never a spin."""
    manager, client, add_agent = stack
    a = add_agent("a")
    record = client.post("/v1/containers", json={"gpu_memory": "2GiB", "image": "img", "node": "a"}).json
    b = add_agent("b")
    a.blip()  # and then silence: nothing from a until it returns
    with ThreadPoolExecutor(2) as pool:
        deleting = pool.submit(client.delete, f"/v1/containers/{record['id']}")
        for _ in range(3):  # the healthy node is served at once, all the while
            placed, took = _timed(pool, lambda: client.post("/v1/containers", json={
                "gpu_memory": "1GiB", "image": "img", "node": "b"}), HEALTHY_CALL + 1)
            assert placed.status_code == 201 and took < HEALTHY_CALL, placed.json
        deleted = deleting.result(manager.settings.remove_timeout + 15)
    assert deleted.status_code == 202 and deleted.json["desired_state"] == "removed", deleted.json
    assert record["id"] in a.reports  # not removed yet: its node never heard of it
    a.heartbeat()  # back: the desired state is carried out
    wait_for(lambda: record["id"] not in a.reports, 10, what="the container removed once its node returned")
    wait_for(lambda: client.get(f"/v1/containers/{record['id']}").json["state"] == "removed", 5,
             what="its record to end")
    assert model_violations(manager, engines(a, b)) == []


def test_a_join_against_a_slow_store_never_holds_up_another_nodes_commands(stack, monkeypatch) -> None:
    """Every Join reads the join secret from the store (etcd with several managers), and any CURVE peer may
    send Joins: on the link's thread, a slow store stalled every node. The store is made slow here."""
    manager, client, add_agent = stack
    add_agent("a")
    newcomer = FakeAgent(manager.link.bound_endpoint, manager.admission.token(), node="late")
    read = manager.admission.store.join_secret

    def slow_secret() -> str:
        time.sleep(3)
        return read()

    monkeypatch.setattr(manager.admission.store, "join_secret", slow_secret)
    try:
        with ThreadPoolExecutor(2) as pool:
            joining = pool.submit(newcomer.join)
            time.sleep(0.2)
            placed, took = _timed(pool, lambda: client.post("/v1/containers", json={
                "gpu_memory": "1GiB", "image": "img", "node": "a"}), HEALTHY_CALL + 3)
            assert placed.status_code == 201 and took < HEALTHY_CALL, (placed.json, took)
            assert joining.result(10).ok  # and the slow join is still answered
    finally:
        newcomer.close()
