"""The manager on its control plane: real managers in this process on a real etcd, agents on real sockets.

What the fault tests cannot make happen on cue is driven here with a scripted agent (``FakeAgent``,
a real CURVE DEALER socket): a command stamped with the leader's epoch answered ``stale_epoch``, a
follower's ``not_leader`` to a join and a registration, the queue and event ids handed to the next leader.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from gpumgr import __version__
from gpumgr.manager.config import ManagerSettings
from gpumgr.manager.control.store_etcd import EtcdQueueJournal
from gpumgr.manager.inbound import MIN_AGENT_VERSION
from gpumgr.manager.model.records import PlacementSpec
from gpumgr.manager.service import Manager
from gpumgr.wire import protocol
from gpumgr.wire.errors import GpumgrError
from tests.fake_agent import FakeAgent, GiB
from tests.ha_procs import shared_state
from tests.procs import free_port, wait_for


def settings(tmp_path: Any, url: str, name: str) -> ManagerSettings:
    return ManagerSettings(store=url, state_dir=shared_state(tmp_path, name), agents=f"tcp://127.0.0.1:{free_port()}",
                           advertise_api=f"http://127.0.0.1:{free_port()}")


@pytest.fixture
def two(etcd, tmp_path) -> Iterator[tuple[Manager, Manager]]:
    """Two managers on one etcd; the first leads when the test starts."""
    url = "etcd://" + etcd.endpoints[0].removeprefix("http://") + "/wired"
    first = Manager(settings(tmp_path, url, "m1"))
    first.start()
    wait_for(lambda: first.leading.loaded, 10, what="m1 to lead")
    second = Manager(settings(tmp_path, url, "m2"))
    second.start()
    wait_for(lambda: second.plane.leader() is not None, 10, what="m2 to see the leader")
    yield first, second
    for manager in (first, second):
        manager.stop()


def spec(memory: int) -> PlacementSpec:
    return PlacementSpec(memory=memory, count=1, placement="spread", image="busybox", command=["true"])


def test_a_command_carries_the_epoch_and_stale_epoch_makes_the_leader_step_down(two) -> None:
    first, second = two
    agent = FakeAgent(first.settings.agents, first.admission.token(), node="ha2-wired", behaviour="silent")
    try:
        assert agent.register().heartbeat_interval > 0
        outcome: dict[str, Any] = {}

        def create() -> None:
            try:
                outcome["answer"] = first.create(spec(GiB))
            except GpumgrError as exc:
                outcome["error"] = exc

        thread = threading.Thread(target=create)
        thread.start()
        assert agent.socket.poll(5000)
        envelope, message = protocol.decode(agent.socket.recv())
        assert isinstance(message, protocol.Create)
        epoch = first.plane.epoch
        assert epoch is not None and list(envelope.epoch or []) == epoch.to_wire()
        refusal = protocol.ErrorBody(code="stale_epoch", message="a newer leader (epoch 9.9) rules")
        agent.send(protocol.Reply(ok=False, error=refusal), reply_to=envelope.id)
        thread.join(30)
        assert "error" in outcome, outcome
        wait_for(lambda: second.leading.loaded, 10, what="m2 to lead once m1 stepped down")
        assert not first.plane.is_leader
        assert second.plane.epoch is not None and second.plane.epoch > epoch
    finally:
        agent.close()


def test_a_follower_answers_agents_not_leader(two) -> None:
    first, second = two
    agent = FakeAgent(second.settings.agents, second.admission.token(), node="ha2-follow")
    try:
        join = agent.join()
        assert not join.ok and join.error is not None and join.error.code == "not_leader"
        agent.send(protocol.Register(node="ha2-follow", runtime="docker", gpus=agent.gpus, containers=[]))
        refused = agent.expect(protocol.Refused)
        assert refused.code == "not_leader" and first.settings.advertise_api in refused.message
        assert second.admission.node_of(agent.keys.public) is None
    finally:
        agent.close()


def test_the_next_leader_takes_the_queue_in_order_and_event_ids_keep_rising(two) -> None:
    first, second = two
    agent = FakeAgent(first.settings.agents, first.admission.token(), node="ha2-queue", gpus=1, size=4 * GiB)
    try:
        agent.register()
        stop = threading.Event()
        serving = agent.serve(stop)
        assert first.create(spec(3 * GiB))[1] == 201  # the one GPU is nearly full: the next ones wait
        queued = [first.create(spec(2 * GiB), queue=True)[0]["id"] for _ in range(3)]
        assert isinstance(first.cluster.journal, EtcdQueueJournal)
        assert [r["id"] for r in first.plane.store.queued()] == queued  # written before the 202
        first._stopping.set()  # no dispatcher pass from here on writes the queue for the DELETE below
        first.cluster.wake.set()
        first._dispatcher.join(5)
        assert first.remove(queued[1])[1] == 200  # written before the 200: the next leader does not bring it back
        assert [r["id"] for r in first.plane.store.queued()] == [queued[0], queued[2]]
        queued.remove(queued[1])
        last_event = max(e["id"] for e in first.events.since(0))
        first.plane.stop()  # resign: the second leads at its next poll
        wait_for(lambda: second.leading.loaded, 10, what="m2 to lead")
        with second.cluster.lock:
            order = list(second.cluster.queue.ids())
        assert order == queued
        assert min(e["id"] for e in second.events.since(0)) > last_event
    finally:
        stop.set()
        serving.join(5)
        agent.close()


def test_an_agent_too_old_for_the_managers_commands_is_told_which_version_it_needs(tmp_path) -> None:
    manager = Manager(ManagerSettings(state_dir=str(tmp_path / "solo"), agents=f"tcp://127.0.0.1:{free_port()}"))
    manager.start()
    agent = FakeAgent(manager.settings.agents, manager.admission.token(), node="ha2-old")
    try:
        assert agent.join().ok
        agent.send(protocol.Register(node="ha2-old", runtime="docker", gpus=agent.gpus, version="0.0.9"))
        refused = agent.expect(protocol.Refused)
        assert refused.code == "agent_too_old" and f"{MIN_AGENT_VERSION} or newer" in refused.message
        assert "0.0.9" in refused.message
        agent.send(protocol.Register(node="ha2-old", runtime="docker", gpus=agent.gpus, version="0.1.0"))
        assert agent.expect(protocol.Refused).code == "agent_too_old"  # it cannot read a command's op
        assert not manager.cluster.node_ready("ha2-old")
        agent.send(protocol.Register(node="ha2-old", runtime="docker", gpus=agent.gpus, version=__version__))
        agent.expect(protocol.Registered)
        assert manager.cluster.node_ready("ha2-old")
    finally:
        agent.close()
        manager.stop()


def test_queue_changes_reach_etcd_in_order_in_few_transactions_and_a_fenced_batch_is_dropped(etcd) -> None:
    from gpumgr.manager.control.leadership import Leadership
    from gpumgr.manager.control.store import Fenced
    from gpumgr.manager.control.store_etcd import EtcdStore

    leadership = Leadership(etcd.client(), "q", prefix="/journal/")
    leadership.start()
    try:
        wait_for(lambda: leadership.is_leader, 10, what="the journal's writer to lead")
        store = EtcdStore(etcd.client(), leadership.guard, prefix="/journal/")
        journal = EtcdQueueJournal(store)
        before = int(etcd.client().call("/v3/kv/range", {"key": "eA=="})["header"]["revision"])
        for i in range(300):
            journal.add({"id": f"r{i:03d}", "n": i})
        journal.remove("r005")
        journal.add({"id": "gone", "n": -1})
        journal.remove("gone")  # queued and taken off in one batch: only its delete is sent
        assert store.queued() == []  # nothing is written before sync
        journal.sync()
        after = int(etcd.client().call("/v3/kv/range", {"key": "eA=="})["header"]["revision"])
        assert after - before == 3  # 301 operations (299 puts, 2 deletes), at most 128 per transaction
        assert [r["id"] for r in store.queued()] == [f"r{i:03d}" for i in range(300) if i != 5]
        leadership.step_down("a test")
        journal.remove("r000")
        with pytest.raises(Fenced):
            journal.sync()
        journal.sync()  # the fenced batch was dropped: nothing is tried again
        assert len(store.queued()) == 299
    finally:
        leadership.stop()


def test_a_new_leader_places_nothing_until_it_has_read_the_store(two) -> None:
    first, second = two
    reading, release = threading.Event(), threading.Event()
    real = second.plane.store.queued

    def slow_queued() -> list[dict[str, Any]]:  # the store answers slowly (etcd busy electing a leader of its own)
        reading.set()
        release.wait(10)
        return real()

    second.plane.store.queued = slow_queued  # type: ignore[method-assign]
    first.plane.stop()
    try:
        assert reading.wait(10), "the new leader did not read the queue"
        assert second.plane.is_leader  # its lease says it leads ...
        assert not second.leading.placing  # ... but it places nothing before the store is read
    finally:
        release.set()
    wait_for(lambda: second.leading.placing, 10, what="the new leader to place once it has read the store")
