"""``docker gpu stack``: deploy a compose file whose services say in ``x-gpumgr`` what each replica is granted.

    services:
      train:
        image: trainer:1
        deploy: {replicas: 3}
        x-gpumgr: {gpu_memory: 20GiB, priority: 5, preemptible: true, compute_share: 50}

Every service with an ``x-gpumgr`` block (an empty one takes the top-level ``x-gpumgr`` defaults whole)
gets what ``docker gpu service create`` gives a service: the request in each task's environment, read by
the runtime hook when the node creates the replica's container, and labels that say it. The block is
turned into ``service create``'s own options and read by the same code, so both say the same thing.

The file is read with ``docker stack config`` where the Docker CLI has it (23 and later: merged and
interpolated exactly as ``docker stack deploy`` will), else gpumgr merges the ``x-gpumgr`` blocks itself
(mappings merged, lists appended, later files win) and interpolates ``${VAR}`` in them as compose does.
Top-level blocks of several files are always merged here (``docker stack config`` keeps only the first).
Then each file goes to ``docker stack deploy`` with its ``x-`` keys taken out and otherwise unchanged,
plus one more file that adds the grants' environment, labels and placement constraints; all are
written beside the first file, from whose folder Docker resolves relative paths, and removed after.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from gpumgr.plugin.cli_base import (
    Manager,
    PluginError,
    _docker,
    _docker_call,
    _docker_json,
    _take_options,
)
from gpumgr.plugin.services import (
    SERVICE_OPTIONS,
    constraints_of,
    grant_args,
    print_tasks,
)

EXTENSION = "x-gpumgr"
#: ``x-gpumgr`` keys and the ``docker gpu service create`` option each becomes (a flag for booleans).
KEYS = {"gpu_memory": "--gpu-memory", "gpu_memory_limit": "--gpu-memory-limit", "gpus": "--gpus",
        "priority": "--priority", "preemptible": "--preemptible", "queue": "--queue", "on_overrun": "--on-overrun",
        "constraints": "--constraint", "compute_share": "--compute-share"}
#: The compose file format from which ``x-`` keys are allowed there.
TOP_LEVEL_FROM, SERVICE_FROM = (3, 4), (3, 7)
#: Sections whose entries may carry ``x-`` keys (from 3.7), stripped before Docker reads the file.
SECTIONS = ("services", "networks", "volumes", "configs", "secrets")
#: compose's interpolation: ``$$``, ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``, ``${VAR:?err}``, ``$VAR``.
VARIABLE = re.compile(r"\$(?:(?P<dollar>\$)|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}"
                      r"|(?P<plain>[A-Za-z_][A-Za-z0-9_]*))")


def stack(client: Manager, argv: list[str]) -> int:
    """``docker gpu stack deploy|ps ...``; any other stack command goes to ``docker stack`` unchanged."""
    if argv[:1] == ["deploy"]:
        return deploy(client, argv[1:])
    if argv[:1] == ["ps"] and len(argv) >= 2 and not any(a.startswith("--format") for a in argv):
        return ps(client, argv[1:])
    return _docker(["stack", *argv])


def deploy(client: Manager, argv: list[str]) -> int:
    """``docker gpu stack deploy -c FILE... [options] STACK``."""
    paths, rest = _compose_files(argv)
    raws = [_load(path) for path in paths]
    for path, raw in zip(paths, raws, strict=True):
        check_format(path, raw)
    defaults, blocks = read_blocks(paths, raws)
    additions = {name: service_additions(client, name, grant_request(name, defaults, block))
                 for name, block in blocks.items()}
    version = next((str(raw["version"]) for raw in raws if "version" in raw), None)
    override: dict[str, Any] = {"services": additions}
    if version is not None:
        override = {"version": version, **override}
    folder = Path(paths[0]).resolve().parent if paths[0] != "-" else Path.cwd()
    written: list[str] = []
    try:
        for document in [*(strip(raw) for raw in raws), override]:
            written.append(_write(folder, document))
        return _docker_call(["stack", "deploy", *(a for path in written for a in ("-c", path)), *rest])
    finally:
        for path in written:
            Path(path).unlink(missing_ok=True)


def ps(client: Manager, argv: list[str]) -> int:
    """``docker gpu stack ps [options] STACK``: each task with its grant, GPU and usage, or why it has none."""
    name = argv[-1]
    tasks = _docker_json(["stack", "ps", "--no-trunc", "--format", "{{json .}}", *argv])
    services = _docker_json(["stack", "services", "--format", "{{json .}}", name])
    records = [r for s in services for r in client.call("GET", "/v1/containers", params={"service": s["Name"]})[
        "containers"]]
    print_tasks(tasks, records)
    return 0


# --- reading the files -----------------------------------------------------------------------
def check_format(path: str, raw: dict[str, Any]) -> None:
    """A clear error when ``raw`` has ``x-`` keys where its compose format does not allow them yet."""
    version = _version(raw.get("version"))
    if version is None or version[0] != 3:
        return  # the Compose Specification (no version) allows them everywhere; other formats Docker refuses
    given = str(raw["version"])
    for key in raw:
        if str(key).startswith("x-") and version < TOP_LEVEL_FROM:
            raise PluginError(f"{path}: a top-level {key} needs compose file format 3.4 or later, and the file says "
                              f'version "{given}"; set version: "3.7" (x- keys on services need 3.7)')
    for name, service in (raw.get("services") or {}).items():
        for key in service or {}:
            if str(key).startswith("x-") and version < SERVICE_FROM:
                raise PluginError(f"{path}: {key} on service {name!r} needs compose file format 3.7 or later, "
                                  f'and the file says version "{given}"; set version: "3.7"')


def read_blocks(paths: list[str], raws: list[dict[str, Any]], use_cli: bool | None = None,
                ) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The top-level ``x-gpumgr`` defaults and each service's own block (services without one are left out).

    ``use_cli``: read the services with ``docker stack config`` (None: where the CLI has it).
    """
    defaults: dict[str, Any] = {}
    for path, raw in zip(paths, raws, strict=True):
        defaults = merge(defaults, _block(raw.get(EXTENSION), f"{path}: the top-level {EXTENSION}"))
    defaults = interpolate(defaults, os.environ)
    if use_cli if use_cli is not None else has_stack_config():
        services = _stack_config(paths).get("services") or {}
    else:
        services = {}
        for raw in raws:
            services = merge(services, {k: {EXTENSION: v[EXTENSION]} for k, v in (raw.get("services") or {}).items()
                                        if isinstance(v, dict) and EXTENSION in v})
        services = interpolate(services, os.environ)
    blocks = {name: _block(spec.get(EXTENSION), f"service {name!r}: {EXTENSION}")
              for name, spec in services.items() if isinstance(spec, dict) and EXTENSION in spec}
    return defaults, blocks


