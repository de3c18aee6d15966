"""What a manager needs to know about its control plane: one manager on its state directory, or several on etcd.

Both kinds answer the same few questions, so the manager's code has one path:

- ``store``: where bindings, the join secret, the queue and event ids live (:mod:`gpumgr.manager.control.store`);
- ``is_leader``: whether this manager may place, run the queue and command agents right now;
- ``epoch``: what every command to an agent carries (None for a single manager);
- ``on_elected`` / ``on_lost``: callbacks for becoming leader (load the store, let the known nodes
  re-register, then place) and for losing it (stop placing at once, fail what waits on the agents);
- ``refused(code)``: an agent answered ``stale_epoch`` or a store write was ``fenced``: step down;
- ``outranked(epoch)``: an agent has accepted a higher epoch than this leader's (the store's epochs went
  back): take a higher generation and stand again.

:class:`Solo` is today's manager: always the leader, no epoch, the state directory. :class:`Replicated`
campaigns on etcd (:mod:`gpumgr.manager.control.leadership`) and fences every store write by its epoch.
``--store etcd://host:2379,host:2379[/prefix]`` (or ``etcds://`` with ``--store-ca``, ``--store-cert`` and
``--store-key``) names the etcd; :func:`parse_store_url` reads it.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from gpumgr.manager.control import etcdv3
from gpumgr.manager.control.etcdv3 import EtcdClient, parse_endpoints
from gpumgr.manager.control.leadership import Leadership, generation_of
from gpumgr.manager.control.store import Fenced, FileStore, Store
from gpumgr.manager.control.store_etcd import DEFAULT_PREFIX, EtcdStore
from gpumgr.manager.control.store_record import StoreRecord, remember
from gpumgr.wire import security
from gpumgr.wire.epoch import Epoch

log = logging.getLogger(__name__)
#: Codes that tell a leader it no longer leads: an agent that saw a newer epoch, a store write fenced out.
DEPOSED = frozenset({"stale_epoch", "fenced"})
#: The highest generation an agent's epoch may claim before a leader raises the store's above it (far above any
#: a store reaches by counting, and far below the wire's 64-bit bound).
MAX_GENERATION = 2**62


@dataclass(frozen=True)
class StoreUrl:
    """An etcd store: its client URLs and the key prefix this control plane keeps its keys under."""

    endpoints: list[str]
    prefix: str
    tls: bool


def parse_store_url(url: str) -> StoreUrl:
    """``etcd://h1:2379,h2:2379[/prefix]`` or ``etcds://...``; raises ValueError saying what is wrong."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("etcd", "etcds"):
        raise ValueError(f"--store {url!r}: expected etcd://HOST:PORT[,HOST:PORT...][/PREFIX] (etcds:// for TLS)")
    hosts, slash, prefix = rest.partition("/")
    if not hosts:
        raise ValueError(f"--store {url!r} names no etcd endpoint")
    tls = scheme == "etcds"
    endpoints = parse_endpoints(",".join(f"{'https' if tls else 'http'}://{h.strip()}" for h in hosts.split(",")))
    prefix = "/" + prefix.strip("/") + "/" if slash and prefix.strip("/") else DEFAULT_PREFIX
    if any(c.isspace() or not c.isprintable() for c in prefix):
        raise ValueError(f"--store {url!r}: the prefix may not hold spaces or control characters")
    for endpoint in endpoints:
        if urlsplit(endpoint).username is not None:
            raise ValueError(f"--store {url!r}: give client certificates with --store-cert, not credentials")
    return StoreUrl(endpoints, prefix, tls)


class Solo:
    """One manager alone on its state directory: always the leader, and its commands carry no epoch."""

    def __init__(self, state_dir: str | Path | None) -> None:
        self.store: Store = FileStore(state_dir)

    @property
    def is_leader(self) -> bool:
        """Always: there is no one else."""
        return True

    @property
    def epoch(self) -> Epoch | None:
        """None: a single manager's frames carry no epoch."""
        return None

    def leader(self) -> dict[str, Any] | None:
        """No other manager to point to."""
        return None

    def on_elected(self, callback: Callable[[Epoch], None]) -> None:
        """Never called: a single manager leads from the start."""

    def on_lost(self, callback: Callable[[Epoch, str], None]) -> None:
        """Never called: a single manager cannot be deposed."""

    @property
    def store_unreachable(self) -> bool:
        """Never: the state directory is local."""
        return False

    def refused(self, code: str) -> bool:
        """Nothing to step down from; False."""
        return False

    def outranked(self, seen: Epoch) -> bool:
        """Never: a single manager has no epoch (an agent fenced by several managers refuses it until told)."""
        return False

    def start(self) -> None:
        """Nothing to start."""

    def stop(self) -> None:
        """Close the store."""
        self.store.close()


