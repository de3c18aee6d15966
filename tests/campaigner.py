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
import sys
import threading
import time
from typing import Any

from gpumgr.manager.etcdv3 import EtcdClient, EtcdError, parse_endpoints
from gpumgr.manager.leadership import Leadership
from gpumgr.manager.store import Fenced
from gpumgr.manager.store_etcd import DEFAULT_PREFIX, EtcdStore
from gpumgr.wire.epoch import Epoch


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
