"""``gpumgr join-token --state-dir DIR`` on the host of a manager that keeps its join secret in etcd (issue 33).

The manager records its ``--store`` in its state directory; join-token reads the secret from there (a real
manager process on a real etcd, a real agent admitted with the printed token), or refuses naming ``--store``
when that store does not answer. A fresh directory still gets its key pair, as the README's HA step 2 needs.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from gpumgr.manager.control.ha import control_plane
from gpumgr.manager.control.store_record import STORE_FILE, StoreRecord, recorded, remember
from gpumgr.manager.link.admission import KEY_FILE, Admission
from tests.ha_procs import HaManagers
from tests.procs import ROOT, AgentProc


def join_token(*args: str) -> subprocess.CompletedProcess[str]:
    """``gpumgr join-token ARGS`` as a user runs it."""
    return subprocess.run([sys.executable, "-m", "gpumgr", "join-token", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def last_line(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def test_the_token_from_the_state_directory_admits_an_agent_and_rotates_in_etcd(etcd, tmp_path) -> None:
    ha = HaManagers(tmp_path, etcd.endpoints, count=1)
    try:
        manager = ha.leader()
        assert recorded(manager.state_dir) == StoreRecord(ha.store)
        token = last_line(join_token("--state-dir", str(manager.state_dir)))
        agent = AgentProc(tmp_path, manager, "joined-by-dir", runtime="process", token=token, endpoints=ha.endpoints)
        agent.stop()  # it was admitted: the key from the directory, the secret from etcd
        assert token == ha.token()
        rotated = last_line(join_token("--state-dir", str(manager.state_dir), "--rotate"))
        assert rotated != token and rotated == ha.token()  # the rotation reached etcd, where every manager reads it
    finally:
        ha.stop()
    etcd.stop()
    refused = join_token("--state-dir", str(manager.state_dir))
    assert refused.returncode == 2 and "GPUMGR-" not in refused.stdout
    assert "--store" in refused.stderr and ha.store in refused.stderr, refused.stderr


def test_a_fresh_directory_gets_its_key_and_a_manager_alone_drops_the_record(tmp_path) -> None:
    fresh = tmp_path / "fresh"
    token = last_line(join_token("--state-dir", str(fresh)))  # the README's HA step 2
    assert (fresh / KEY_FILE).exists() and not (fresh / STORE_FILE).exists()
    assert token == Admission(fresh).token()
    remember(fresh, StoreRecord("etcd://127.0.0.1:9/gone", store_ca="ca.pem"))
    assert recorded(fresh) == StoreRecord("etcd://127.0.0.1:9/gone", store_ca=str(Path("ca.pem").absolute()))
    control_plane(None, fresh, "alone")  # the directory's manager now runs without --store
    assert recorded(fresh) is None and last_line(join_token("--state-dir", str(fresh))) == token


def test_an_unreadable_record_is_refused_naming_store(tmp_path) -> None:
    folder = tmp_path / "state"
    folder.mkdir(mode=0o700)
    (folder / STORE_FILE).write_text("[]")
    refused = join_token("--state-dir", str(folder))
    assert refused.returncode == 2 and "--store" in refused.stderr and "GPUMGR-" not in refused.stdout
