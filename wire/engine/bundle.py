"""An OCI bundle's ``config.json`` as gpumgr reads and pins it at a runtime ``create``.

Shared by the two ends that prepare a Swarm task's container: the Python runtime hook
(:mod:`gpumgr.plugin.hook`) and the agent's pipe for the shell launcher (:mod:`gpumgr.agent.hook.hookfifo`),
so that both read the same request, see the same GPU in a spec, and write the same pinned bundle.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from gpumgr.wire.names import Label

#: The key of the agent's grant that names its MPS daemon's pipe directory (absent where the node runs no MPS).
MPS_PIPE = "mps_pipe"
#: Where a container's shared memory is: an MPS client shares the host's with the daemon.
SHM = "/dev/shm"
GPU_MAJOR = 195
#: A bundle's ``config.json`` is a few kilobytes; one near this is not the engine's.
MAX_SPEC_BYTES = 16 * 1024 * 1024


def read_bundle(bundle: str) -> tuple[Path, dict[str, Any], dict[str, str]] | None:
    """``(config.json's path, the spec, the process environment)``, or None if the bundle cannot be read.

    None leaves the create to the real runtime, which reports an unreadable bundle in its own words.
    """
    spec_path = Path(bundle) / "config.json"
    try:
        with open(spec_path, "rb") as handle:
            data = handle.read(MAX_SPEC_BYTES + 1)
        if len(data) > MAX_SPEC_BYTES:
            return None
        spec = json.loads(data)
        return spec_path, spec, env_map(spec["process"].get("env", []))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def pin_bundle(spec_path: Path, spec: dict[str, Any], env: dict[str, str], grant: dict[str, Any]) -> None:
    """Write ``grant``'s environment (the GPU it pins) and its id into the bundle, atomically."""
    env.update(grant["env"])
    spec["process"]["env"] = [f"{k}={v}" for k, v in env.items()]
    spec.setdefault("annotations", {})[Label.GRANT] = grant["grant"]
    pipe = grant.get(MPS_PIPE)
    if isinstance(pipe, str) and os.path.isabs(pipe):
        join_mps(spec, pipe)
    write_atomically(spec_path, json.dumps(spec))


def join_mps(spec: dict[str, Any], pipe: str) -> None:
    """Make ``spec``'s container an MPS client of the host's daemon: its pipe directory bound, the host's IPC.

    What ``docker run --ipc=host -v PIPE:PIPE`` gives a container, written into the bundle, since a Swarm
    task cannot ask for it: the host's IPC namespace (the container's own ``ipc`` namespace entry goes) and
    the host's ``/dev/shm`` in place of the container's private one. These are the node's additions (its
    agent runs with ``mps: true``), made whatever the service asked for.
    """
    mounts = [m for m in spec.get("mounts") or [] if m.get("destination") not in (pipe, SHM)]
    spec["mounts"] = [*mounts, *({"destination": path, "type": "bind", "source": path, "options": ["rbind", "rw"]}
                                 for path in (pipe, SHM))]
    linux = spec.setdefault("linux", {})
    linux["namespaces"] = [n for n in linux.get("namespaces") or [] if n.get("type") != "ipc"]


def gpu_in_spec(spec: dict[str, Any]) -> str | None:
    """What in an OCI spec gives the container a GPU (NVIDIA nodes, their device rules, the NVIDIA hook), or None."""
    linux = spec.get("linux") or {}
    for device in linux.get("devices") or []:
        if str(device.get("path", "")).startswith("/dev/nvidia") or device.get("major") == GPU_MAJOR:
            return f"it carries the GPU device {device.get('path')}"
    for rule in (linux.get("resources") or {}).get("devices") or []:
        if rule.get("allow") and (rule.get("major") == GPU_MAJOR or (rule.get("major") is None
                                                                     and rule.get("type") in (None, "a"))):
            return f"its device rules open GPU devices ({rule})"
    for stage in ("prestart", "createRuntime"):
        for hook in (spec.get("hooks") or {}).get(stage) or []:
            if "nvidia" in str(hook.get("path", "")):
                return f"it runs the NVIDIA hook {hook.get('path')}"
    return None


def held_refusal(gpu: str, reason: str) -> str:
    """Why a container that carries a GPU (``gpu``, from :func:`gpu_in_spec`) but holds no grant is refused."""
    return (f"gpumgr: refused: {gpu} but holds no gpumgr grant ({reason}); ask gpumgr for a GPU: "
            "'docker gpu run --gpu-memory SIZE ...'")


def env_map(entries: list[str]) -> dict[str, str]:
    """An OCI ``process.env`` list as a dict (the last of a repeated name wins, as in a process)."""
    env: dict[str, str] = {}
    for entry in entries:
        key, _, value = entry.partition("=")
        env[key] = value
    return env


def write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` through a temporary file in its folder: never a half-written spec."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".gpumgr-")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def runc_log_line(message: str) -> str:
    """``message`` as the JSON line runc writes to its ``--log`` file, where Docker reads a runtime's error."""
    return json.dumps({"level": "error", "msg": message, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
