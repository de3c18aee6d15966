"""``gpumgr-runtime``: an OCI runtime in front of runc (or the NVIDIA runtime) that pins Swarm tasks.

Swarm services cannot carry devices, so the GPU of each replica is chosen on its node at the one
moment Docker tells the node about the container: the runtime ``create`` call. If the container's
environment asks for GPU memory (``GPUMGR_REQUEST_MEMORY``, set by ``docker gpu service create``),
this program asks the local agent for a grant, writes ``NVIDIA_VISIBLE_DEVICES`` and the grant into
the bundle's ``config.json``, and then runs the real runtime with the unchanged arguments. Every
other call, and every container that asks for nothing, passes straight through.

When no GPU on the node has room, ``create`` fails with the reason written to runc's ``--log``
file, which is where Docker reads runtime errors from: ``docker service ps --no-trunc`` shows it,
and Swarm retries the task. Nothing is ever printed: during ``create`` stdout and stderr are the
container's own output.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any, NoReturn

from gpumgr.wire import defaults
from gpumgr.wire.engine.bundle import gpu_in_spec, held_refusal, pin_bundle, read_bundle, runc_log_line
from gpumgr.wire.names import Env, Label, flag_set
from gpumgr.wire.units import parse_bytes

REQUEST_MEMORY = Env.REQUEST_MEMORY
REQUEST_GPUS = Env.REQUEST_GPUS
REQUEST_ON_OVERRUN = Env.REQUEST_ON_OVERRUN
TASK_ENV = {Env.TASK: Label.TASK, Env.SERVICE: Label.SERVICE, Env.SLOT: Label.SLOT}
TASK_NAME = Env.TASK_NAME
DEFAULT_SOCKET = "/run/gpumgr/agent.sock"
CONFIG = "/etc/gpumgr/runtime.json"
#: Longer than the agent's own wait for the manager, so the agent's answer (even a timeout) arrives.
WAIT_SECONDS = defaults.HOOK_WAIT
#: A reply is a grant: a few hundred bytes. Anything near this is not from the agent.
MAX_REPLY_BYTES = 1024 * 1024
#: runc's global options that take a value; everything else before the command is a flag.
VALUE_OPTIONS = frozenset({"--root", "--log", "--log-format", "--criu", "--rootless"})
RUNTIME_CANDIDATES = ("nvidia-container-runtime", "runc")
#: What the launcher greps a bundle for besides the request: GPU nodes, their device rules, an allow-all
#: rule, the NVIDIA prestart hook. Such a container is checked here to hold a grant (:func:`gpu_in_spec`).
GPU_SPEC_PATTERN = r'/dev/nvidia|"major":195[,}]|nvidia-container-runtime-hook|"allow":true,"access"'
SEARCH_PATH = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")


class Refused(Exception):
    """The container asked for GPU memory and cannot have it; the message says why."""


def main(argv: list[str] | None = None) -> NoReturn:
    """Entry point: prepare ``create`` calls, then become the real runtime."""
    argv = sys.argv[1:] if argv is None else argv
    config = _config()
    command, position, log_file = split_command(argv)
    granted = False
    if command == "create":
        try:
            granted = prepare(argv[position + 1:], config)
        except Refused as exc:
            _fail(log_file, str(exc))
    # only a container that holds a grant goes to the GPU runtime, pinned to its GPUs; any other (one
    # that merely mentions the request in its command, say) must not see every GPU through it
    real = real_runtime(config) if granted else (os.environ.get(Env.RUNC) or config.get("plain_runtime")
                                                 or real_runtime(config))
    os.execv(real, [real, *argv])


def split_command(argv: list[str]) -> tuple[str | None, int, str | None]:
    """Find runc's command among its global options: ``(command, index, --log value)``."""
    log_file, skip = None, False
    for index, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        name, has_value, value = arg.partition("=")
        if name in VALUE_OPTIONS:
            if name == "--log":
                log_file = value if has_value else (argv[index + 1] if index + 1 < len(argv) else None)
            skip = not has_value
        elif not arg.startswith("-"):
            return arg, index, log_file
    return None, len(argv), log_file


def prepare(args: list[str], config: dict[str, Any]) -> bool:
    """For ``create ARGS``: if the bundle asks for GPU memory, get a grant and write it into the bundle.

    Returns whether it did (the container then holds a grant).
    """
    bundle, container_id = _create_target(args)
    read = read_bundle(bundle)
    if read is None:
        return False  # not a bundle we can read: the real runtime reports that in its own words
    spec_path, spec, env = read
    if REQUEST_MEMORY in env:
        wait = defaults.HOOK_QUEUE_WAIT if flag_set(env.get(Env.REQUEST_QUEUE)) else WAIT_SECONDS
        grant = ask_agent(_reserve_message(container_id, env), _socket_path(config), wait)
    elif (gpu := gpu_in_spec(spec)) is not None:
        grant = _held_grant(container_id, gpu, config)
    else:
        return False
    pin_bundle(spec_path, spec, env, grant)
    return True


def _held_grant(container_id: str, gpu: str, config: dict[str, Any]) -> dict[str, Any]:
    """The grant a container carrying GPUs holds (one gpumgr created); Refused, saying so, if it holds none."""
    message = {"container_id": container_id, "gpu_memory": 1, "gpus": 1, "name": "", "image": "", "labels": {},
               "on_overrun": None, "node": ""}
    try:
        return ask_agent(message, _socket_path(config))
    except Refused as exc:
        raise Refused(held_refusal(gpu, str(exc))) from None


