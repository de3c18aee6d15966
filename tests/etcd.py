"""Real etcd processes for tests: one member or a three-member cluster on loopback, data in a temp folder.

Tests that need one skip when no ``etcd`` binary is installed (Debian's ``etcd-server``) unless
``GPUMGR_REQUIRE_ETCD=1``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from gpumgr.manager.control.etcdv3 import EtcdClient, EtcdError
from tests.procs import free_port, wait_for

START_TIMEOUT = 20.0


def etcd_binary() -> str:
    """The etcd server on PATH; skips the test (or fails it under GPUMGR_REQUIRE_ETCD=1) when there is none."""
    found = shutil.which("etcd") or ("/usr/bin/etcd" if Path("/usr/bin/etcd").exists() else None)
    if found is None:
        reason = "no etcd server is installed (apt-get install etcd-server)"
        if os.environ.get("GPUMGR_REQUIRE_ETCD") == "1":
            pytest.fail(f"{reason}, and GPUMGR_REQUIRE_ETCD=1 forbids skipping")
        pytest.skip(reason)
    return found


class Member:
    """One etcd member process with its own data folder and loopback ports."""

    def __init__(self, binary: str, name: str, folder: Path, client_port: int, peer_port: int, cluster: str,
                 token: str) -> None:
        self.name = name
        self.folder = folder
        self.url = f"http://127.0.0.1:{client_port}"
        self.peer = f"http://127.0.0.1:{peer_port}"
        self.args = [binary, "--name", name, "--data-dir", str(folder / "data"),
                     "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                     "--listen-peer-urls", self.peer, "--initial-advertise-peer-urls", self.peer,
                     "--initial-cluster", cluster, "--initial-cluster-token", token,
                     "--initial-cluster-state", "new", "--log-level", "warn",
                     "--auto-compaction-retention", "1"]
        self.popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start (or restart, keeping its data) the member."""
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / "etcd.log", "ab") as log:
            self.popen = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def kill(self) -> None:
        """kill -9 the member (its data stays, so :meth:`start` brings it back)."""
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait(10)

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


class EtcdCluster:
    """``size`` etcd members on free loopback ports, started and waited for; :meth:`stop` ends them all."""

    def __init__(self, folder: Path, size: int = 1) -> None:
        binary = etcd_binary()
        ports = [(free_port(), free_port()) for _ in range(size)]
        cluster = ",".join(f"m{i}=http://127.0.0.1:{peer}" for i, (_, peer) in enumerate(ports))
        token = f"gpumgr-test-{os.getpid()}-{time.monotonic_ns()}"
        self.members = [Member(binary, f"m{i}", folder / f"etcd-m{i}", client, peer, cluster, token)
                        for i, (client, peer) in enumerate(ports)]
        for member in self.members:
            member.start()
        wait_for(self.healthy, START_TIMEOUT, interval=0.1, what="etcd to elect a leader and answer")

    @property
    def endpoints(self) -> list[str]:
        """Every member's client URL."""
        return [m.url for m in self.members]

    def client(self, **kw: object) -> EtcdClient:
        """A client of every member."""
        return EtcdClient(self.endpoints, **kw)  # type: ignore[arg-type]

    def healthy(self) -> bool:
        """True when every running member answers a linearizable read (so the cluster has a leader)."""
        for member in self.members:
            if not member.running:
                continue
            try:
                EtcdClient([member.url], retry_for=0).get(b"health")
            except EtcdError:
                return False
        return True

    def raft_leader(self) -> Member:
        """The member etcd's own Raft elected leader (the one whose loss costs an election)."""
        for member in self.members:
            if member.running:
                status = EtcdClient([member.url], retry_for=0).status()
                if status["header"]["member_id"] == status.get("leader"):
                    return member
        raise AssertionError("no running etcd member says it leads")

    def stop(self) -> None:
        """kill -9 every member (their data folders go with the test's tmp_path)."""
        for member in self.members:
            member.kill()
