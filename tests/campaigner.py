"""A manager-like process for leadership tests and the failover bench: campaigns, leads, writes, steps down.

``python -m tests.campaigner NAME ENDPOINTS [PREFIX]`` campaigns for the leader key on the etcd members
at ``ENDPOINTS`` (comma-separated URLs) and prints one JSON line per change of role, flushed at once:
``{"event": "elected", "name", "epoch": [generation, revision], "time"}`` and
``{"event": "lost", ..., "why"}``. While it leads it writes ``nodes/<NAME>`` through the fenced store
every 0.2 s (so a deposed leader that still tries is seen to fail), printing ``{"event": "fenced"}``
when the store refuses a write.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from gpumgr.manager.control.etcdv3 import EtcdClient, EtcdError, parse_endpoints
from gpumgr.manager.control.leadership import Leadership
from gpumgr.manager.control.store import Fenced
from gpumgr.manager.control.store_etcd import DEFAULT_PREFIX, EtcdStore
from gpumgr.wire.epoch import Epoch

ROOT = Path(__file__).resolve().parent.parent


class CampaignerProc:
    """This module run as a child process (for tests and the bench); its JSON lines are its events."""

    def __init__(self, folder: Path, name: str, endpoints: list[str]) -> None:
        self.name = name
        self.path = folder / f"campaigner-{name}.log"
        self._out = open(self.path, "ab")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen([sys.executable, "-m", "tests.campaigner", name, ",".join(endpoints)],
                                      cwd=ROOT, stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True)

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        """Every event printed so far (only those of ``kind`` when given), oldest first."""
        lines = self.path.read_text(errors="replace").splitlines()
        found = [json.loads(line) for line in lines if line.startswith("{")]
        return [e for e in found if kind is None or e["event"] == kind]

    def leads(self) -> bool:
        """Whether its last change of role was being elected."""
        roles = [e for e in self.events() if e["event"] in ("elected", "lost")]
        return bool(roles) and roles[-1]["event"] == "elected"

    def signal(self, sig: int) -> None:
        self.popen.send_signal(sig)

    def stop(self) -> None:
        """End it (resuming it first if paused) and close its log."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGCONT)
            self.popen.terminate()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
        self.popen.wait(10)
        self._out.close()


def say(event: str, name: str, **detail: Any) -> None:
    print(json.dumps({"event": event, "name": name, "time": time.time(), **detail}), flush=True)


def main() -> None:
    name, endpoints = sys.argv[1], parse_endpoints(sys.argv[2])
    prefix = sys.argv[3] if len(sys.argv) > 3 else DEFAULT_PREFIX
    client = EtcdClient(endpoints)
    leadership = Leadership(client, name, api=f"http://{name}.invalid", prefix=prefix,
                            on_elected=lambda e: say("elected", name, epoch=e.to_wire()),
                            on_lost=lambda e, why: say("lost", name, epoch=e.to_wire(), why=why))
    store = EtcdStore(client, leadership.guard, prefix=prefix)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    leadership.start()
    while not done.wait(0.2):
        epoch: Epoch | None = leadership.epoch
        if epoch is None:
            continue
        try:
            store.bind(name, str(epoch))
        except Fenced as exc:
            say("fenced", name, why=exc.message)
        except EtcdError as exc:
            say("store_error", name, why=exc.message)
    leadership.stop(resign=True)


if __name__ == "__main__":
    main()
