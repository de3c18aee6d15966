"""``docker gpu run`` as a drop-in ``docker run``, and ``docker gpu logs``, ``wait``, ``kill`` and ``rm``.

``docker gpu run --gang N`` submits a gang instead (``POST /v1/gangs``), always detached; ``docker gpu gang``
(:mod:`gpumgr.plugin.gangs_cli`) shows it, reads its members' output and ends it.

``docker run``'s flags are read into the manager's request (``POST /v1/containers``); a flag it has
that gpumgr does not offer is refused by name, never ignored. Without ``-d`` the command attaches:
the container's output is streamed from its node (stdout to stdout, stderr to stderr), signals are
passed on to the container as ``docker run``'s signal proxy does, and the command exits with the
container's exit code. Its own failures exit 125, as ``docker run``'s do (126 and 127 when the
command cannot be run or found). The create runs at most once: it carries an ``Idempotency-Key`` and is
resent with it while its outcome is unknown (a broken connection, 502 ``outcome_unknown``); if it stays
unknown, the command exits 125 and says to look (``docker gpu ps``) before running it again.
"""

from __future__ import annotations

import argparse
import signal
import struct
import sys
import threading
from typing import Any

from gpumgr.plugin.run_flags import build_request, gang_fields, parser
from gpumgr.wire.units import format_bytes

#: ``docker run``'s own failures: the daemon or the CLI, not the container.
EXIT_FAILED, EXIT_CANNOT_INVOKE, EXIT_NOT_FOUND = 125, 126, 127
#: What a container killed by SIGKILL exits with (an overrun, a preemption, a forced removal).
EXIT_KILLED = 137
#: Signals passed on to an attached container (``docker run --sig-proxy``, the default).
PROXIED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
#: After this many SIGINTs the command stops waiting for a container that ignores them.
FORCE_AFTER = 3
MULTIPLEXED = "application/vnd.docker.multiplexed-stream"
FRAME = struct.Struct(">BxxxI")
#: Seconds each wait call asks the manager to hold.
WAIT_STEP = 5.0


def run_container(client: Any, argv: list[str], error: type[Exception]) -> int:
    """``docker gpu run [OPTIONS] IMAGE [COMMAND] [ARG...]``."""
    args = parser(error).parse_args(argv)
    body = build_request(args, error)
    gang = gang_fields(args, error)
    if gang is not None:
        return _submit_gang(client, {**body, **gang}, error)
    if args.rm and not args.detach:
        body.pop("auto_remove", None)  # attached: removed here once its output is read, not by the engine at exit
    try:
        record = client.create(body)  # at most once: keyed, and resent while its outcome is unknown
    except error as exc:
        raise _exit_error(error, _cli_words(str(exc)), _exit_code_for(str(exc))) from None
    if args.detach:
        return _detached(record)
    return Attached(client, record, remove=args.rm, error=error).run()


def _detached(record: dict[str, Any]) -> int:
    if record["state"] == "queued":
        place = record["queue"]
        print(f"{record['id']}  queued at position {place['position']} of {place['length']}: it starts as soon as "
              "room frees ('docker gpu ps' shows it)")
        return 0
    print(record["id"])
    return 0


def _submit_gang(client: Any, body: dict[str, Any], error: type[Exception]) -> int:
    """``run --gang N``, always detached: the gang's id once every member runs, or its place while it waits whole.

    Sent once, without a key (``POST /v1/gangs`` takes none): a broken connection says the outcome is unknown.
    """
    try:
        view = client.call("POST", "/v1/gangs", json_body=body)
    except error as exc:
        raise _exit_error(error, _cli_words(str(exc)), _exit_code_for(str(exc))) from None
    if view["state"] == "queued":
        print(f"{view['id']}  queued at position {view['queue']['position']}: it starts whole as soon as every "
              "member fits ('docker gpu gang ps' shows it)")
    else:
        print(view["id"])
    return 0


