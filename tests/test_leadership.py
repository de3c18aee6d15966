"""Leader election against real etcd processes and real campaigning processes killed, paused and cut off."""

from __future__ import annotations

import signal
import time

import pytest

from gpumgr.manager.control.etcdv3 import EtcdClient, StoreUnavailable
from gpumgr.manager.control.leadership import LEASE_TTL
from gpumgr.wire.epoch import Epoch
from tests.campaigner import CampaignerProc as Campaigner
from tests.procs import wait_for

#: Liveness bound for a failover (not a timing claim: bench/store.py measures it): several lease TTLs.
FAILOVER_BOUND = 5 * LEASE_TTL


@pytest.fixture
def campaigners(tmp_path):
    started: list[Campaigner] = []

    def start(cluster, *names: str) -> list[Campaigner]:
        procs = [Campaigner(tmp_path, n, cluster.endpoints) for n in names]
        started.extend(procs)
        return procs

    yield start
    for proc in started:
        proc.stop()


def leaders(procs: list[Campaigner]) -> list[tuple[Campaigner, Epoch]]:
    """Campaigners whose last role event is ``elected``, with that epoch."""
    return [(proc, Epoch.from_wire(proc.events("elected")[-1]["epoch"])) for proc in procs if proc.leads()]


def one_leader(procs: list[Campaigner], other_than: Epoch | None = None) -> tuple[Campaigner, Epoch]:
    def settled() -> tuple[Campaigner, Epoch] | None:
        now = leaders(procs)
        if len(now) == 1 and (other_than is None or now[0][1] != other_than):
            return now[0]
        return None

    return wait_for(settled, FAILOVER_BOUND, interval=0.05, what="exactly one leader")


def test_exactly_one_of_three_leads(etcd, campaigners) -> None:
    procs = campaigners(etcd, "a", "b", "c")
    leader, epoch = one_leader(procs)
    time.sleep(2 * LEASE_TTL)  # renewals keep it: no one else is elected meanwhile
    assert leaders(procs) == [(leader, epoch)]
    assert sum(len(p.events("elected")) for p in procs) == 1


def test_leader_killed_another_leads_with_a_higher_epoch(etcd, campaigners) -> None:
    procs = campaigners(etcd, "a", "b", "c")
    leader, epoch = one_leader(procs)
    leader.signal(signal.SIGKILL)
    leader.popen.wait(10)
    survivors = [p for p in procs if p is not leader]
    _, new_epoch = one_leader(survivors)
    assert new_epoch > epoch and new_epoch.generation == epoch.generation


def test_paused_leader_comes_back_fenced_and_changes_nothing(etcd, campaigners) -> None:
    procs = campaigners(etcd, "a", "b")
    leader, epoch = one_leader(procs)
    client = EtcdClient(etcd.endpoints)
    own_key = f"/gpumgr/nodes/{leader.name}".encode()
    wait_for(lambda: client.get(own_key), 10, what="the leader's first fenced write")
    leader.signal(signal.SIGSTOP)
    other = next(p for p in procs if p is not leader)
    wait_for(lambda: other.events("elected"), FAILOVER_BOUND, what="the standby to lead while the leader is paused")
    written = client.get(own_key)
    assert written is not None
    leader.signal(signal.SIGCONT)
    lost = wait_for(lambda: leader.events("lost"), FAILOVER_BOUND, what="the paused leader to step down")
    assert Epoch.from_wire(lost[0]["epoch"]) == epoch
    time.sleep(1.0)  # the writes it would have made every 0.2 s had it still believed it led
    assert client.get(own_key) == written, "a deposed leader wrote to the store"
    assert [p.name for p, _ in leaders(procs)] == [other.name]


def test_etcd_leader_member_killed_changes_nothing(etcd3, campaigners) -> None:
    procs = campaigners(etcd3, "a", "b")
    leader, epoch = one_leader(procs)
    etcd3.raft_leader().kill()  # the hardest one to lose: etcd must elect a leader of its own first
    # as patient as the leader's lease is: a renewal that fails while etcd elects is tried again within
    # it (the client's own 2 s round, RETRY_FOR, is one try; a loaded machine's election can take more)
    client = EtcdClient(etcd3.endpoints, retry_for=LEASE_TTL)
    assert client.get(b"/gpumgr/leader") is not None  # the client rode out the election on a live member
    time.sleep(2 * LEASE_TTL)
    assert leaders(procs) == [(leader, epoch)], "losing one member of three cost the leader its lease"
    assert len(leader.events("lost")) == 0


def test_a_paused_member_is_passed_over_after_the_request_timeout(etcd3) -> None:
    client = EtcdClient(etcd3.endpoints)
    assert client.get(b"k") is None
    paused = etcd3.members[0].popen
    paused.send_signal(signal.SIGSTOP)
    try:
        client.txn([], [{"request_put": {"key": "aw==", "value": "dg=="}}])  # k = v, through a live member
        assert client.get(b"k") is not None and client.current != etcd3.members[0].url
    finally:
        paused.send_signal(signal.SIGCONT)


def test_quorum_lost_leader_steps_down_and_leadership_returns(etcd3, campaigners) -> None:
    procs = campaigners(etcd3, "a", "b")
    leader, epoch = one_leader(procs)
    etcd3.members[1].kill()
    etcd3.members[2].kill()
    wait_for(lambda: leader.events("lost"), FAILOVER_BOUND, what="the leader to step down without quorum")
    assert leaders(procs) == []
    with pytest.raises(StoreUnavailable):
        EtcdClient(etcd3.endpoints).get(b"/gpumgr/leader")
    etcd3.members[1].start()
    etcd3.members[2].start()
    _, again = one_leader(procs, other_than=epoch)
    assert again > epoch
