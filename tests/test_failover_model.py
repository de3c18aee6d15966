"""Failover without surprises, driven on cue: a real manager in this process on a real etcd, a scripted agent
on a real socket (issue 31). The end-to-end cases on real processes are in ``tests/faults/test_failover_truth.py``;
here the store is made to fail exactly where a dispatch or a request writes to it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from gpumgr.manager.control.etcdv3 import StoreUnavailable
from gpumgr.manager.model.records import PlacementSpec
from gpumgr.manager.service import Manager
from gpumgr.wire import protocol
from gpumgr.wire.errors import GpumgrError
from gpumgr.wire.names import State
from tests.fake_agent import FakeAgent, GiB
from tests.procs import wait_for
from tests.test_ha_manager import settings


@pytest.fixture
def leader(etcd, tmp_path) -> Iterator[tuple[Manager, FakeAgent, threading.Event]]:
    url = "etcd://" + etcd.endpoints[0].removeprefix("http://") + "/truth"
    manager = Manager(settings(tmp_path, url, "m1"))
    manager.start()
    wait_for(lambda: manager.leading.loaded, 10, what="the manager to lead")
    agent = FakeAgent(manager.settings.agents, manager.admission.token(), node="truth", gpus=1)
    agent.join()
    agent.register()
    stop = threading.Event()
    served = agent.serve(stop)

    def beat() -> None:  # its heartbeats keep the node ready however long a test waits
        while not stop.wait(0.5):
            agent.heartbeat()

    beating = threading.Thread(target=beat, daemon=True)
    beating.start()
    wait_for(lambda: manager.cluster.node_ready("truth"), 10, what="the node to be ready")
    yield manager, agent, stop
    stop.set()
    beating.join(5)
    served.join(5)
    agent.close()
    manager.stop()


def spec(memory: int, name: str) -> PlacementSpec:
    return PlacementSpec(memory=memory, count=1, placement="spread", image="busybox", command=["true"], name=name)


def cut_intents(store: Any, asked: list[dict[str, dict[str, Any]]]) -> Any:
    """Make ``store`` refuse every intent (noting what it was asked to write); return its own ``intend``."""
    real = store.intend

    def failing(intents: dict[str, dict[str, Any]]) -> None:
        asked.append(intents)
        raise StoreUnavailable("etcd is cut off (test)")

    store.intend = failing
    return real


def creates(agent: FakeAgent, name: str) -> list[protocol.Message]:
    return [m for m in list(agent.received) if isinstance(m, protocol.Create) and m.spec.name == name]


def test_item2_no_create_leaves_before_its_dequeue_is_in_the_store(leader) -> None:
    """The dequeue cannot be written: the create is held (a leader dying now must not leave the next one a
    queued request that already runs); once the store takes it, the create goes out, once."""
    manager, agent, _ = leader
    filler, _ = manager.create(spec(24 * GiB, "filler"))
    queued, status = manager.create(spec(4 * GiB, "waits"), queue=True)
    assert status == 202
    store = manager.plane.store
    real, failing = store.apply_queue, threading.Event()

    def refuse(changes: list[tuple[str, dict[str, Any] | None]]) -> None:
        failing.set()
        raise StoreUnavailable("etcd is cut off (test)")

    store.apply_queue = refuse  # type: ignore[method-assign]
    try:
        # room frees (its node reports the filler gone): the dispatcher places the queued request at once
        manager.cluster.finish(filler["id"], State.EXITED, reason="test: it ended")
        manager.cluster.wake.set()
        wait_for(failing.is_set, 10, what="the dispatcher to try writing the dequeue")
        wait_for(lambda: manager.cluster.get(queued["id"]).state is not State.QUEUED, 10, what="it to be placed")
        threading.Event().wait(1.0)  # several dispatch passes
        assert creates(agent, "waits") == [], "a create left before its dequeue was written"
    finally:
        store.apply_queue = real  # type: ignore[method-assign]
    wait_for(lambda: creates(agent, "waits"), 10, what="the create once the store takes the dequeue")
    wait_for(lambda: manager.cluster.get(queued["id"]).state is State.RUNNING, 10, what="it to run")
    assert store.queued() == [] and len(creates(agent, "waits")) == 1


def test_item5_a_queued_post_whose_write_fails_is_never_placed(leader) -> None:
    """The dispatcher cannot place a queued request before its entry is durable: a failed write leaves nothing."""
    manager, agent, _ = leader
    filler, _ = manager.create(spec(24 * GiB, "filler"))
    store = manager.plane.store
    real, entered, release = store.apply_queue, threading.Event(), threading.Event()

    def slow_then_fail(changes: list[tuple[str, dict[str, Any] | None]]) -> None:
        entered.set()
        release.wait(10)
        raise StoreUnavailable("etcd lost its quorum (test)")

    store.apply_queue = slow_then_fail  # type: ignore[method-assign]
    errors: list[GpumgrError] = []

    def post() -> None:
        try:
            manager.create(spec(4 * GiB, "refused"), queue=True)
        except GpumgrError as exc:
            errors.append(exc)

    caller = threading.Thread(target=post)
    try:
        caller.start()
        assert entered.wait(10)
        # while its write hangs, room frees (its node reports the filler gone)
        manager.cluster.finish(filler["id"], State.EXITED, reason="test: it ended")
        manager.cluster.wake.set()
        threading.Event().wait(0.5)  # dispatch passes run meanwhile
        assert not [r for r in manager.cluster.ledger.records.values() if r.name == "refused"
                    and r.state is not State.QUEUED], "placed before its queue entry was durable"
    finally:
        release.set()
        caller.join(10)
        store.apply_queue = real  # type: ignore[method-assign]
    assert errors and errors[0].code == "store_unavailable" and errors[0].status == 503
    assert [r for r in manager.cluster.ledger.records.values() if r.name == "refused"] == []
    threading.Event().wait(0.5)
    assert creates(agent, "refused") == []


def test_a_plain_placement_writes_nothing_to_the_store_and_a_delete_writes_its_intent_first(leader) -> None:
    manager, _, _ = leader
    store = manager.plane.store
    writes: list[list[dict[str, Any]]] = []
    real = store.write

    def counted(operations: list[dict[str, Any]], *args: Any, **kw: Any) -> bool:
        writes.append(operations)
        return real(operations, *args, **kw)

    store.write = counted  # type: ignore[method-assign]
    record, status = manager.create(spec(GiB, "plain"))
    assert status == 201 and writes == []
    intend: list[dict[str, dict[str, Any]]] = []
    real_intend = cut_intents(store, intend)
    with pytest.raises(StoreUnavailable):
        manager.remove(record["id"])
    assert manager.cluster.get(record["id"]).desired is State.RUNNING, "a refused DELETE changed the map"
    store.intend = real_intend  # type: ignore[method-assign]
    _, status = manager.remove(record["id"])
    assert status == 200 and len(writes) == 1  # its intent, written ahead
    wait_for(lambda: store.intents() == {}, 10, what="the spent intent to be deleted by the sweep")


def test_item1_hooks_waiting_in_the_queue_are_refused_when_leadership_ends(leader) -> None:
    """The term's queue goes with it: a runtime hook waiting there is told so at once, not left to time out."""
    manager, agent, _ = leader
    manager.create(spec(24 * GiB, "filler"))
    agent.send(protocol.Reserve(container_id="c" * 64, gpu_memory=4 * GiB, node="truth", queue=True, name="task"))
    wait_for(lambda: manager.inbound._hook_waiters, 10, what="the hook's request to wait in the queue")
    manager.plane.step_down("test: leadership ends", hold_off=2.0)
    refusals = lambda: [m for m in list(agent.received) if isinstance(m, protocol.Reply) and not m.ok  # noqa: E731
                        and m.error is not None and m.error.code == "not_leader"]
    wait_for(refusals, 5, what="the waiting hook to be refused")
    assert "dropped with the queue" in refusals()[0].error.message
    assert manager.cluster.ledger.records == {}, "the ended term's map was kept"
    wait_for(lambda: manager.leading.loaded, 15, what="the manager to lead again")


