"""Which ``--device`` host paths cannot change between the guard's answer and the engine's every start.

The engine resolves a device's host path when the container *starts* (moby's ``DevicesFromPath``:
links followed, the node's major and minor read then), and again at every restart, by restart policy
or at daemon start, which no authorization plugin sees. So the guard admits only a path that nobody
but the host's root can change: a character device in the host's own ``/dev`` (the devtmpfs itself,
not a tmpfs such as ``/dev/shm`` mounted under it), reached through links that never leave ``/dev``.
A missing path, a folder (whose devices the engine adds one by one) or a node in a folder a container
can bind are refused; a GPU node is refused as before. Binds of folders of that same ``/dev`` are
refused too (:func:`dev_folder_problem`): a container holding one could make the node a ``--device``
names later.
"""

from __future__ import annotations

import os
import stat

DEV = "/dev"
MAX_LINKS = 40


def device_problem(path: str, majors: frozenset[int], gpu_prefixes: tuple[str, ...]) -> str | None:
    """Why ``path`` may not be a ``--device``'s host path (a GPU major is in ``majors``), or None."""
    if path.startswith(gpu_prefixes):
        return "is a GPU device"
    real = resolve_in_dev(path)
    if real is None:
        return (f"is not in /dev or leads out of it ({os.path.realpath(path)}): the engine looks it up again at "
                "every start, when it may be a GPU; only character devices under /dev may be added")
    if real.startswith(gpu_prefixes):
        return f"is a GPU device ({real})"
    try:
        info, dev = os.stat(real), os.stat(DEV)
    except OSError:
        return "does not exist: the engine looks it up again at every start, when it may be a GPU"
    if not stat.S_ISCHR(info.st_mode):
        return "is not a character device (a folder's devices may change before the engine adds them)"
    if info.st_dev != dev.st_dev:
        return f"is on a file system mounted under /dev ({real}), where a container may make nodes"
    if os.major(info.st_rdev) in majors:
        return f"is a GPU device (major {os.major(info.st_rdev)})"
    return None


def resolve_in_dev(path: str) -> str | None:
    """``path`` resolved as the kernel does (links, then ``..``), or None if it starts or ever goes outside /dev."""
    pending = path.split("/")
    if not path.startswith("/"):
        return None
    resolved, links = "/", 0
    while pending:
        part = pending.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            resolved = os.path.dirname(resolved)
        else:
            candidate = os.path.join(resolved, part)
            if os.path.islink(candidate):
                links += 1
                target = os.readlink(candidate) if links <= MAX_LINKS else ""
                if not target:
                    return None
                pending = target.split("/") + pending
                if target.startswith("/"):
                    resolved = "/"
                continue
            resolved = candidate
        if resolved != "/" and resolved != DEV and not resolved.startswith(DEV + "/"):
            return None
    return resolved if resolved.startswith(DEV + "/") else None


def dev_folder_problem(real: str) -> str | None:
    """Why binding the host folder ``real`` (a resolved path) lets a container make device nodes for later, or None."""
    if not real.startswith(DEV + "/"):
        return None
    try:
        info, dev = os.stat(real), os.stat(DEV)
    except OSError:
        return None
    if stat.S_ISDIR(info.st_mode) and info.st_dev == dev.st_dev:
        return "is a folder of the host's /dev: a container could make device nodes there for a --device to name"
    return None
