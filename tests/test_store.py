"""The store's two backends hold the same things the same way; etcd writes are fenced by the leader's epoch."""

from __future__ import annotations

import json
import threading

import pytest

from gpumgr.manager.control.leadership import Leadership
from gpumgr.manager.control.store import EventIds, Fenced, FileStore, Store
from gpumgr.manager.control.store_etcd import EtcdStore
from gpumgr.manager.link.admission import Admission
from tests.procs import wait_for


def leading(cluster, name: str = "m1", prefix: str = "/gpumgr/") -> Leadership:
    """A started Leadership that has won the key (the only campaigner)."""
    leadership = Leadership(cluster.client(), name, prefix=prefix)
    leadership.start()
    wait_for(lambda: leadership.is_leader, 10, what=f"{name} to lead")
    return leadership


def round_trip(store: Store, reopen) -> None:
    """What every backend must do: bindings, the secret, the queue's order, rising event ids, across a reopen."""
    store.bind("node-a", "KEY-A")
    store.bind("node-b", "KEY-B")
    assert store.forget("node-b") is True
    assert store.forget("node-b") is False
    secret = store.join_secret()
    assert len(secret) == 64 and store.join_secret() == secret
    rotated = store.rotate_secret()
    assert rotated != secret
    for n in ("c3", "c1", "c2"):
        store.enqueue({"id": n, "priority": 0, "body": {"image": "x", "gpu_memory": 1}})
    store.dequeue("c1")
    store.dequeue("never-queued")
    store.sync()
    first = store.reserve_event_ids(10)
    assert list(first) == list(range(1, 11))
    again = reopen()
    assert again.nodes() == {"node-a": "KEY-A"}
    assert again.join_secret() == rotated
    assert [r["id"] for r in again.queued()] == ["c3", "c2"]
    assert again.queued()[0]["body"] == {"image": "x", "gpu_memory": 1}
    assert again.reserve_event_ids(5).start == 11


def test_file_store_round_trip(tmp_path) -> None:
    round_trip(FileStore(tmp_path / "state"), lambda: FileStore(tmp_path / "state"))


def test_file_store_reads_what_a_single_manager_wrote(tmp_path) -> None:
    """Switching to the store interface loses nothing: bindings and the secret are the files Admission writes."""
    admission = Admission(tmp_path / "state")
    token = admission.token()
    store = FileStore(tmp_path / "state")
    assert store.join_secret() in token
    (tmp_path / "state" / "nodes.json").write_text(json.dumps({"nodes": {"gpu1": "K1"}}))
    assert store.nodes() == {"gpu1": "K1"}
    assert Admission(tmp_path / "state").nodes() == {"gpu1": "K1"}


def test_file_store_compacts_its_queue_journal(tmp_path, monkeypatch) -> None:
    from gpumgr.wire import defaults

    monkeypatch.setattr(defaults, "QUEUE_JOURNAL_SLACK", 10)
    store = FileStore(tmp_path / "state")
    for n in range(30):
        store.enqueue({"id": f"c{n}"})
        if n % 3:
            store.dequeue(f"c{n}")
    store.sync()
    kept = store.queued()
    assert [r["id"] for r in kept] == [f"c{n}" for n in range(0, 30, 3)]
    assert store.compact_queue(kept) is True
    assert len((tmp_path / "state" / "queue.jsonl").read_text().splitlines()) == len(kept)
    assert store.compact_queue(kept) is False
    store.enqueue({"id": "late"})  # appends go on after the rewrite
    assert [r["id"] for r in FileStore(tmp_path / "state").queued()] == [r["id"] for r in kept] + ["late"]


def test_event_ids_rise_across_restarts_one_write_per_block(tmp_path) -> None:
    store = FileStore(tmp_path / "state")
    ids = EventIds(store, block=3)
    seen = [ids.next() for _ in range(7)]
    assert seen == list(range(1, 8))
    # a restart forgets the rest of the block: ids skip ahead, never back
    later = EventIds(FileStore(tmp_path / "state"), block=3)
    assert later.next() == 10
    # the event log's own file format: the highest id reserved
    assert json.loads((tmp_path / "state" / "event_ids.json").read_text()) == {"ceiling": 12}