def test_item3_a_queued_resize_the_store_refused_is_undone(leader) -> None:
    """A PATCH of a queued request is answered only once the store holds it; refused, the old figure stays."""
    manager, _, _ = leader
    manager.create(spec(24 * GiB, "filler"))
    queued, status = manager.create(spec(4 * GiB, "waits"), queue=True)
    assert status == 202
    store = manager.plane.store
    real = store.apply_queue

    def refuse(changes: list[tuple[str, dict[str, Any] | None]]) -> None:
        raise StoreUnavailable("etcd is cut off (test)")

    store.apply_queue = refuse  # type: ignore[method-assign]
    try:
        with pytest.raises(StoreUnavailable):
            manager.resize(queued["id"], 2 * GiB)
        assert manager.cluster.get(queued["id"]).gpu_memory == 4 * GiB, "the refused PATCH changed the map"
    finally:
        store.apply_queue = real  # type: ignore[method-assign]
    manager.sync_queue(strict=True)
    assert [e["spec"]["memory"] for e in store.queued()] == [4 * GiB]


def test_a_gangs_delete_writes_its_members_intents_before_the_map_changes(leader) -> None:
    """A DELETE of a gang is a DELETE of each member: answered only once the store holds what it decided."""
    from gpumgr.manager.model.gangs import GangSpec
    from gpumgr.manager.tenancy.tenants import OPERATOR

    manager, _, _ = leader
    gang, status = manager.create_gang(GangSpec(spec(4 * GiB, "pair"), 2, one_per_node=False))
    assert status == 201, gang
    store = manager.plane.store
    asked: list[dict[str, dict[str, Any]]] = []
    real_intend = cut_intents(store, asked)
    with pytest.raises(StoreUnavailable):
        manager.remove_gang(gang["id"])
    assert set(asked[0]) == set(gang["members"])
    assert manager.cluster.gang_views(OPERATOR, gang["id"])[0]["state"] == "running", "a refused DELETE ended it"
    assert all(manager.cluster.get(m).desired is State.RUNNING for m in gang["members"])
    store.intend = real_intend  # type: ignore[method-assign]
    assert manager.remove_gang(gang["id"])["state"] == "removed"
    wait_for(lambda: all(manager.cluster.get(m).state is State.REMOVED for m in gang["members"]), 10,
             what="both members removed")


