"""Event ids are reserved before use, or a gap is declared: a reader of ``since=`` never skips (issue 31, item 9).

Against a real etcd (killed and started again) and the real model: ids are never handed out twice,
only rise across terms, and no store call runs under the model's lock or the event log's.
"""

from __future__ import annotations

import itertools
import re
import threading
from pathlib import Path

import pytest

from gpumgr.manager import events as events_module
from gpumgr.manager.control.store_etcd import EtcdStore
from gpumgr.manager.event_ids import IdFile
from gpumgr.manager.events import EventLog
from gpumgr.manager.model.cluster import Cluster
from gpumgr.wire import protocol
from gpumgr.wire.names import EventType
from tests.etcd import EtcdCluster
from tests.procs import wait_for

GiB = 1 << 30


def _ids(log: EventLog) -> list[int]:
    return [e["id"] for e in log.since(0)]


def _rising_once(ids: list[int]) -> bool:
    return all(a < b for a, b in itertools.pairwise(ids))


@pytest.fixture
def etcd(tmp_path: Path):
    cluster = EtcdCluster(tmp_path)
    yield cluster
    cluster.stop()


def test_ids_handed_out_while_etcd_is_down_are_never_handed_out_again(etcd, monkeypatch) -> None:
    """The defect: after one failed reservation ids went on unreserved, and the next block reused them."""
    monkeypatch.setattr(events_module, "ID_BLOCK", 4)
    store = EtcdStore(etcd.client(retry_for=0.5), lambda: [], prefix="/event-ids-test/")
    log = EventLog(reserve=store.reserve_event_ids)
    log.renew_ids()  # a leader's term starts
    for _ in range(4):
        log.record(EventType.NODE_UP, "before")
    etcd.members[0].kill()
    for _ in range(2):
        log.record(EventType.NODE_UP, "while etcd is down")
    seen = _ids(log)
    reader_at = seen[-1]  # a client following since= has read up to here
    etcd.members[0].start()
    wait_for(etcd.healthy, 20, interval=0.1, what="etcd to answer again")
    for _ in range(3):
        log.record(EventType.NODE_UP, "after")
    wait_for(lambda: len(_ids(log)) >= 9, 30, interval=0.05, what=f"every event numbered: {_ids(log)}")
    ids = _ids(log)
    assert len(ids) == len(set(ids)), f"an event id was handed out twice: {ids}"
    assert _rising_once(ids), ids
    after = [e["message"] for e in log.since(reader_at)]
    assert after == ["after"] * 3, f"a reader at since={reader_at} skipped events: {ids}"


class FlakyFile:
    """``event_ids.json`` in a folder, behind a switch that makes every reservation fail (a full disk)."""

    def __init__(self, folder: Path, failing: bool) -> None:
        self.ids = IdFile(folder)
        self.failing = failing

    def reserve(self, count: int) -> range:
        if self.failing:
            raise OSError("the disk is full")
        return self.ids.reserve(count)


def test_a_new_term_starts_above_every_id_the_last_one_handed_out_unreserved(tmp_path) -> None:
    """A manager that numbered events while its store failed, then lost its term: the next term's ids are above."""
    disk = FlakyFile(tmp_path, failing=False)
    first = EventLog(reserve=disk.reserve, block=10)
    first.renew_ids()
    disk.failing = True
    handed = [first.record(EventType.NODE_UP, str(i)) for i in range(25)]
    # ten reserved, one id tells readers, nine past the reservation (the bound), the rest wait for an id
    assert handed[19:] == [0] * 6 and _rising_once(handed[:19]), handed
    numbered = [h for h in handed if h]
    disk.failing = False
    second = EventLog(reserve=disk.reserve, block=10)  # the next leader (or this manager restarted)
    second.renew_ids()
    taken = second.record(EventType.NODE_UP, "y")
    assert taken > max(numbered), (handed, taken)
    [told] = [e for e in first.since(0) if e["type"] == "ids_unreserved"]  # readers of the first were told
    low, high = (int(x) for x in re.search(r"from (\d+) on .* up to (\d+)", told["message"]).groups())  # type: ignore[union-attr]
    assert told["id"] == low and low < numbered[10] and max(numbered) <= high < taken, (told, handed, taken)
    # the first manager's store answers again: its waiting events are numbered above all it handed out
    wait_for(lambda: len(first.since(0)) == 26, 30, interval=0.05, what="the waiting events to be numbered")
    shown = first.since(0)
    assert _rising_once([e["id"] for e in shown])
    assert [e["message"] for e in shown[-6:]] == [str(i) for i in range(19, 25)]


def test_before_a_terms_first_block_events_wait_for_ids_and_are_shown_in_order_once_it_comes(tmp_path) -> None:
    disk = FlakyFile(tmp_path, failing=True)
    log = EventLog(reserve=disk.reserve, block=5)
    log.renew_ids()  # fails: the term has no block yet, so no id can be known safe
    assert [log.record(EventType.NODE_UP, str(i)) for i in range(3)] == [0, 0, 0]
    assert log.since(0) == []
    disk.failing = False
    wait_for(lambda: len(log.since(0)) == 3, 30, interval=0.05, what="the waiting events to be numbered")
    shown = log.since(0)
    assert [e["message"] for e in shown] == ["0", "1", "2"] and _rising_once([e["id"] for e in shown])


def test_no_store_call_runs_under_the_model_lock_or_the_event_logs(tmp_path) -> None:
    """A store whose reservation hangs: the model's lock and the event log stay free for every other thread."""
    entered, release = threading.Event(), threading.Event()

    def reserve(count: int) -> range:
        entered.set()
        release.wait(60)
        return range(1, count + 1)

    log = EventLog(reserve=reserve)  # a follower that was never elected: no block yet
    cluster = Cluster(log)
    gpus = [protocol.GpuInfo(uuid="GPU-lock-0", index=0, name="Sim", memory_total=8 * GiB)]
    registering = threading.Thread(target=cluster.register, args=("n1", b"n1", "process", gpus, []), daemon=True)
    try:
        registering.start()  # records node_up under the model's lock
        assert entered.wait(30), "no reservation was asked for"
        assert cluster.lock.acquire(timeout=10), "the model's lock is held while the store is called"
        cluster.lock.release()
        reader = threading.Thread(target=log.since, args=(0,), daemon=True)
        reader.start()
        reader.join(10)
        assert not reader.is_alive(), "the event log's lock is held while the store is called"
        registering.join(10)
        assert not registering.is_alive()
    finally:
        release.set()
    wait_for(lambda: [e["type"] for e in log.since(0)][-1:] == ["node_up"], 10, interval=0.05,
             what="the node's event to be numbered")