def test_etcd_store_round_trip(etcd) -> None:
    leadership = leading(etcd)
    try:
        store = EtcdStore(etcd.client(), leadership.guard)
        round_trip(store, lambda: EtcdStore(etcd.client(), leadership.guard))
    finally:
        leadership.stop()


def test_etcd_prefixes_keep_clusters_apart(etcd) -> None:
    one, two = leading(etcd, "a", "/one/"), leading(etcd, "b", "/two/")
    try:
        EtcdStore(etcd.client(), one.guard, prefix="/one/").bind("n", "K1")
        assert EtcdStore(etcd.client(), two.guard, prefix="/two/").nodes() == {}
    finally:
        one.stop()
        two.stop()


def test_etcd_event_ids_never_handed_out_twice_under_races(etcd) -> None:
    leadership = leading(etcd)
    try:
        got: list[int] = []
        lock = threading.Lock()

        def reserve() -> None:
            store = EtcdStore(etcd.client(), leadership.guard)
            for _ in range(5):
                block = store.reserve_event_ids(4)
                with lock:
                    got.extend(block)

        threads = [threading.Thread(target=reserve) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert sorted(got) == list(range(1, 81))
    finally:
        leadership.stop()


def test_a_follower_cannot_write(etcd) -> None:
    leader = leading(etcd, "m1")
    follower = Leadership(etcd.client(), "m2")
    follower.start()
    try:
        wait_for(lambda: follower.leader() == {"name": "m1", "api": ""}, 10, what="the follower to see m1")
        with pytest.raises(Fenced):
            EtcdStore(etcd.client(), follower.guard).bind("n", "K")
        assert EtcdStore(etcd.client(), leader.guard).nodes() == {}
    finally:
        follower.stop()
        leader.stop()


def test_deposed_leaders_writes_are_refused_by_etcd(etcd) -> None:
    """A leader whose lease ran out while it was stalled, still holding its old guard, changes nothing."""
    old = leading(etcd, "old")
    stale_guard, old_epoch = old.guard(), old.epoch  # what a stalled leader would still send
    old.stop(resign=False)  # stalled: it stops renewing and never resigns
    new = Leadership(etcd.client(), "new")
    new.start()
    try:
        wait_for(lambda: new.is_leader, 15, what="a new leader after the old lease ran out")
        assert new.epoch is not None and old_epoch is not None and new.epoch > old_epoch
        current = EtcdStore(etcd.client(), new.guard)
        current.bind("node-a", "NEW-KEY")
        secret = current.join_secret()
        fenced: list[bool] = []
        stale = EtcdStore(etcd.client(), lambda: stale_guard, on_fenced=lambda: fenced.append(True))
        for write in (lambda: stale.bind("node-a", "OLD-KEY"), lambda: stale.enqueue({"id": "c9"}),
                      stale.rotate_secret, lambda: stale.reserve_event_ids(1), lambda: stale.dequeue("c9")):
            with pytest.raises(Fenced):
                write()
        assert fenced == [True] * 5
        assert stale.nodes() == {"node-a": "NEW-KEY"} and stale.queued() == []
        assert current.join_secret() == secret and current.reserve_event_ids(1).start == 1
    finally:
        new.stop()


def test_an_unreadable_queue_entry_is_skipped_not_fatal(etcd) -> None:
    """Whoever can write to etcd can break a value; the manager still loads the rest, as from a torn journal."""
    from gpumgr.manager.control import etcdv3

    leadership = leading(etcd)
    try:
        store = EtcdStore(etcd.client(), leadership.guard)
        store.enqueue({"id": "c1"})
        etcd.client().txn([], [etcdv3.put(store.key("queue", "bad"), b"{not json")])
        etcd.client().txn([], [etcdv3.put(store.key("queue", "list"), b"[1, 2]")])
        store.enqueue({"id": "c2"})
        assert [r["id"] for r in store.queued()] == ["c1", "c2"]
    finally:
        leadership.stop()
