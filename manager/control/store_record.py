"""Which store a state directory's manager keeps its join secret in, so that ``gpumgr join-token`` reads that one.

A manager on etcd (``--store``) keeps the join secret in etcd, not in its state directory. ``gpumgr join-token
--state-dir DIR`` without ``--store`` used to read (or make) the directory's own secret, which no manager checks,
and print a token every manager refused (issue 33). So a manager records in its state directory the store it
uses: the URL and the paths of its TLS files, never their contents (``store.json``); it removes the record when
it runs alone on the directory again. ``join-token`` then reads the secret from that store, or, when the store
cannot be read, refuses and names ``--store``. A directory with no record is read as before: a fresh one gets
its key pair (the HA guide's second step, docs/ha.md, makes the managers' shared key that way).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from gpumgr.manager.control.store import Store
from gpumgr.wire import security
from gpumgr.wire.errors import GpumgrError

#: The record's file in the state directory.
STORE_FILE = "store.json"


@dataclass(frozen=True)
class StoreRecord:
    """The ``--store`` URL a manager runs with, and its TLS files as absolute paths (read from any directory)."""

    store: str
    store_ca: str | None = None
    store_cert: str | None = None
    store_key: str | None = None


def remember(folder: Path, record: StoreRecord | None) -> None:
    """Record ``record`` in ``folder`` (atomically, 0600), or remove the record when the manager runs alone."""
    path = folder / STORE_FILE
    if record is None:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return
    security.write_private(path, {k: str(Path(v).absolute()) if v and k != "store" else v
                                  for k, v in asdict(record).items()})


def recorded(folder: Path) -> StoreRecord | None:
    """The store ``folder``'s manager recorded, or None if it runs on the directory itself (or never ran)."""
    path = folder / STORE_FILE
    if not path.exists():
        return None
    try:
        data = security.read_private(path)
        if not isinstance(data.get("store"), str):
            raise ValueError("it names no store")
        return StoreRecord(**data)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"cannot read the store record {path} ({exc}); give the store with --store") from None


def join_store(folder: str | Path | None, opener: Callable[..., Store]) -> Store | None:
    """The store ``join-token --state-dir folder`` (without ``--store``) reads the join secret from; None: ``folder``.

    ``opener`` opens a store URL (read only, or allowed to rotate the secret). Refuses with a ValueError naming
    ``--store`` when the recorded store does not answer: a token made from the directory's own secret would be
    refused by every manager.
    """
    record = recorded(security.state_dir(folder))
    if record is None:
        return None
    try:
        store = opener(record.store, ca=record.store_ca, cert=record.store_cert, key=record.store_key)
        store.join_secret()  # read now, so that a store that does not answer is said here with what to do
    except (ValueError, OSError, GpumgrError) as exc:
        raise ValueError(f"the manager of {folder} keeps its join secret in the store {record.store}, which could "
                         f"not be read ({exc}); give --store URL (with --store-ca, --store-cert and --store-key "
                         "for TLS) naming a store that answers") from None
    return store