class Attached:
    """One attached run: output streamed, signals passed on, the container's exit code returned."""

    def __init__(self, client: Any, record: dict[str, Any], *, remove: bool, error: type[Exception]) -> None:
        self.client = client
        self.id = str(record["id"])
        self.record = record
        self.remove = remove
        self.error = error
        self.interrupts = 0
        self.forced = threading.Event()

    def run(self) -> int:
        """Wait for it to start, stream its output until it ends, and return its exit code."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in PROXIED}
        try:
            return self._run()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if self.remove:
                self._remove()

    def _run(self) -> int:
        if self.record["state"] == "queued":
            place = self.record["queue"]
            _say(f"queued at position {place['position']} of {place['length']}; waiting for room (Ctrl-C "
                 "withdraws it)")
        while self.record["state"] in ("queued", "creating"):
            if self.forced.wait(0.5):
                return EXIT_FAILED
            self.record = self.client.call("GET", f"/v1/containers/{self.id}")
        reader = threading.Thread(target=self._copy_output, name="output", daemon=True)
        if self.record.get("container_id"):
            reader.start()
        end = self._wait()
        if end is None:
            _say(f"got {FORCE_AFTER} SIGINTs, stopped waiting; container {self.id} "
                 + ("is removed" if self.remove else "keeps running"))
            return EXIT_FAILED
        while reader.is_alive() and not self.forced.is_set():  # the manager ends the stream once all is out
            reader.join(0.05)
        return self._exit_code(end)

    def _wait(self) -> dict[str, Any] | None:
        while not self.forced.is_set():
            try:
                end: dict[str, Any] = self.client.call("POST", f"/v1/containers/{self.id}/wait",
                                                       params={"timeout": str(WAIT_STEP)})
            except self.error:
                if self.forced.is_set():
                    break
                raise
            if end["ended"]:
                return end
        return None

    def _copy_output(self) -> None:
        """Copy the container's output to ours until it ends (stdout to stdout, stderr to stderr)."""
        outputs = {1: sys.stdout.buffer, 2: sys.stderr.buffer}
        try:
            with self.client.stream(f"/v1/containers/{self.id}/logs", {"follow": "1"}, MULTIPLEXED) as response:
                while True:
                    header = response.read(FRAME.size)
                    if len(header) < FRAME.size:
                        return
                    stream, size = FRAME.unpack(header)
                    out = outputs.get(stream, sys.stdout.buffer)
                    out.write(response.read(size))
                    out.flush()
        except (self.error, OSError, ValueError):  # the stream broke; the exit code still comes from the wait
            return

    def _exit_code(self, end: dict[str, Any]) -> int:
        state, code, reason = end["state"], end.get("exit_code"), end.get("reason")
        if state == "exited" and code is not None:
            return int(code)
        if state in ("killed", "preempted", "removed"):
            _say(f"container {self.id} {state}: {reason or 'no reason given'}{self._overrun()}")
            return int(code) if code is not None and code != 0 else EXIT_KILLED
        _say(f"container {self.id} {state}: {reason or 'no reason given'}")
        return _exit_code_for(reason or "")

    def _overrun(self) -> str:
        """`` (used X of its Y grant)`` when it was killed for an overrun, else nothing."""
        try:
            detail = self.client.call("GET", f"/v1/containers/{self.id}").get("detail") or {}
        except self.error:
            return ""
        overrun = detail.get("overrun") or {}
        if not isinstance(overrun, dict) or "observed" not in overrun:
            return ""
        return f" (its GPU memory use reached {format_bytes(int(overrun['observed']))}, over its grant of " \
               f"{format_bytes(int(overrun.get('grant_bytes') or 0))})"

    def _on_signal(self, signum: int, _frame: Any) -> None:
        """Pass the signal on to the container; after ``FORCE_AFTER`` SIGINTs stop waiting for it."""
        if signum == signal.SIGINT:
            self.interrupts += 1
            if self.interrupts >= FORCE_AFTER:
                self.forced.set()
                return
        name = signal.Signals(signum).name
        try:
            if self.record["state"] == "queued" and signum in (signal.SIGINT, signal.SIGTERM):
                self.client.call("DELETE", f"/v1/containers/{self.id}")  # withdraw a request still waiting
                self.forced.set()
            else:
                self.client.call("POST", f"/v1/containers/{self.id}/kill", params={"signal": name})
        except self.error as exc:  # it may have ended meanwhile: the wait says how
            _say(f"could not pass {name} on: {exc}")

    def _remove(self) -> None:
        try:
            self.client.call("DELETE", f"/v1/containers/{self.id}")
        except self.error as exc:
            _say(f"could not remove container {self.id}: {exc}")