def has_stack_config() -> bool:
    """Whether the Docker CLI on PATH has ``docker stack config`` (23 and later; Debian's 20.10 lacks it)."""
    result = subprocess.run(["docker", "stack", "--help"], capture_output=True, text=True)
    return re.search(r"^\s+config\s", result.stdout, re.MULTILINE) is not None


def merge(base: Any, override: Any) -> Any:
    """``override`` over ``base`` as compose merges files: mappings key by key, lists appended, else the later."""
    if isinstance(base, dict) and isinstance(override, dict):
        merged = dict(base)
        for key, value in override.items():
            merged[key] = merge(base[key], value) if key in base else value
        return merged
    if isinstance(base, list) and isinstance(override, list):
        return base + override
    return override


def interpolate(value: Any, env: Any) -> Any:
    """``value`` with ``${VAR}`` and its forms replaced from ``env`` in every string, as compose does."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(match: re.Match[str]) -> str:
        if match["dollar"]:
            return "$"
        name = match["braced"] or match["plain"]
        op, arg = match["op"], match["arg"] or ""
        found = env.get(name)
        missing = found is None or (found == "" and op is not None and op.startswith(":"))
        if op is not None and op.endswith("-"):
            return str(arg if missing else found)
        if op is not None and op.endswith("?") and missing:
            raise PluginError(f"required variable {name} is missing a value: {arg}")
        return "" if found is None else str(found)

    return VARIABLE.sub(one, value)


# --- what Docker is given --------------------------------------------------------------------
def grant_request(name: str, defaults: dict[str, Any], block: dict[str, Any]) -> list[str]:
    """``docker gpu service create`` options for service ``name``: its block over the defaults, key by key."""
    wanted = {**defaults, **block}
    unknown = sorted(set(wanted) - set(KEYS))
    if unknown:
        raise PluginError(f"service {name!r}: {EXTENSION} has no key {unknown[0]!r}; it takes {', '.join(KEYS)}")
    argv: list[str] = []
    for key, value in wanted.items():
        option = KEYS[key]
        if key in ("preemptible", "queue"):
            if not isinstance(value, bool):
                raise PluginError(f"service {name!r}: {EXTENSION}.{key} must be true or false, not {value!r}")
            argv += [option] if value else []
        elif key == "constraints":
            if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
                raise PluginError(f"service {name!r}: {EXTENSION}.constraints must be a list of strings such as "
                                  "node.labels.zone==a")
            argv += [a for c in value for a in (option, c)]
        elif isinstance(value, bool) or not isinstance(value, str | int):
            raise PluginError(f"service {name!r}: {EXTENSION}.{key} must be a number or a string, not {value!r}")
        else:
            argv += [option, str(value)]
    return argv


def service_additions(client: Manager, name: str, argv: list[str]) -> dict[str, Any]:
    """What service ``name`` gets in the added file: ``service create``'s options for ``argv`` as compose keys."""
    asked, argv = constraints_of(argv)  # issue 23: gpu.* ones ride to the hook, node.* ones to Swarm
    ours, rest = _take_options(argv, SERVICE_OPTIONS)
    if "--gpu-memory" not in ours:
        raise PluginError(f"service {name!r}: {EXTENSION} needs gpu_memory (here or in the top-level {EXTENSION})")
    try:
        options = grant_args(client, ours, asked) + rest  # issue 23
    except PluginError as exc:
        raise PluginError(f"service {name!r}: {exc}") from None
    environment: dict[str, str] = {}
    labels: dict[str, str] = {}
    constraints: list[str] = []
    index = 0
    while index < len(options):
        option, has_value, value = options[index].partition("=")
        if not has_value:
            index, value = index + 1, options[index + 1]
        if option in ("--env", "-e"):
            key, _, text = value.partition("=")
            environment[key] = _escape(text)
        elif option in ("--label", "-l"):
            key, _, text = value.partition("=")
            labels[key] = _escape(text)
        elif option == "--constraint":
            constraints.append(_escape(value))
        else:
            raise PluginError(f"service {name!r}: {option} has no place in a stack file")
        index += 1
    deploy: dict[str, Any] = {"labels": labels}
    if constraints:
        deploy["placement"] = {"constraints": constraints}
    return {"environment": environment, "deploy": deploy}


