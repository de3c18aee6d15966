"""The path of one POST through the manager: which files the request's spec visits, and how often it comes back.

An in-process manager on a real link with one scripted agent (``tests.fake_agent.scripted_stack``)
places one warm-up container, then one traced POST ``/v1/containers``. A profiler (``sys.setprofile``)
on the REST thread follows the request's :class:`~gpumgr.manager.model.records.PlacementSpec`: every call of
gpumgr's own code whose arguments or locals hold that very object (by identity) is one step, from the
first such call to the last; a call holding the record made of it (``record.spec``), a command of that
record, or a list of them counts too. A method of the record or the spec itself (a property such as
``record.image``) is an attribute read, not a step. Consecutive steps in one file are one *stay*; a
*return* is a stay in a file the spec had already left. The goal of issue "The house": at most 2 returns.

    python bench/request_path.py [--json out.json]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.harness import machine, machine_line, save  # noqa: E402
from tests.fake_agent import scripted_stack  # noqa: E402

PARTS = ("manager", "agent", "wire", "plugin", "gpumgr")


def trace_post(client: Any, body: dict[str, Any]) -> list[tuple[str, str]]:
    """``(file, function)`` of every call of gpumgr's code that holds the POST's spec, in order."""
    from gpumgr.manager.model.records import PlacementSpec

    steps: list[tuple[str, str]] = []
    followed: list[PlacementSpec] = []

    def profile(frame: FrameType, event: str, _arg: Any) -> None:
        if event != "call":
            return
        path = Path(frame.f_code.co_filename)
        try:
            relative = path.resolve().relative_to(ROOT)
        except ValueError:
            return
        if relative.parts[0] not in PARTS:
            return
        values = frame.f_locals.values()
        if not followed:
            found = next((v for v in values if isinstance(v, PlacementSpec)), None)
            if found is None:
                return
            followed.append(found)
        own = frame.f_locals.get("self")
        if own is not None and _holds(own, followed[0]):
            return  # the record's or spec's own accessor (an attribute read), not the request moving on
        if any(_holds(v, followed[0]) for v in values):
            steps.append((str(relative), frame.f_code.co_name))

    sys.setprofile(profile)
    try:
        answer = client.post("/v1/containers", json=body)
    finally:
        sys.setprofile(None)
    assert answer.status_code == 201, answer.json
    return steps


def _holds(value: Any, spec: Any, depth: int = 0) -> bool:
    """Whether ``value`` is the request: its spec, its record, a command of that record, or a list of them."""
    if value is spec:
        return True
    if depth < 2 and isinstance(value, list | tuple):
        return any(_holds(v, spec, depth + 1) for v in value[:8])
    record = getattr(value, "record", value)
    try:
        return getattr(record, "spec", None) is spec
    except Exception:  # a proxy or descriptor that fails on a plain attribute read is not the request
        return False


def stays(steps: list[tuple[str, str]]) -> list[tuple[str, list[str]]]:
    """Consecutive steps in one file, merged: ``(file, functions)``."""
    merged: list[tuple[str, list[str]]] = []
    for file, function in steps:
        if merged and merged[-1][0] == file:
            merged[-1][1].append(function)
        else:
            merged.append((file, [function]))
    return merged


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    body = {"gpu_memory": "1GiB", "image": "busybox", "command": ["true"]}
    with tempfile.TemporaryDirectory() as tmp, scripted_stack(Path(tmp)) as (_, client, add_agent):
        add_agent()
        assert client.post("/v1/containers", json=body).status_code == 201  # warm: imports, caches
        path = stays(trace_post(client, body))
    seen: set[str] = set()
    returns = 0
    for file, functions in path:
        back = file in seen
        returns += back
        seen.add(file)
        print(f"  {'↩' if back else ' '} {file}: {', '.join(functions)}")
    print(f"{len(path)} stays in {len(seen)} files, {returns} return(s) to a file already left")
    info = machine()
    print(machine_line(info))
    save(args.json, "request_path", args, stays=len(path), files=len(seen), returns=returns,
         route=[{"file": f, "functions": fs} for f, fs in path], machine=info)
    return 0


if __name__ == "__main__":
    sys.exit(main())