def test_a_container_seen_ending_in_an_earlier_term_gets_no_second_final_event(leader) -> None:
    """A manager that leads again (M1 → M2 → M1, or etcd's quorum lost and back) re-adopts from its nodes a
    container whose end it already wrote in its own event log: the log keeps one final event for it (the CI's
    HA chaos schedule etcd_quorum found two)."""
    manager, agent, _ = leader
    created, status = manager.create(spec(4 * GiB, "ends"))
    assert status == 201
    grant = created["id"]
    agent.reports[grant] = agent.reports[grant].model_copy(
        update={"state": "exited", "exit_code": 0, "finished_at": 1.0})
    agent.heartbeat()
    ledger = manager.cluster.ledger  # its records are a new dict each term
    wait_for(lambda: ledger.records[grant].state is State.EXITED, 5, what="the end to be recorded")

    def finals() -> int:
        return sum(1 for e in manager.events.since(0) if e["container"] == grant and e.get("final"))

    assert finals() == 1
    manager.cluster.reset("a new term of leadership (test)")  # as leading.lost and leading.elected do
    agent.heartbeat()  # unknown to the new term: it is asked to register again, and its Register adopts the container
    wait_for(lambda: grant in ledger.records, 5, what="the ended container to be adopted")
    assert ledger.records[grant].state is State.EXITED
    assert finals() == 1
