"""Several real ``gpumgr manager`` processes on one real etcd, as the README deploys them (loopback only).

Every manager gets the same CURVE key pair (``manager_key.json`` copied into each state directory),
its own API and agent ports, ``--store`` naming every etcd member and ``--advertise-api``. An agent
started by :meth:`HaManagers.agent` is given every manager's address.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
from pathlib import Path
from typing import Any

import requests

from gpumgr.manager.control.ha import read_only_store
from gpumgr.manager.link.admission import KEY_FILE, Admission
from gpumgr.wire import security
from tests.procs import AgentProc, ManagerProc, wait_for

ELECTED = 20.0


def shared_state(tmp: Path, name: str) -> str:
    """A fresh state directory ``tmp/name`` holding the one key pair every manager of ``tmp`` shares."""
    state = tmp / name
    state.mkdir(mode=0o700, exist_ok=True)
    shared = tmp / "shared-key" / KEY_FILE
    shared.parent.mkdir(mode=0o700, exist_ok=True)
    security.load_keys(shared)
    shutil.copy2(shared, state / KEY_FILE)
    return str(state)


class HaManager(ManagerProc):
    """One manager of several: a :class:`ManagerProc` whose health says its role."""

    def health(self) -> dict[str, Any] | None:
        """``/healthz``, or None while it does not answer (killed, stopped, starting)."""
        try:
            return self.http.get(f"{self.url}/healthz", timeout=1).json()
        except (requests.RequestException, ValueError):
            return None

    @property
    def leads(self) -> bool:
        health = self.health()
        return bool(health and health.get("role") == "leader")


class HaManagers:
    """``count`` managers sharing the etcd at ``endpoints`` under a prefix of the test's own."""

    def __init__(self, tmp: Path, endpoints: list[str], count: int = 3, prefix: str = "ha-test",
                 env: dict[str, str] | None = None) -> None:
        self.tmp = tmp
        self.env = env  # every manager's GPUMGR_* settings (the chaos harness's clock)
        self.store = "etcd://" + ",".join(e.removeprefix("http://") for e in endpoints) + "/" + prefix
        self.key = tmp / "shared-key" / KEY_FILE
        self.key.parent.mkdir(mode=0o700, exist_ok=True)
        security.load_keys(self.key)  # one identity for every manager: the agents trust any of them
        self.managers: list[HaManager] = []
        self._serial = 0
        for _ in range(count):
            self.start()

    def start(self, api_port: int | None = None, agent_port: int | None = None) -> HaManager:
        """Start one more manager (or one again on the ports it had) and wait until it answers."""
        from tests.procs import free_port

        api_port = api_port or free_port()
        shared_state(self.tmp, f"manager-state-{api_port}")
        manager = HaManager(self.tmp, "--store", self.store, "--advertise-api", f"http://127.0.0.1:{api_port}",
                            api_port=api_port, agent_port=agent_port, env=self.env)
        self.managers = [m for m in self.managers if m.api_port != api_port] + [manager]
        return manager

    @property
    def endpoints(self) -> str:
        """Every manager's agent address, comma-separated, as an agent takes them."""
        return ",".join(m.endpoint for m in self.managers)

    def leader(self, timeout: float = ELECTED, besides: HaManager | None = None) -> HaManager:
        """The one manager that says it leads (other than ``besides``), once there is exactly one."""
        def one() -> HaManager | None:
            leading = [m for m in self.managers if m is not besides and m.popen.poll() is None and m.leads]
            return leading[0] if len(leading) == 1 else None

        found: HaManager = wait_for(one, timeout, interval=0.05, what="exactly one leading manager")
        return found

    def followers(self, leader: HaManager) -> list[HaManager]:
        return [m for m in self.managers if m is not leader and m.popen.poll() is None]

    def token(self) -> str:
        """The join token: the shared key and the join secret in etcd (as ``gpumgr join-token --store``)."""
        admission = Admission(self.key.parent, store=read_only_store(self.store))
        return admission.token()

    def agent(self, node: str, entry: HaManager, gpus: str = "sim:2x24GiB", **kw: Any) -> AgentProc:
        """An agent given every manager's address (``entry`` is the one its readiness is read from)."""
        return AgentProc(self.tmp, entry, node, gpus=gpus, endpoints=self.endpoints, token=self.token(), **kw)

    def stop(self) -> None:
        for manager in self.managers:
            with contextlib.suppress(Exception):
                if manager.popen.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        manager.popen.send_signal(signal.SIGCONT)
                manager.stop(signal.SIGKILL)
