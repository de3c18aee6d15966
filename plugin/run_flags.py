"""``docker run``'s flags read into the manager's request body (``POST /v1/containers``, or ``/v1/gangs``
with ``--gang N``).

Each flag ``docker gpu run`` takes becomes the field docker-py names (``-v`` → ``volumes``, ``-p`` →
``ports``, ``--cpus`` → ``nano_cpus``...); the manager validates every value. A ``docker run`` flag
gpumgr does not offer is refused by name with the reason, never ignored.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gpumgr.wire.units import parse_bytes, parse_docker_bytes

#: ``docker run`` flags refused by name, and why.
REFUSED = {
    ("-i", "--interactive"): "there is no input: the output is streamed from the container's node",
    ("-t", "--tty"): "the output is streamed from the container's node, without a terminal",
    ("--restart",): "gpumgr decides what happens after an exit (the grant ends with the container)",
    ("-a", "--attach"): "without -d both stdout and stderr are attached",
    ("--runtime",): "the node's runtime is chosen by its operator",
    ("--security-opt",): "security options are the node's, not the request's",
    ("--userns", "--uts", "--cgroup-parent", "--cgroupns"): "these namespaces and cgroups are the node's",
    ("--volumes-from",): "name each mount with -v or --mount",
    ("--sysctl",): "kernel parameters are the node's",
    ("--sig-proxy",): "signals are always passed on while attached",
    ("--platform", "--pull"): "the image must already be on the node",
}


class _Refuse(argparse.Action):
    """A ``docker run`` flag gpumgr does not offer: an error naming it and saying why."""

    def __init__(self, option_strings: Sequence[str], dest: str, why: str = "", error: type[Exception] = ValueError,
                 **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)
        self.why, self.error = why, error

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        raise self.error(f"docker gpu run does not take {'/'.join(self.option_strings)}: {self.why}")


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are the plugin's (exit 125, one line), not a usage dump and exit 2."""

    error_type: type[Exception] = ValueError

    def error(self, message: str) -> Any:
        raise self.error_type(f"docker gpu run: {message} (see 'docker gpu run --help')")


def parser(error: type[Exception]) -> argparse.ArgumentParser:
    """The parser of ``docker gpu run``'s flags; its errors raise ``error``."""
    p = _Parser(prog="docker gpu run", description="docker run, placed on a GPU by gpumgr")
    p.error_type = error
    add = p.add_argument
    add("--gpu-memory", required=True, help="GPU memory granted on each GPU, e.g. 8GiB")
    add("--gpu-memory-limit", help="a burstable grant: what it may use on each GPU while the GPU has room, e.g. "
                                   "12GiB (at least --gpu-memory); its burst is reclaimed when a request needs it")
    add("--gpus", default="1", help="how many GPUs (a number; Docker's 'all' and device= are not taken)")
    for flag in ("--node", "--name", "--placement", "--on-overrun", "--network", "--net", "--shm-size", "--ipc",
                 "--pid", "--entrypoint", "--cpus", "--stop-signal", "--log-driver"):
        add(flag, dest=flag.lstrip("-").replace("-", "_"))
    add("-w", "--workdir")
    add("-u", "--user")
    add("-m", "--memory")
    add("--priority", type=int, help="higher is placed first (default and ceiling: your tenant's)")
    add("--preemptible", action="store_true", help="may be stopped for a queued request of higher priority")
    add("--compute-share", type=int, help="percent of each GPU's SMs (1-100), on nodes that run MPS")
    add("--queue", action="store_true", help="wait for room instead of failing with no_fit")
    add("--queue-timeout", type=float, help="seconds to wait in the queue (with --queue)")
    add("--constraint", action="append", default=[], help="where it may run, e.g. gpu.model==*H100* (repeatable)")
    add("--gang", help="run N members placed all at once or none, each told its rank and torchrun's rendezvous "
                       "(always detached: prints the gang's id)")
    add("--no-one-per-node", action="store_true", help="with --gang: members may share a node")
    add("--restart-gang", help="with --gang: place a failed gang again whole, up to N times")
    for short, flag in (("-e", "--env"), ("-l", "--label"), ("-v", "--volume"), ("-p", "--publish"), ("", "--mount"),
                        ("", "--env-file"), ("", "--ulimit"), ("", "--cap-add"), ("", "--log-opt"),
                        ("", "--device"), ("", "--tmpfs"), ("", "--label-file")):
        add(*filter(None, (short, flag)), action="append", default=[])
    add("--privileged", action="store_true")
    add("--rm", action="store_true", help="remove the container (and free its grant) when it ends")
    add("-d", "--detach", action="store_true", help="print its id and return at once")
    for flags, why in REFUSED.items():
        add(*flags, action=_Refuse, why=why, error=error)
    add("image")
    add("command", nargs=argparse.REMAINDER)
    return p


