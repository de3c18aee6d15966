"""Where ``Idempotency-Key`` entries live: the state directory of one manager, or etcd for several.

An entry is what the manager knows about one key of one principal (a tenant, or the operator): the
request's fingerprint, whether it is still ``in_progress`` or ``done``, the record id the request
was given, who claimed it (this process's token and epoch) and, once done, the answer (status and
body) a repeat gets again. Keys are stored by a digest of ``principal + key``, so the same key from
two tenants is two entries and no key is kept in the clear.

Both backends change an entry only if it is as the caller last read or wrote it (``version``): a
file's content, compared under this process's lock (one manager owns a state directory), or the etcd
key's value, compared in a transaction also guarded by the leader's epoch, so a deposed leader
changes nothing. Entries expire :data:`TTL` seconds after they were first claimed: an expired entry reads
as absent, and :meth:`KeyBook.purge` removes those that expired.

The flow that uses them (claim before the create goes out, answer a repeat, settle a key whose
claimant died) is :mod:`gpumgr.manager.api.idempotent`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpumgr.manager.control import etcdv3
from gpumgr.manager.control.store import FileStore, Store
from gpumgr.manager.control.store_etcd import EtcdStore
from gpumgr.wire import security
from gpumgr.wire.errors import InvalidRequest

log = logging.getLogger(__name__)

#: The request header (IETF draft-ietf-httpapi-idempotency-key-header, as Stripe names it).
HEADER = "Idempotency-Key"
#: The answer header set on a repeat that gets the first answer again.
REPLAYED = "Idempotent-Replayed"
#: How long a key is kept: a day, as Stripe keeps them.
TTL = 24 * 3600.0
#: A key: 1 to 255 printable ASCII characters, no space (a UUID fits; so does any token a client makes).
KEY_PATTERN = re.compile(r"^[\x21-\x7e]{1,255}$")
MAX_KEY = 255
#: The state directory's folder of entries (one file each, named by digest).
FOLDER = "idempotency"
IN_PROGRESS, DONE = "in_progress", "done"


def read_key(value: str | None) -> str | None:
    """The header's key, or None when it is absent; an InvalidRequest (400) says what is wrong with a bad one."""
    if value is None:
        return None
    if not KEY_PATTERN.match(value):
        shown = "empty" if not value else f"{len(value)} characters long" if len(value) > MAX_KEY else \
            "not printable ASCII without spaces"
        raise InvalidRequest(f"{HEADER}: must be 1 to {MAX_KEY} printable ASCII characters with no space "
                             f"(a UUID is a good key); this one is {shown}", code="invalid_idempotency_key")
    return value


def digest(scope: str, key: str) -> str:
    """The name an entry is stored under: the key is scoped to ``scope`` (the principal) and never stored."""
    return hashlib.sha256(f"{scope}\0{key}".encode()).hexdigest()


