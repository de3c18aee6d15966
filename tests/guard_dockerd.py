"""A throw-away Docker engine started with the guard as its authorization plugin (or with none).

It runs beside the host's engine (own socket, data, exec root and containerd, no bridge, no
iptables), so the host's engine is never configured with an authorization plugin. It registers a
runtime named ``nvidia`` that is plain runc, so a request for that runtime reaches the guard (and,
on the reference engine without a guard, is created) instead of failing as an unknown runtime.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import docker

from tests.images import IMAGE
from tests.procs import wait_for
from tests.swarm import stop_engine

DOCKERD_START = 60.0


class GuardEngine:
    """``dockerd --authorization-plugin=PLUGIN`` (or no plugin) in a temporary directory.

    ``daemon`` replaces the daemon.json written (a plain-runc ``nvidia`` runtime), ``flags`` are added to dockerd's.
    """

    def __init__(self, image_tar: bytes, plugin: str | None, daemon: dict[str, Any] | None = None,
                 flags: tuple[str, ...] = ()) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="gpumgr-gd-"))
        self.socket = self.dir / "docker.sock"
        self.plugin = plugin
        self.daemon = daemon if daemon is not None else {"runtimes": {"nvidia": {"path": "runc"}}}
        self.flags = flags
        self.env = {**os.environ, "DOCKER_HOST": f"unix://{self.socket}", "DOCKER_CONFIG": str(self.dir / "cfg")}
        self.start()
        self.docker("import", "-", IMAGE, input=image_tar)
        self.image_id = self.docker("image", "inspect", "--format", "{{.Id}}", IMAGE).stdout.strip()
        self.client = docker.DockerClient(base_url=f"unix://{self.socket}", timeout=120)

    def start(self) -> None:
        """Start dockerd and wait until it answers."""
        self._log = open(self.dir / "dockerd.log", "ab")  # noqa: SIM115 - closed in stop()
        (self.dir / "daemon.json").write_text(json.dumps(self.daemon))
        plugin = [f"--authorization-plugin={self.plugin}"] if self.plugin else []
        self.proc = subprocess.Popen(
            ["dockerd", "--bridge=none", "--iptables=false", "--ip-masq=false", "-H", f"unix://{self.socket}",
             "--data-root", str(self.dir / "data"), "--exec-root", str(self.dir / "exec"),
             "--pidfile", str(self.dir / "docker.pid"), "--config-file", str(self.dir / "daemon.json"),
             *plugin, *self.flags],
            env=self.env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(self._answers, DOCKERD_START, interval=0.2, what="the test dockerd to answer")

    def _answers(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"test dockerd exited:\n{self.log()[-3000:]}")
        return subprocess.run(["docker", "version"], env=self.env, capture_output=True, timeout=60).returncode == 0

    def log(self) -> str:
        """What dockerd wrote."""
        return (self.dir / "dockerd.log").read_text(errors="replace")

    def docker(self, *args: str, check: bool = True, timeout: float = 120,
               input: bytes | None = None) -> subprocess.CompletedProcess:
        """Run the docker CLI against this engine."""
        result = subprocess.run(["docker", *args], env=self.env, capture_output=True, timeout=timeout, input=input)
        out = subprocess.CompletedProcess(result.args, result.returncode, result.stdout.decode(errors="replace"),
                                          result.stderr.decode(errors="replace"))
        if check and result.returncode != 0:
            raise AssertionError(f"docker {' '.join(args)} failed: {out.stderr}")
        return out

    def stop(self) -> None:
        """Remove every container, stop the engine and delete its directory."""
        self.client.close()
        for cid in self.docker("ps", "-aq", check=False).stdout.split():
            self.docker("rm", "-f", cid, check=False)
        self._log.close()
        stop_engine(self.proc, self.dir)
