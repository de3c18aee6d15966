"""A throw-away Docker engine with the gpumgr runtime hook installed, initialised as a one-node swarm.

It runs beside the host's engine (own socket, data, exec root and containerd), so tests can make
the hook the default runtime without touching the host's Docker, and it only listens on loopback.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.procs import ROOT, free_port, wait_for

DOCKERD_START = 60.0


class SwarmEngine:
    """``dockerd`` + ``docker swarm init`` in a temporary directory; ``env`` points docker and agents at it."""

    def __init__(self, image_tar: bytes) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="gpumgr-sw-"))
        self.socket = self.dir / "docker.sock"
        self.hook_socket = str(self.dir / "hook.sock")
        self.docker_config = self.dir / "docker-config"
        self.env = {**os.environ, "DOCKER_HOST": f"unix://{self.socket}", "DOCKER_CONFIG": str(self.docker_config),
                    "GPUMGR_HOOK_SOCKET": self.hook_socket}
        self.install_output = self._install()
        self._log = open(self.dir / "dockerd.log", "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            ["dockerd", "--bridge=none", "--iptables=false", "--ip-masq=false", "-H", f"unix://{self.socket}",
             "--data-root", str(self.dir / "data"), "--exec-root", str(self.dir / "exec"),
             "--pidfile", str(self.dir / "docker.pid"), "--config-file", str(self.dir / "daemon.json")],
            env=self.env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(self._answers, DOCKERD_START, interval=0.2, what="the test dockerd to answer")
        subprocess.run(["docker", "import", "-", "gpumgr-test/busybox:latest"], input=image_tar, env=self.env,
                       check=True, capture_output=True)
        port = free_port()
        self.docker("swarm", "init", "--advertise-addr", "127.0.0.1", "--listen-addr", f"127.0.0.1:{port}")

    def _install(self) -> str:
        result = subprocess.run(
            [sys.executable, "-m", "gpumgr", "plugin", "install", "--daemon-config", str(self.dir / "daemon.json"),
             "--bin-dir", str(self.dir / "bin"), "--cli-plugins-dir", str(self.docker_config / "cli-plugins"),
             "--runtime-config", str(self.dir / "runtime.json"), "--hook-socket", self.hook_socket],
            cwd=ROOT, capture_output=True, text=True, check=True)
        return result.stdout

    def _answers(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"test dockerd exited:\n{(self.dir / 'dockerd.log').read_text()[-3000:]}")
        return subprocess.run(["docker", "info"], env=self.env, capture_output=True).returncode == 0

    def docker(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        """Run the docker CLI against this engine."""
        result = subprocess.run(["docker", *args], env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"docker {' '.join(args)} failed: {result.stderr}")
        return result

    def containers(self, service: str) -> list[dict]:
        """Running containers of ``service`` with their environment and labels."""
        ids = self.docker("ps", "-q", "--no-trunc", "--filter", f"label=com.docker.swarm.service.name={service}"
                          ).stdout.split()
        return json.loads(self.docker("inspect", *ids).stdout) if ids else []

    def stop(self) -> None:
        """Leave the swarm, stop the engine and remove everything it made."""
        self.docker("swarm", "leave", "--force", check=False, timeout=60)
        for cid in self.docker("ps", "-aq", check=False).stdout.split():
            self.docker("rm", "-f", cid, check=False)
        self._log.close()
        stop_engine(self.proc, self.dir)


def stop_engine(proc: subprocess.Popen[bytes], directory: Path) -> None:
    """Stop a throw-away ``dockerd`` (SIGTERM, then SIGKILL of its group) and delete its directory."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    time.sleep(0.2)
    subprocess.run(["umount", "-R", str(directory / "exec")], capture_output=True)
    shutil.rmtree(directory, ignore_errors=True)