def strip(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` without its ``x-`` keys (top level and each entry of a section), the version kept as text."""
    document = {k: v for k, v in raw.items() if not str(k).startswith("x-")}
    if "version" in document:
        document["version"] = str(document["version"])
    for section in SECTIONS:
        entries = document.get(section)
        if isinstance(entries, dict):
            document[section] = {name: ({k: v for k, v in spec.items() if not str(k).startswith("x-")}
                                        if isinstance(spec, dict) else spec) for name, spec in entries.items()}
    return document


# --- helpers ---------------------------------------------------------------------------------
def _compose_files(argv: list[str]) -> tuple[list[str], list[str]]:
    """The ``-c``/``--compose-file`` files in order, and every other argument as given."""
    paths: list[str] = []
    rest: list[str] = []
    index = 0
    while index < len(argv):
        arg = argv[index]
        name, has_value, value = arg.partition("=")
        if name in ("-c", "--compose-file"):
            if not has_value:
                if index + 1 >= len(argv):
                    raise PluginError(f"{name} needs a file")
                index, value = index + 1, argv[index + 1]
            paths.append(value)
        else:
            rest.append(arg)
        index += 1
    if not paths:
        raise PluginError("docker gpu stack deploy needs the stack's file: -c stack.yml")
    if paths.count("-") > 1:
        raise PluginError("only one -c - (standard input) can be given")
    return paths, rest


_STDIN: list[str] = []


def _load(path: str) -> dict[str, Any]:
    """The compose file at ``path`` (``-``: standard input, read once) as a mapping."""
    try:
        if path == "-":
            _STDIN[:] = _STDIN or [sys.stdin.read()]
            text = _STDIN[0]
        else:
            text = Path(path).read_text()
    except OSError as exc:
        raise PluginError(f"cannot read {path}: {exc.strerror or exc}") from None
    return _load_text(text, path)


def _load_text(text: str, path: str = "stack.yml") -> dict[str, Any]:
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise PluginError(f"{path} is not valid YAML: {exc}") from None
    if not isinstance(loaded, dict):
        raise PluginError(f"{path}: a compose file is a mapping with 'services'")
    return loaded


def _block(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise PluginError(f"{where} must be a mapping such as {{gpu_memory: 8GiB}}")
    return {str(k): v for k, v in value.items()}


def _version(value: Any) -> tuple[int, int] | None:
    match = re.fullmatch(r"(\d+)(?:\.(\d+))?", str(value).strip()) if value is not None else None
    return (int(match[1]), int(match[2] or 0)) if match else None


def _stack_config(paths: list[str]) -> dict[str, Any]:
    stdin = _STDIN[0] if "-" in paths and _STDIN else None
    result = subprocess.run(["docker", "stack", "config", *(a for p in paths for a in ("-c", p))], input=stdin,
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise PluginError(f"docker stack config: {result.stderr.strip() or 'failed'}")
    loaded = yaml.safe_load(result.stdout)
    return loaded if isinstance(loaded, dict) else {}


def _escape(text: str) -> str:
    """``text`` as compose must read it: its ``$`` are not variables."""
    return text.replace("$", "$$")


def _write(folder: Path, document: dict[str, Any]) -> str:
    try:
        handle, path = tempfile.mkstemp(prefix=".gpumgr-stack-", suffix=".yml", dir=folder)
    except OSError as exc:
        raise PluginError(f"cannot write beside the stack's first file in {folder} ({exc.strerror or exc}): docker "
                          "stack deploy reads relative paths from that folder; copy the files where you can write"
                          ) from None
    with os.fdopen(handle, "w") as out:
        yaml.safe_dump(document, out, sort_keys=False, default_flow_style=False)
    return path
