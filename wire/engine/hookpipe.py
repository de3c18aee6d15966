"""The runtime hook's pipe: the names and words the shell launcher and the agent share.

The launcher (:func:`gpumgr.plugin.launchers.hook_launcher`) writes ``REPLY BUNDLE CONTAINER-ID`` on
the request pipe and reads one word back on its own reply pipe; the agent
(:mod:`gpumgr.agent.hook.hookfifo`) serves it. Both take every name here, so neither can drift.
"""

from __future__ import annotations

from pathlib import Path

#: The agent has read the request and holds the reply pipe open: an end of file from now on means it died.
WAIT = "wait"
#: The bundle is pinned to its grant: run the GPU runtime.
OK = "ok"
#: The bundle asks gpumgr for nothing: run the plain runtime.
PLAIN = "plain"
#: The agent cannot serve this one here (it cannot read the bundle, or too many wait): start the Python hook.
PYTHON = "python"
#: Followed by a space and runc's JSON log line: the create is refused, and the line says why.
ERROR = "err"


def fifo_path(socket_path: str) -> Path:
    """The request pipe kept beside the hook socket ``socket_path``."""
    return Path(socket_path).with_suffix(".fifo")


def pid_path(socket_path: str) -> Path:
    """The file that names the agent process serving ``socket_path``'s pipe (the launcher's liveness check)."""
    return Path(socket_path).with_suffix(".pid")


def reply_prefix(socket_path: str) -> Path:
    """Every reply pipe of ``socket_path``'s launchers is this path followed by the launcher's PID."""
    path = Path(socket_path)
    return path.with_name(path.stem + ".r.")
