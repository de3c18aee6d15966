"""The control plane a manager asks: one manager alone, or several on a real etcd; the --store flags."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gpumgr.manager.config import ManagerSettings
from gpumgr.manager.control.ha import Replicated, Solo, control_plane, parse_store_url
from gpumgr.manager.control.store import Fenced, FileStore
from gpumgr.manager.link.admission import Admission
from gpumgr.wire import security
from gpumgr.wire.epoch import Epoch
from tests.procs import ROOT, wait_for


def gpumgr(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpumgr", *argv], capture_output=True, text=True, timeout=60,
                          cwd=ROOT)


def test_store_urls_parse() -> None:
    one = parse_store_url("etcd://10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379/prod")
    assert one.endpoints == ["http://10.0.0.1:2379", "http://10.0.0.2:2379", "http://10.0.0.3:2379"]
    assert one.prefix == "/prod/" and not one.tls
    assert parse_store_url("etcd://h:2379").prefix == "/gpumgr/"
    assert parse_store_url("etcd://h:2379/").prefix == "/gpumgr/"
    secure = parse_store_url("etcds://h:2379/a/b")
    assert secure.tls and secure.endpoints == ["https://h:2379"] and secure.prefix == "/a/b/"


@pytest.mark.parametrize("bad", ["h:2379", "http://h:2379", "etcd://", "etcd:///p", "etcd://h", "etcd://h:x",
                                 "etcd://h:2379,", "etcd://u:pw@h:2379", "etcd://h:2379/a b", "etcd://h:99999"])
def test_bad_store_urls_are_refused_with_a_reason(bad) -> None:
    with pytest.raises(ValueError, match=r"store|endpoint"):
        parse_store_url(bad)


def test_the_manager_refuses_a_bad_store_url(tmp_path) -> None:
    bad = gpumgr("manager", "--store", "http://h:2379", "--state-dir", str(tmp_path))
    assert bad.returncode == 2 and "etcd://" in bad.stderr
    assert ManagerSettings(store="etcd://h:2379").store == "etcd://h:2379"
    assert ManagerSettings(store="").store is None


def test_a_single_manager_always_leads_without_an_epoch(tmp_path) -> None:
    solo = control_plane(None, tmp_path, "m1")
    assert isinstance(solo, Solo) and isinstance(solo.store, FileStore)
    assert solo.is_leader and solo.epoch is None and solo.leader() is None
    assert solo.refused("stale_epoch") is False and solo.is_leader


def test_replicated_managers_elect_step_down_when_told_and_hand_over(etcd) -> None:
    url = "etcd://" + ",".join(u.removeprefix("http://") for u in etcd.endpoints) + "/ha-test"
    first = control_plane(url, None, "m1", api="http://m1:9400")
    second = control_plane(url, None, "m2", api="http://m2:9400")
    assert isinstance(first, Replicated) and isinstance(second, Replicated)
    events: list[tuple[str, str, Epoch]] = []
    for plane, name in ((first, "m1"), (second, "m2")):
        plane.on_elected(lambda e, n=name: events.append(("elected", n, e)))
        plane.on_lost(lambda e, why, n=name: events.append(("lost", n, e)))
    first.start()
    try:
        wait_for(lambda: first.is_leader, 10, what="m1 to lead")
        second.start()
        wait_for(lambda: second.leader() == {"name": "m1", "api": "http://m1:9400"}, 10, what="m2 to see m1")
        epoch = first.epoch
        assert epoch is not None and second.epoch is None
        first.store.bind("gpu1", "KEY1")
        with pytest.raises(Fenced):
            second.store.bind("gpu1", "OTHER")
        assert second.refused("stale_epoch") is False  # a follower has nothing to give up
        assert first.refused("not_found") is False and first.is_leader
        assert first.refused("stale_epoch") is True  # an agent saw a newer leader
        assert not first.is_leader
        wait_for(lambda: second.is_leader, 10, what="m2 to take over")
        assert second.epoch is not None and second.epoch > epoch
        assert ("lost", "m1", epoch) in events and events[0] == ("elected", "m1", epoch)
        with pytest.raises(Fenced):  # the deposed manager's store refuses, and says so again
            first.store.bind("gpu1", "LATE")
        assert second.store.nodes() == {"gpu1": "KEY1"}
    finally:
        first.stop()
        second.stop()


def test_admission_on_a_shared_store_is_seen_by_the_next_leader(etcd, tmp_path) -> None:
    url = "etcd://" + etcd.endpoints[0].removeprefix("http://")
    leader, standby = control_plane(url, None, "m1"), control_plane(url, None, "m2")
    leader.start()
    try:
        wait_for(lambda: leader.is_leader, 10, what="m1 to lead")
        keys = tmp_path / "keys"  # one key pair given to both managers as files
        mine, theirs = Admission(keys, store=leader.store), Admission(keys, store=standby.store)
        assert mine.token() == theirs.token()  # the same secret from the store
        agent = security.KeyPair.generate()
        _, secret = security.parse_token(mine.token())
        mine.admit(agent.public, "gpu1", security.join_proof(secret, agent.public, "gpu1"))
        assert theirs.node_of(agent.public) is None
        theirs.reload()  # what a new leader does before it takes registrations
        assert theirs.node_of(agent.public) == "gpu1"
    finally:
        leader.stop()
        standby.stop()


def test_store_status_and_join_token_read_a_shared_store(etcd, tmp_path) -> None:
    url = "etcd://" + etcd.endpoints[0].removeprefix("http://") + "/cli"
    plane = control_plane(url, None, "m1", api="http://m1:9400")
    plane.start()
    try:
        wait_for(lambda: plane.is_leader, 10, what="m1 to lead")
        plane.store.bind("gpu1", "KEY1")
        plane.store.enqueue({"id": "c1"})
        done = gpumgr("store", "status", "--store", url)
        assert done.returncode == 0, done.stderr
        status = json.loads(done.stdout)
        assert status["leader"]["name"] == "m1" and status["epoch"] == str(plane.epoch)
        assert status["nodes"] == ["gpu1"] and status["queued"] == 1 and status["etcd"].startswith("3.")
        state = str(tmp_path / "state")
        token = gpumgr("join-token", "--state-dir", state, "--store", url)
        assert token.returncode == 0, token.stderr
        last = token.stdout.strip().splitlines()[-1]
        assert security.parse_token(last)[1] == plane.store.join_secret()
        # any host rotates the shared secret: the leader reads it at the next join
        rotate = gpumgr("join-token", "--state-dir", state, "--store", url, "--rotate")
        assert rotate.returncode == 0, rotate.stderr
        fresh = security.parse_token(rotate.stdout.strip().splitlines()[-1])[1]
        assert fresh != security.parse_token(last)[1] and plane.store.join_secret() == fresh
        assert plane.is_leader  # the rotation is no leader's write: the leader leads on
        fresh_store = gpumgr("join-token", "--state-dir", state, "--store", url + "-other", "--rotate")
        assert fresh_store.returncode == 2 and "no manager has used this store" in fresh_store.stderr
        unreachable = gpumgr("store", "status", "--store", "etcd://127.0.0.1:1")
        denied = gpumgr("join-token", "--state-dir", state, "--store", "etcd://127.0.0.1:1")
        for failed in (unreachable, denied):
            assert failed.returncode == 2 and "no etcd endpoint answered" in failed.stderr
            assert "Traceback" not in failed.stderr
    finally:
        plane.stop()
