"""Writing the files an install changes: each atomically, all or none.

Kept apart from :mod:`gpumgr.plugin.install.install`, which decides *what* to write; this module only makes
a list of changes happen so that a crash leaves the old or the new file, never a truncated one, and
a failure part-way undoes what was already written.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Change:
    """One file to write (``data``) or remove (``data is None``)."""

    path: Path
    data: bytes | None
    mode: int = 0o644


def read_bytes(path: Path) -> bytes | None:
    """The file's bytes, or None if there is no such file."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def mode_of(path: Path) -> int:
    """The file's permission bits (0o644 for a file not there yet)."""
    try:
        return path.stat().st_mode & 0o7777
    except FileNotFoundError:
        return 0o644


def sha256_of(data: bytes) -> str:
    """A hex digest, to tell later whether a file is still exactly what we wrote."""
    return hashlib.sha256(data).hexdigest()


def apply(changes: list[Change]) -> None:
    """Make ``changes`` in order, each atomically; if one fails, undo those made and raise."""
    undo: list[Change] = []
    made_dirs: list[Path] = []
    try:
        for change in changes:
            previous = Change(change.path, read_bytes(change.path), mode_of(change.path))
            if change.data is None:
                if previous.data is not None:
                    change.path.unlink()
                    _fsync_dir(change.path.parent)
                    undo.append(previous)
                continue
            if previous.data == change.data and previous.mode == change.mode:
                continue  # already so: leave it (and its time stamps) alone
            made_dirs += _make_dirs(change.path.parent)
            _write_atomically(change.path, change.data, change.mode)
            undo.append(previous)
    except BaseException:
        for previous in reversed(undo):
            with contextlib.suppress(OSError):
                if previous.data is None:
                    previous.path.unlink(missing_ok=True)
                else:
                    _write_atomically(previous.path, previous.data, previous.mode)
        for folder in reversed(made_dirs):
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise


def _make_dirs(folder: Path) -> list[Path]:
    """Create ``folder`` and its missing parents; the ones created, outermost first."""
    missing = [parent for parent in (folder, *folder.parents) if not parent.exists()][::-1]
    folder.mkdir(parents=True, exist_ok=True)
    return missing


def _write_atomically(path: Path, data: bytes, mode: int) -> None:
    """Replace ``path`` with ``data``: a temporary file beside it, fsync, rename, fsync of the folder."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fchmod(handle.fileno(), mode)
            with contextlib.suppress(FileNotFoundError, PermissionError):
                owner = path.stat()  # keep the owner of a file replaced (root's, or a config manager's)
                os.fchown(handle.fileno(), owner.st_uid, owner.st_gid)
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