def logs(client: Any, argv: list[str], error: type[Exception]) -> int:
    """``docker gpu logs [-f] [--tail N] CONTAINER``: its output, stdout to stdout and stderr to stderr."""
    options = argparse.ArgumentParser(prog="docker gpu logs")
    options.add_argument("-f", "--follow", action="store_true")
    options.add_argument("-n", "--tail", default="all")
    options.add_argument("container")
    args = options.parse_args(argv)
    params = {"follow": "1" if args.follow else "0", "tail": args.tail}
    outputs = {1: sys.stdout.buffer, 2: sys.stderr.buffer}
    with client.stream(f"/v1/containers/{args.container}/logs", params, MULTIPLEXED) as response:
        while len(header := response.read(FRAME.size)) == FRAME.size:
            stream, size = FRAME.unpack(header)
            outputs.get(stream, sys.stdout.buffer).write(response.read(size))
            outputs.get(stream, sys.stdout.buffer).flush()
    return 0


def wait(client: Any, argv: list[str], error: type[Exception]) -> int:
    """``docker gpu wait CONTAINER...``: block until each ends, print its exit code."""
    if not argv:
        raise error("docker gpu wait needs at least one container")
    for name in argv:
        while not (end := client.call("POST", f"/v1/containers/{name}/wait", params={"timeout": "60"}))["ended"]:
            pass
        print(end["exit_code"] if end["exit_code"] is not None else -1)
    return 0


def kill(client: Any, argv: list[str], error: type[Exception]) -> int:
    """``docker gpu kill [-s SIGNAL] CONTAINER...``."""
    args = _containers_args("kill", argv, ("-s", "--signal"), default="SIGKILL")
    for name in args.containers:
        client.call("POST", f"/v1/containers/{name}/kill", params={"signal": args.signal})
        print(name)
    return 0


def remove(client: Any, argv: list[str], error: type[Exception]) -> int:
    """``docker gpu rm [-f] CONTAINER...``: a running container only with ``-f``, as ``docker rm``."""
    args = _containers_args("rm", argv, ("-f", "--force"), action="store_true")
    failed = 0
    for name in args.containers:
        record = client.call("GET", f"/v1/containers/{name}")
        if record["state"] in ("running", "creating") and not args.force:
            _say(f"Error response: you cannot remove a running container {record['id']}. Stop the container "
                 "before attempting removal or force remove (-f)")
            failed = 1
            continue
        client.call("DELETE", f"/v1/containers/{record['id']}")
        print(name)
    return failed


def _containers_args(command: str, argv: list[str], flags: tuple[str, str], **option: Any) -> argparse.Namespace:
    """``docker gpu COMMAND [FLAG] CONTAINER...`` read: one option and at least one container."""
    options = argparse.ArgumentParser(prog=f"docker gpu {command}")
    options.add_argument(*flags, **option)
    options.add_argument("containers", nargs="+")
    return options.parse_args(argv)


def _cli_words(message: str) -> str:
    """The manager's refusal in this command's words: ``--queue``, not the API's ``"queue": true``."""
    if not message.endswith("(no_fit)"):
        return message
    text = message.removesuffix(" (no_fit)").replace('; send "queue": true to wait for room', "")
    return f"{text}; add --queue to wait for room (no_fit)"


def _exit_code_for(message: str) -> int:
    """``docker run``'s code for a failed start: 127 command not found, 126 not runnable, else 125."""
    text = message.lower()
    if "executable file not found" in text or "no such file or directory" in text:
        return EXIT_NOT_FOUND
    if "permission denied" in text:
        return EXIT_CANNOT_INVOKE
    return EXIT_FAILED


def _exit_error(error: type[Exception], message: str, status: int) -> Exception:
    exc = error(message)
    exc.status = status  # type: ignore[attr-defined]
    return exc


def _say(text: str) -> None:
    print(f"docker gpu: {text}", file=sys.stderr, flush=True)