def build_request(args: argparse.Namespace, error: type[Exception]) -> dict[str, Any]:
    """The body of ``POST /v1/containers`` that ``args`` ask for."""
    if not args.gpus.isdigit():
        raise error(f"--gpus takes a number of GPUs, not Docker's {args.gpus!r} (gpumgr grants the GPUs: "
                    "give --gpus N with --gpu-memory)")
    body: dict[str, Any] = {"image": args.image, "command": args.command, "gpu_memory": _size(args.gpu_memory, error),
                            "gpus": int(args.gpus), "env": _env(args.env_file, args.env, error),
                            "labels": {**_label_files(args.label_file, error), **_pairs(args.label, error)}}
    simple = {"name": args.name, "node": args.node, "placement": args.placement, "on_overrun": args.on_overrun,
              "queue_timeout": args.queue_timeout, "priority": args.priority, "network": args.network or args.net,
              "compute_share": args.compute_share,
              "ipc_mode": args.ipc, "pid_mode": args.pid, "working_dir": args.workdir, "user": args.user,
              "stop_signal": args.stop_signal,
              "entrypoint": None if args.entrypoint is None else [args.entrypoint] if args.entrypoint else [],
              "shm_size": _size(args.shm_size, error, parse_docker_bytes) if args.shm_size is not None else None,
              "mem_limit": _size(args.memory, error, parse_docker_bytes) if args.memory is not None else None,
              "nano_cpus": _cpus(args.cpus, error) if args.cpus else None}
    body.update({k: v for k, v in simple.items() if v is not None})
    if args.gpu_memory_limit is not None:
        body["gpu_memory_limit"] = _size(args.gpu_memory_limit, error)
    body.update({k: True for k in ("preemptible", "queue", "privileged") if getattr(args, k)})
    if args.constraint:
        body["constraints"] = list(args.constraint)
    if args.rm:
        body["auto_remove"] = True
    lists = {"volumes": args.volume, "mounts": [_mount(m, error) for m in args.mount],
             "cap_add": args.cap_add, "devices": args.device,
             "ulimits": [_ulimit(u, error) for u in args.ulimit]}
    lists["mounts"] += [{"type": "tmpfs", "target": t} for t in args.tmpfs]
    body.update({k: v for k, v in lists.items() if v})
    ports = dict(_publish(p, error) for p in args.publish)
    if ports:
        body["ports"] = ports
    if args.log_driver or args.log_opt:
        body["log_config"] = {"type": args.log_driver or "json-file", "config": _pairs(args.log_opt, error)}
    return body


def gang_fields(args: argparse.Namespace, error: type[Exception]) -> dict[str, Any] | None:
    """The fields ``POST /v1/gangs`` adds to a container's body (None without ``--gang``; its flags need it)."""
    if args.gang is None:
        if args.no_one_per_node or args.restart_gang is not None:
            raise error("--no-one-per-node and --restart-gang are for a gang: add --gang N")
        return None
    if not args.gang.isdigit() or int(args.gang) < 2:
        raise error(f"--gang takes how many members, 2 or more, not {args.gang!r}")
    restarts = args.restart_gang or "0"
    if not restarts.isdigit():
        raise error(f"--restart-gang takes how many times a failed gang is placed again, not {restarts!r}")
    return {"replicas": int(args.gang), "one_per_node": not args.no_one_per_node,
            "restart": "gang" if int(restarts) else "never", "max_restarts": int(restarts)}


