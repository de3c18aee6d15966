"""``gpumgr guard`` as a child process for tests, with a plugin name of its own.

The engine finds a plugin by its socket's name under ``/run/docker/plugins``; each test guard takes
a unique name there, so the host's engine (which names no such plugin) never uses it.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from pathlib import Path

from tests.procs import Proc, wait_for

PLUGIN_DIR = Path("/run/docker/plugins")


class GuardProc(Proc):
    """A guard serving ``name`` on ``/run/docker/plugins/NAME.sock`` and tickets on a private socket."""

    def __init__(self, tmp: Path, name: str | None = None, config: Path | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.name = name or f"gpumgr-guard-test-{uuid.uuid4().hex[:8]}"
        self.socket = PLUGIN_DIR / f"{self.name}.sock"
        self.control = os.path.join(tempfile.mkdtemp(prefix="gpumgr-guard-"), "guard.sock")
        self.state = tmp / f"{self.name}.json"
        self.tmp = tmp
        self.config = config
        self.env = env or {}
        self.start()

    def start(self) -> None:
        """Start (or start again) the process and wait for its plugin socket."""
        args = ["guard", "--socket", str(self.socket), "--control", self.control, "--state", str(self.state)]
        super().__init__([*args, *(["--config", str(self.config)] if self.config else [])],
                         self.tmp / f"{self.name}.log", self.env)
        wait_for(lambda: (self.socket.exists() and Path(self.control).exists()) or self._died(), 15,
                 what="the guard's sockets")

    def _died(self) -> bool:
        if self.popen.poll() is not None:
            raise AssertionError(f"the guard exited with {self.popen.returncode}:\n{self.output()}")
        return False

    def remove(self) -> None:
        """Stop the guard for good and remove its sockets, even if it was killed before it could."""
        self.stop()
        for path in (self.socket, Path(self.control)):
            path.unlink(missing_ok=True)