def ask_agent(request: dict[str, Any], socket_path: str, wait: float = WAIT_SECONDS) -> dict[str, Any]:
    """Send a ``reserve`` body to the agent on ``socket_path`` and return the grant; raise Refused with its reason.

    A plain Unix stream socket and the msgpack envelope, each message preceded by its length
    (``wire.envelope.frame``): this runs once per GPU container created on the node, and importing
    anything more (ZeroMQ, a validation library) would be most of its cost.
    """
    import socket  # imported here: every other runtime call passes through without paying for it

    from gpumgr.wire import envelope
    from gpumgr.wire.errors import ProtocolError

    if not Path(socket_path).exists():
        raise Refused(f"gpumgr: no gpumgr agent listens on {socket_path}; start 'gpumgr agent' on this node")
    msg_id = envelope.new_id()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(wait)
            sock.connect(socket_path)
            sock.sendall(envelope.frame(envelope.pack("reserve", request, msg_id=msg_id)))
            (size,) = envelope.FRAME_HEADER.unpack(_receive(sock, envelope.FRAME_HEADER.size))
            if size > MAX_REPLY_BYTES:
                raise ProtocolError(f"a reply of {size} bytes is over the {MAX_REPLY_BYTES} bound")
            reply = envelope.unpack(_receive(sock, size))
    except TimeoutError as exc:
        raise Refused(f"gpumgr: the agent did not answer within {wait:g}s") from exc
    except (OSError, ProtocolError) as exc:
        raise Refused(f"gpumgr: cannot talk to the agent on {socket_path}: {exc}") from exc
    return _grant_from(reply, msg_id)


def _receive(sock: Any, size: int) -> bytes:
    """Exactly ``size`` bytes from ``sock``; ConnectionError if it closes first."""
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the agent closed the connection without an answer")
        data += chunk
    return bytes(data)


def _grant_from(reply: Any, msg_id: str) -> dict[str, Any]:
    body = reply.get("body") if isinstance(reply, dict) else None
    if not isinstance(body, dict) or reply.get("type") != "reply" or reply.get("reply_to") != msg_id:
        raise Refused("gpumgr: the agent sent something that is not an answer to this request")
    if not body.get("ok"):
        error = body.get("error") or {}
        raise Refused(f"gpumgr: {error.get('message', 'refused') if isinstance(error, dict) else 'refused'}")
    result = body.get("result")
    if not isinstance(result, dict) or not isinstance(result.get("env"), dict) or "grant" not in result:
        raise Refused("gpumgr: the agent's grant is incomplete")
    return result


def real_runtime(config: dict[str, Any]) -> str:
    """The runtime to hand over to: configured, else the NVIDIA runtime if installed, else runc."""
    configured = os.environ.get(Env.RUNC) or config.get("runtime")
    if configured:
        return configured
    for name in RUNTIME_CANDIDATES:
        found = shutil.which(name, path=os.pathsep.join(SEARCH_PATH))
        if found:
            return found
    _fail(None, "gpumgr: neither nvidia-container-runtime nor runc was found")


def _reserve_message(container_id: str, env: dict[str, str]) -> dict[str, Any]:
    """The body of a ``reserve`` message (the agent validates it in full before forwarding it)."""
    try:
        memory, gpus = parse_bytes(env[REQUEST_MEMORY]), int(env.get(REQUEST_GPUS, "1"))
    except ValueError as exc:
        raise Refused(f"gpumgr: bad GPU request in the container's environment: {exc}") from exc
    if memory <= 0 or gpus <= 0:
        raise Refused(f"gpumgr: bad GPU request in the container's environment: {memory} bytes on {gpus} GPU(s)")
    return {"container_id": container_id, "gpu_memory": memory, "gpus": gpus, "name": env.get(TASK_NAME, ""),
            "image": "", "labels": {label: env[var] for var, label in TASK_ENV.items() if env.get(var)},
            "on_overrun": env.get(REQUEST_ON_OVERRUN) or None, "node": "",
            **_limit_field(env)}


def _limit_field(env: dict[str, str]) -> dict[str, int]:
    """A burstable request's limit (``GPUMGR_REQUEST_MEMORY_LIMIT``), when the container's environment sets one."""
    text = env.get(Env.REQUEST_MEMORY_LIMIT)
    if not text:
        return {}
    try:
        return {"gpu_memory_limit": parse_bytes(text)}
    except ValueError as exc:
        raise Refused(f"gpumgr: bad GPU memory limit in the container's environment: {exc}") from exc


def _create_target(args: list[str]) -> tuple[str, str]:
    bundle, positional, skip = os.getcwd(), [], False
    for index, arg in enumerate(args):
        if skip:
            skip = False
            continue
        if arg in ("--bundle", "-b"):
            bundle, skip = (args[index + 1] if index + 1 < len(args) else bundle), True
        elif arg.startswith("--bundle="):
            bundle = arg.split("=", 1)[1]
        elif arg in ("--pid-file", "--console-socket", "--preserve-fds"):
            skip = True
        elif not arg.startswith("-"):
            positional.append(arg)
    if not positional:
        raise Refused("gpumgr: create without a container id")
    return bundle, positional[-1]


def _socket_path(config: dict[str, Any]) -> str:
    return os.environ.get(Env.HOOK_SOCKET) or config.get("hook_socket") or DEFAULT_SOCKET


def _config() -> dict[str, Any]:
    try:
        config: dict[str, Any] = json.loads(Path(os.environ.get(Env.RUNTIME_CONFIG, CONFIG)).read_text())
        return config
    except (OSError, ValueError):
        return {}


def _fail(log_file: str | None, message: str) -> NoReturn:
    """Fail the runtime call the way runc does: an error line in the ``--log`` file, exit status 1."""
    if log_file:
        try:
            with open(log_file, "a") as handle:
                handle.write(runc_log_line(message) + "\n")
        except OSError:
            pass
    sys.exit(1)


if __name__ == "__main__":
    main()