def _size(text: str, error: type[Exception], parse: Callable[[str], int] = parse_bytes) -> int:
    """``text`` in bytes: gpumgr's units by default, ``parse_docker_bytes`` for the flags docker run reads itself."""
    try:
        return parse(text)
    except ValueError as exc:
        raise error(f"invalid size {text!r}: {exc}") from None


def _cpus(text: str, error: type[Exception]) -> int:
    try:
        cpus = float(text)
    except ValueError:
        cpus = -1.0
    if not 0 < cpus <= 4096:
        raise error(f"--cpus takes a number of CPUs such as 1.5, not {text!r}")
    return round(cpus * 1e9)


def _pairs(items: list[str], error: type[Exception]) -> dict[str, str]:
    pairs = {}
    for item in items:
        key, _, value = item.partition("=")
        if not key:
            raise error(f"expected KEY=VALUE, got {item!r}")
        pairs[key] = value
    return pairs


def _env(files: list[str], items: list[str], error: type[Exception]) -> dict[str, str]:
    """``--env-file`` lines, then ``-e``; a bare ``NAME`` takes its value from this environment, as docker does."""
    lines = [line.strip() for name in files for line in _read(name, error).splitlines()]
    env: dict[str, str] = {}
    for item in [line for line in lines if line and not line.startswith("#")] + items:
        key, sep, value = item.partition("=")
        if not key:
            raise error(f"expected NAME=VALUE or NAME, got {item!r}")
        if sep:
            env[key] = value
        elif key in os.environ:
            env[key] = os.environ[key]
    return env


def _label_files(files: list[str], error: type[Exception]) -> dict[str, str]:
    lines = [line.strip() for name in files for line in _read(name, error).splitlines()]
    return _pairs([line if "=" in line else line + "=" for line in lines if line and not line.startswith("#")],
                  error)


def _read(name: str, error: type[Exception]) -> str:
    try:
        return Path(name).read_text()
    except OSError as exc:
        raise error(f"cannot read {name}: {exc.strerror or exc}") from None


def _mount(text: str, error: type[Exception]) -> dict[str, Any]:
    """``--mount type=bind,source=/a,target=/b,readonly`` as the API's mount."""
    mount: dict[str, Any] = {"type": "volume"}
    for part in text.split(","):
        key, _, value = part.partition("=")
        key = key.strip().lower()
        if key == "type":
            mount["type"] = value
        elif key in ("source", "src"):
            mount["source"] = value
        elif key in ("target", "destination", "dst"):
            mount["target"] = value
        elif key in ("readonly", "ro"):
            mount["read_only"] = value.lower() in ("", "1", "true")
        else:
            raise error(f"--mount: {key!r} is not taken (type, source, target, readonly)")
    return mount


def _ulimit(text: str, error: type[Exception]) -> dict[str, Any]:
    name, _, limits = text.partition("=")
    soft, _, hard = limits.partition(":")
    try:
        return {"name": name, "soft": int(soft), **({"hard": int(hard)} if hard else {})}
    except ValueError:
        raise error(f"--ulimit takes NAME=SOFT[:HARD], e.g. memlock=-1, not {text!r}") from None


def _publish(text: str, error: type[Exception]) -> tuple[str, Any]:
    """``-p [IP:][HOST:]CONTAINER[/PROTO]`` as one ``ports`` entry."""
    spec, _, proto = text.partition("/")
    ip = ""
    if spec.startswith("["):  # an IPv6 address
        ip, _, spec = spec[1:].partition("]:")
    parts = spec.split(":")
    if len(parts) == 3 and not ip:
        ip, parts = parts[0], parts[1:]
    if len(parts) > 2 or not all(p.isdigit() for p in parts[-1:]) or not all(p.isdigit() for p in parts[:-1] if p) \
            or proto not in ("", "tcp", "udp", "sctp"):
        raise error(f"-p takes [IP:][HOST_PORT:]CONTAINER_PORT[/PROTOCOL] (no ranges), not {text!r}")
    host = int(parts[0]) if len(parts) == 2 and parts[0] else None
    return f"{parts[-1]}/{proto or 'tcp'}", ([ip, host] if ip else host)