def fingerprint(route: str, body: Any) -> str:
    """What makes two requests the same request: the route and the JSON body, keys in any order."""
    text = json.dumps([route, body], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class Entry:
    """One key's entry as read: its data, and the version a change must still find."""

    name: str
    data: dict[str, Any]
    version: Any

    @property
    def state(self) -> str:
        """``in_progress`` or ``done``."""
        return str(self.data.get("state"))

    def expired(self, now: float) -> bool:
        """Whether its day is over (it then reads as absent)."""
        return float(self.data.get("expires", 0)) <= now


class KeyBook(ABC):
    """The entries of every principal's keys; each change is durable before it returns."""

    @abstractmethod
    def read(self, name: str) -> Entry | None:
        """The entry stored under ``name``, or None."""

    @abstractmethod
    def create(self, name: str, data: dict[str, Any]) -> Entry | None:
        """Store a new entry and return it; None if one is there already (another request claimed the key first)."""

    @abstractmethod
    def replace(self, entry: Entry, data: dict[str, Any]) -> Entry | None:
        """Replace ``entry`` with ``data`` and return it; None if it changed since it was read."""

    @abstractmethod
    def delete(self, entry: Entry) -> bool:
        """Drop ``entry``; False if it changed since it was read."""

    @abstractmethod
    def entries(self) -> Iterator[Entry]:
        """Every entry stored (for purging)."""

    def purge(self, now: float) -> int:
        """Drop every entry whose day is over at ``now``; how many went."""
        gone = 0
        for entry in list(self.entries()):
            if entry.expired(now) and self.delete(entry):
                gone += 1
        return gone


class FileKeys(KeyBook):
    """One file per entry in ``<state dir>/idempotency/`` (0600, written atomically and fsynced)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.folder.mkdir(mode=0o700, exist_ok=True)
        self._lock = threading.Lock()

    def read(self, name: str) -> Entry | None:
        """The file ``<name>.json``; one that cannot be read is logged and read as absent."""
        path = self._path(name)
        try:
            data = security.read_private(path)
        except ValueError as exc:
            if path.exists():
                log.warning("idempotency entry unreadable, taken as absent: %s", exc)
            return None
        return Entry(name, data, data)

    def create(self, name: str, data: dict[str, Any]) -> Entry | None:
        """Write ``<name>.json`` unless it exists (an unreadable one is replaced)."""
        with self._lock:
            if self.read(name) is not None:
                return None
            return self._write(name, data)

    def replace(self, entry: Entry, data: dict[str, Any]) -> Entry | None:
        """Rewrite the file if it still holds what was read."""
        with self._lock:
            now = self.read(entry.name)
            if now is None or now.version != entry.version:
                return None
            return self._write(entry.name, data)

    def delete(self, entry: Entry) -> bool:
        """Remove the file if it still holds what was read."""
        with self._lock:
            now = self.read(entry.name)
            if now is None or now.version != entry.version:
                return False
            with contextlib.suppress(FileNotFoundError):
                self._path(entry.name).unlink()
            return True

    def entries(self) -> Iterator[Entry]:
        """Every readable entry file."""
        for path in self.folder.glob("*.json"):
            found = self.read(path.stem)
            if found is not None:
                yield found

    def _path(self, name: str) -> Path:
        return self.folder / f"{name}.json"

    def _write(self, name: str, data: dict[str, Any]) -> Entry:
        security.write_private(self._path(name), data)
        return Entry(name, data, json.loads(json.dumps(data)))  # as a later read finds it


class EtcdKeys(KeyBook):
    """One etcd key per entry, ``<prefix>idempotency/<name>``; every write fenced by the leader's epoch."""

    def __init__(self, store: EtcdStore) -> None:
        self.store = store

    def read(self, name: str) -> Entry | None:
        """The entry's key, with its value as version."""
        found = self.store.client.get(self.store.key(FOLDER, name))
        return None if found is None else self._entry(name, found.value)

    def create(self, name: str, data: dict[str, Any]) -> Entry | None:
        """Put the key if it is absent (a compare on its create revision), fenced."""
        path, value = self.store.key(FOLDER, name), _dump(data)
        done = self.store.write([etcdv3.put(path, value)], [etcdv3.created_at(path, 0)], check=False)
        return Entry(name, data, value) if done else None

    def replace(self, entry: Entry, data: dict[str, Any]) -> Entry | None:
        """Put the key if it still holds the value read, fenced."""
        path, value = self.store.key(FOLDER, entry.name), _dump(data)
        done = self.store.write([etcdv3.put(path, value)], [etcdv3.holds(path, entry.version)], check=False)
        return Entry(entry.name, data, value) if done else None

    def delete(self, entry: Entry) -> bool:
        """Delete the key if it still holds the value read, fenced."""
        path = self.store.key(FOLDER, entry.name)
        return self.store.write([etcdv3.delete(path)], [etcdv3.holds(path, entry.version)], check=False)

    def entries(self) -> Iterator[Entry]:
        """Every readable entry under the prefix."""
        start = len(self.store.key(FOLDER, ""))
        for kv in self.store.client.get_prefix(self.store.key(FOLDER, "")):
            entry = self._entry(kv.key[start:].decode(errors="replace"), kv.value)
            if entry is not None:
                yield entry

    @staticmethod
    def _entry(name: str, value: bytes) -> Entry | None:
        try:
            data = json.loads(value)
        except ValueError:
            log.warning("idempotency entry %s does not hold JSON; taken as absent", name)
            return None
        return Entry(name, data, value) if isinstance(data, dict) else None


def book_for(store: Store) -> KeyBook:
    """The key book beside ``store``: etcd's for several managers, else the state directory's."""
    if isinstance(store, EtcdStore):
        return EtcdKeys(store)
    if isinstance(store, FileStore):
        return FileKeys(store.folder / FOLDER)
    raise TypeError(f"no idempotency keys for a {type(store).__name__}")


def _dump(data: dict[str, Any]) -> bytes:
    return json.dumps(data, separators=(",", ":"), sort_keys=True).encode()