class Replicated:
    """One of several managers sharing the etcd ``client`` reaches (keys under ``where.prefix``); leads while it can."""

    def __init__(self, client: EtcdClient, where: StoreUrl, name: str, *, api: str = "") -> None:
        self.client = client
        self._elected: list[Callable[[Epoch], None]] = []
        self._lost: list[Callable[[Epoch, str], None]] = []
        self._lock = threading.Lock()
        self.leadership = Leadership(self.client, name, api=api, prefix=where.prefix,
                                     on_elected=self._fire_elected, on_lost=self._fire_lost)
        self.store: Store = EtcdStore(self.client, self.leadership.guard, prefix=where.prefix,
                                      on_fenced=lambda: self.leadership.step_down("a store write was fenced"))

    @property
    def is_leader(self) -> bool:
        """Whether this manager holds the key and its lease cannot have run out yet."""
        return self.leadership.is_leader

    @property
    def epoch(self) -> Epoch | None:
        """This manager's epoch while it leads."""
        return self.leadership.epoch

    def leader(self) -> dict[str, Any] | None:
        """The leader as last seen (``{name, api}``), for forwarding and ``/healthz``."""
        return self.leadership.leader()

    def on_elected(self, callback: Callable[[Epoch], None]) -> None:
        """Call ``callback(epoch)`` each time this manager becomes leader."""
        with self._lock:
            self._elected.append(callback)

    def on_lost(self, callback: Callable[[Epoch, str], None]) -> None:
        """Call ``callback(epoch, why)`` each time this manager stops leading."""
        with self._lock:
            self._lost.append(callback)

    @property
    def store_unreachable(self) -> bool:
        """Whether etcd stopped answering (every endpoint down, or no quorum) and has not answered since."""
        return self.leadership.unreachable_since is not None

    def refused(self, code: str) -> bool:
        """Step down when ``code`` says a newer leader rules; True if it did."""
        if code not in DEPOSED or not self.leadership.is_leader:
            return False
        self.leadership.step_down(f"told {code} (a newer leader rules)")
        return True

    def outranked(self, seen: Epoch) -> bool:
        """An agent accepted ``seen``: if it is above this leader's epoch (an etcd restored from a snapshot or
        rebuilt), write a higher generation, step down and stand again (:meth:`Leadership.rise_above`). Whether so.
        """
        epoch = self.leadership.epoch
        if epoch is None or seen <= epoch:
            return False
        if seen.generation >= MAX_GENERATION:  # no leader ever stamped that: an agent's own invention
            log.warning("ignored an agent's epoch %s: no generation of this store reaches that high", seen)
            return False
        self.leadership.rise_above(seen)
        return True

    def step_down(self, why: str, hold_off: float = 0.0) -> None:
        """Stop leading now, and stay out of elections for ``hold_off`` seconds (so that another manager leads)."""
        self.leadership.step_down(why, hold_off)

    def start(self) -> None:
        """Start campaigning."""
        self.leadership.start()

    def stop(self) -> None:
        """Resign (so another leads at once) and stop."""
        self.leadership.stop(resign=True)

    def _fire_elected(self, epoch: Epoch) -> None:
        with self._lock:
            callbacks = list(self._elected)
        for callback in callbacks:
            callback(epoch)

    def _fire_lost(self, epoch: Epoch, why: str) -> None:
        with self._lock:
            callbacks = list(self._lost)
        for callback in callbacks:
            callback(epoch, why)


def _client(url: str, ca: str | None, cert: str | None, key: str | None) -> tuple[EtcdClient, StoreUrl]:
    if (cert is None) != (key is None):
        raise ValueError("--store-cert and --store-key go together")
    where = parse_store_url(url)
    return EtcdClient(where.endpoints, ca=ca, cert=(cert, key) if cert and key else None), where


def _no_writes() -> list[dict[str, Any]]:
    raise Fenced("a command-line tool does not lead: it reads the store only")


def read_only_store(url: str, *, ca: str | None = None, cert: str | None = None, key: str | None = None) -> Store:
    """The store at ``url`` for reading (and creating the join secret if absent); every other write is refused."""
    client, where = _client(url, ca, cert, key)
    return EtcdStore(client, _no_writes, prefix=where.prefix)


def rotating_store(url: str, *, ca: str | None = None, cert: str | None = None, key: str | None = None) -> Store:
    """The store at ``url`` for ``gpumgr join-token --rotate`` on any host: it may write the join secret only.

    The secret is read afresh at every join, so writing it needs no leader; the write is guarded by
    the store's generation, so it never lands in a store rebuilt meanwhile.
    """
    client, where = _client(url, ca, cert, key)
    leadership = Leadership(client, "join-token", prefix=where.prefix)
    generation = client.get(leadership.generation_key)
    if generation is None:
        raise ValueError(f"--store {url}: no manager has used this store yet; start one first")
    return EtcdStore(client, lambda: [etcdv3.holds(leadership.generation_key, generation.value)], prefix=where.prefix)


def describe(url: str, *, ca: str | None = None, cert: str | None = None, key: str | None = None) -> dict[str, Any]:
    """What ``gpumgr store status`` prints: etcd's version, the leader and its epoch, bindings and queue length."""
    client, where = _client(url, ca, cert, key)
    store = EtcdStore(client, _no_writes, prefix=where.prefix)
    leadership = Leadership(client, "status", prefix=where.prefix)
    leader = client.get(leadership.leader_key)
    generation = client.get(leadership.generation_key)
    status = client.status()
    info: dict[str, Any] = {"etcd": status.get("version"), "prefix": where.prefix, "leader": None, "epoch": None,
                            "nodes": sorted(store.nodes()), "queued": len(store.queued())}
    if leader is not None and generation is not None:
        info["leader"] = json.loads(leader.value)
        info["epoch"] = str(Epoch(generation_of(generation.value), leader.create_revision))
    return info


def control_plane(store: str | None, state_dir: str | Path | None, name: str, *, api: str = "",
                  ca: str | None = None, cert: str | None = None, key: str | None = None) -> Solo | Replicated:
    """The control plane ``--store`` names (none: the state directory, as always).

    Either way the state directory records which store holds the join secret, for ``gpumgr join-token``.
    """
    folder = security.state_dir(state_dir)
    if not store:
        remember(folder, None)
        return Solo(state_dir)
    client, where = _client(store, ca, cert, key)
    remember(folder, StoreRecord(store, ca, cert, key))
    return Replicated(client, where, name, api=api)
