"""What every ``docker gpu`` command stands on: the manager it talks to, the error it prints, and the ``docker``
calls it passes through.

Kept apart from :mod:`gpumgr.plugin.docker_gpu` (the dispatcher) so that the commands it loads lazily
(services, stacks, runs, stats) import this, not the dispatcher that imports them: no import circle.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from gpumgr import client_keyed
from gpumgr.client import Client, ManagerUnreachable, Stream
from gpumgr.wire import defaults
from gpumgr.wire.errors import GpumgrError, OutcomeUnknown
from gpumgr.wire.names import Env
from gpumgr.wire.units import parse_bytes

DEFAULT_MANAGER = "http://127.0.0.1:9400"


CONFIG_PATH = "~/.config/gpumgr/plugin.yaml"


TIMEOUT = defaults.CLI_TIMEOUT


#: ``docker gpu run`` when nobody knows whether the container was created: ``docker run``'s own failure code.
EXIT_UNKNOWN = 125


class PluginError(Exception):
    """Something the user must fix; printed as one line, exit status ``status`` (1; ``docker gpu run``: 125)."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


class Manager:
    """The manager's REST API through the Python client (:mod:`gpumgr.client`), its errors as PluginError."""

    def __init__(self, url: str | None) -> None:
        settings = _settings()
        urls = url or os.environ.get(Env.MANAGER) or settings.get("manager") or DEFAULT_MANAGER
        token = os.environ.get(Env.TOKEN) or settings.get("token")
        try:
            self.client = Client(str(urls), str(token) if token else None, TIMEOUT)
        except GpumgrError as exc:
            raise PluginError(f"{exc.message}; set --manager or GPUMGR_MANAGER") from None
        self.url = self.client.api.url

    def call(self, method: str, path: str, *, params: dict[str, str] | None = None, json_body: Any = None) -> Any:
        """One REST call; its JSON answer."""
        try:
            return self.client.api.call(method, path, params=params, body=json_body)
        except GpumgrError as exc:
            raise _plugin_error(exc) from None

    def create(self, body: dict[str, Any]) -> Any:
        """``POST /v1/containers`` run at most once (an ``Idempotency-Key``, resent while the outcome is unknown).

        When it stays unknown, the PluginError (exit 125) tells the user to look before running it again.
        """
        try:
            return client_keyed.create(self.client.api, body)
        except OutcomeUnknown as exc:
            which = f"a container named {body['name']!r}" if body.get("name") else "a new container"
            raise PluginError(f"{exc.message}. The manager may have started {which}: check with 'docker gpu ps' "
                              "(or 'docker gpu logs NAME') before running it again (outcome_unknown)",
                              EXIT_UNKNOWN) from None
        except GpumgrError as exc:
            raise _plugin_error(exc) from None

    def stream(self, path: str, params: dict[str, str], accept: str) -> Stream:
        """A streamed GET (no read timeout: a quiet container may say nothing for hours), for ``with``."""
        try:
            return self.client.api.stream(path, params, accept)
        except GpumgrError as exc:
            raise _plugin_error(exc) from None


def _plugin_error(exc: GpumgrError) -> PluginError:
    """The client's error as one line: the manager's message and code, or why no manager could be reached."""
    if isinstance(exc, ManagerUnreachable):
        return PluginError(f"{exc.message}; set --manager or GPUMGR_MANAGER")
    return PluginError(f"{exc.message} ({exc.code})")


# --- helpers ---------------------------------------------------------------------------------
def _take_options(argv: list[str], wanted: dict[str, bool]) -> tuple[dict[str, str], list[str]]:
    """Pull our options out of a docker command line (before the image), leaving the rest as it was."""
    ours: dict[str, str] = {}
    rest: list[str] = []
    index = 0
    while index < len(argv):
        arg = argv[index]
        name, has_value, value = arg.partition("=")
        if name in wanted and not wanted[name]:  # a flag
            ours[name] = value if has_value else "1"
        elif name in wanted:
            if not has_value:
                if index + 1 >= len(argv):
                    raise PluginError(f"{name} needs a value")
                index, value = index + 1, argv[index + 1]
            ours[name] = value
        else:
            rest.append(arg)
        index += 1
    return ours, rest


def _format(argv: list[str], usage: str) -> str:
    """A listing command's one option, ``--format table|json``: which it asks for (a table by default)."""
    options, rest = _take_options(argv, {"--format": True})
    form = options.get("--format", "table")
    if rest or form not in ("table", "json"):
        raise PluginError(f"usage: {usage}")
    return form


def _memory(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise PluginError(f"invalid --gpu-memory: {exc}") from None


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise PluginError(f"--gpus must be a positive integer, not {text!r}")
    return int(text)


def _docker(args: list[str]) -> NoReturn:
    """Become ``docker ARGS``: its exit status is ours, and no Python is left to wait and tear down.

    ``docker gpu service create`` ends here; its time to the service's first task is the Python's
    start-up plus this hand-over, so ``subprocess`` is not even imported on this path.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvp("docker", ["docker", *args])
    except OSError as exc:
        raise PluginError(f"cannot run docker: {exc}") from None


def _docker_call(args: list[str]) -> int:
    """Run ``docker ARGS`` and return its exit status (for a caller with work after it)."""
    import subprocess

    return subprocess.call(["docker", *args])


def _docker_json(args: list[str]) -> list[dict[str, Any]]:
    import subprocess

    result = subprocess.run(["docker", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise PluginError(result.stderr.strip() or f"docker {' '.join(args)} failed")
    return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]


def _print_table(rows: Sequence[tuple[str, ...]]) -> None:
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())


def _settings() -> dict[str, Any]:
    path = os.path.expanduser(CONFIG_PATH)
    if not os.path.exists(path):
        return {}
    import yaml  # only when there is a file to read: this CLI should start fast

    try:
        with open(path) as handle:
            loaded = yaml.safe_load(handle.read())
    except (OSError, yaml.YAMLError):
        return {}
    return loaded if isinstance(loaded, dict) else {}

