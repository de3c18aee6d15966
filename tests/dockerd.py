"""A private Docker engine for one test: its own dockerd beside the host's, never the shared one.

Everything it owns lives under one temporary folder: data root, exec root, pid file, Unix socket and
``daemon.json`` (``--config-file``), so a test may install gpumgr as its default runtime, reload it
with SIGHUP and stop it without touching the engine every other test uses. It has no bridge and
no iptables rules: containers run with networking off, and nothing listens beyond the socket.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from tests.images import IMAGE
from tests.procs import wait_for
from tests.swarm import stop_engine

DOCKERD_START = 60.0


class PrivateEngine:
    """``dockerd`` under a temporary folder; :attr:`env` points the docker CLI at it."""

    def __init__(self, image_tar: bytes, daemon_json: dict[str, Any] | None = None) -> None:
        """Start it with ``daemon_json`` as its daemon.json (None: no such file) and import the test image."""
        self.dir = Path(tempfile.mkdtemp(prefix="gpumgr-pe-"))
        self.socket = self.dir / "docker.sock"
        self.host = f"unix://{self.socket}"
        self.pidfile = self.dir / "docker.pid"
        self.daemon_json = self.dir / "etc" / "daemon.json"
        self.daemon_json.parent.mkdir()
        # dockerd refuses to start on a --config-file that is not there: with no daemon.json asked for,
        # it starts on an empty one, removed once it answers (as on a host that has none)
        self.daemon_json.write_text(json.dumps(daemon_json or {}))
        self.env = {**os.environ, "DOCKER_HOST": self.host, "DOCKER_CONFIG": str(self.dir / "docker-config")}
        self._log = open(self.dir / "dockerd.log", "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            ["dockerd", "--bridge=none", "--iptables=false", "--ip-masq=false", "-H", self.host,
             "--data-root", str(self.dir / "data"), "--exec-root", str(self.dir / "exec"),
             "--pidfile", str(self.pidfile), "--config-file", str(self.daemon_json)],
            env=self.env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_for(self._answers, DOCKERD_START, interval=0.2, what="the private dockerd to answer")
            if daemon_json is None:
                self.daemon_json.unlink()
            self.docker("import", "-", IMAGE, input_bytes=image_tar)
        except BaseException:
            self.stop()
            raise

    def _answers(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"private dockerd exited:\n{self.log()[-3000:]}")
        return subprocess.run(["docker", "info"], env=self.env, capture_output=True).returncode == 0

    def log(self) -> str:
        """What dockerd wrote so far."""
        return (self.dir / "dockerd.log").read_text(errors="replace")

    def docker(self, *args: str, check: bool = True, timeout: float = 60,
               input_bytes: bytes | None = None) -> subprocess.CompletedProcess[str]:
        """Run the docker CLI against this engine; fail the test on an error unless ``check`` is false."""
        result = subprocess.run(["docker", *args], env=self.env, capture_output=True, timeout=timeout,
                                input=input_bytes)
        text = subprocess.CompletedProcess(result.args, result.returncode, result.stdout.decode(errors="replace"),
                                           result.stderr.decode(errors="replace"))
        if check and result.returncode != 0:
            raise AssertionError(f"docker {' '.join(args)} failed: {text.stderr}")
        return text

    def info(self) -> dict[str, Any]:
        """``docker info`` as JSON."""
        info: dict[str, Any] = json.loads(self.docker("info", "--format", "{{json .}}").stdout)
        return info

    def reload(self) -> None:
        """SIGHUP, as ``systemctl reload docker`` sends it."""
        os.kill(int(self.pidfile.read_text()), signal.SIGHUP)

    def stop(self) -> None:
        """Remove every container, stop the engine and delete its folder."""
        if self.proc.poll() is None:
            ids = self.docker("ps", "-aq", check=False).stdout.split()
            if ids:
                self.docker("rm", "-f", *ids, check=False)
        self._log.close()
        stop_engine(self.proc, self.dir)
