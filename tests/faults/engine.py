"""A throw-away Docker engine that a fault test may kill -9 and start again, beside the host's engine.

It has its own socket, data root, exec root and pid file (like tests/swarm.py's, without the swarm
or the runtime hook), so killing it never touches the engine the rest of the suite uses.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
from pathlib import Path

import docker

from tests.procs import wait_for
from tests.swarm import stop_engine

DOCKERD_START = 60.0


class ThrowawayEngine:
    """``dockerd`` in a temporary directory; :attr:`env` points docker clients and agents at it."""

    def __init__(self, image_tar: bytes) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="gpumgr-fe-"))
        self.socket = self.dir / "docker.sock"
        self.env = {"DOCKER_HOST": f"unix://{self.socket}"}
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()
        subprocess.run(["docker", "import", "-", "gpumgr-test/busybox:latest"], input=image_tar,
                       env={**os.environ, **self.env}, check=True, capture_output=True)
        self.client = docker.DockerClient(base_url=self.env["DOCKER_HOST"], timeout=30)

    def start(self) -> None:
        """Start (or start again) the engine on the same data, and wait until it answers."""
        with open(self.dir / "dockerd.log", "ab") as log:
            self.proc = subprocess.Popen(
                ["dockerd", "--bridge=none", "--iptables=false", "--ip-masq=false", "-H", f"unix://{self.socket}",
                 "--data-root", str(self.dir / "data"), "--exec-root", str(self.dir / "exec"),
                 "--pidfile", str(self.dir / "docker.pid")],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(self._answers, DOCKERD_START, interval=0.2, what="the throw-away dockerd to answer")

    def kill9(self) -> None:
        """SIGKILL the engine's whole process group (dockerd and its containerd), as a crash would."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def _answers(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"throw-away dockerd exited:\n{(self.dir / 'dockerd.log').read_text()[-3000:]}")
        env = {**os.environ, **self.env}
        return subprocess.run(["docker", "info"], env=env, capture_output=True).returncode == 0

    def stop(self) -> None:
        """Remove every container, stop the engine and delete its directory."""
        env = {**os.environ, **self.env}
        assert self.proc is not None
        if self.proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):  # an engine that hangs is killed below
                ids = subprocess.run(["docker", "ps", "-aq"], env=env, capture_output=True, text=True,
                                     timeout=30).stdout.split()
                if ids:
                    subprocess.run(["docker", "rm", "-f", *ids], env=env, capture_output=True, timeout=60)
        self.client.close()
        stop_engine(self.proc, self.dir)
