"""``docker gpu``'s placement constraints: which go to Swarm, which ride to the node's runtime hook.

``node.*`` constraints are Swarm's own (``node.name`` as ``node.hostname``) and are passed on as
``--constraint``; ``gpu.*`` ones travel in the task's environment (``GPUMGR_REQUEST_CONSTRAINTS``), for
the hook to ask the manager with on the node Swarm picks. Exact ``gpu.model``, ``gpu.memory`` and
``gpu.compute_capability`` equalities (and ``gpu.mps``) also become Swarm constraints on the labels agents give their
Swarm nodes (:mod:`gpumgr.agent.runtimes.swarm_labels`), so Swarm sends such tasks only where they can run.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any, NamedTuple

from gpumgr.wire.constraints import (
    GPU_CC,
    GPU_MEMORY,
    GPU_MODEL,
    GPU_MPS,
    NO_CONSTRAINTS,
    Constraint,
    Constraints,
    parse_all,
)
from gpumgr.wire.names import Env

#: ``gpu.*`` attributes → the Swarm node label the agent writes for them (``agent.swarm_labels``).
SWARM_LABELS = {GPU_MODEL: "gpumgr.gpu.model", GPU_MEMORY: "gpumgr.gpu.memory", GPU_CC: "gpumgr.gpu.compute_capability",
                GPU_MPS: "gpumgr.gpu.mps"}


class Wanted(NamedTuple):
    """A service's constraints: ``gpu.*`` ones parsed, the others as Swarm takes them (it checks those itself)."""

    gpu: Constraints = NO_CONSTRAINTS
    swarm: tuple[str, ...] = ()


NOTHING = Wanted()


def take_constraints(argv: list[str]) -> tuple[Wanted, list[str]]:
    """Every ``--constraint`` of a command line and the rest of it; ValueError names a ``gpu.*`` one that is bad.

    Anything else (``node.role``, ``node.labels.*``, ``engine.labels.*``...) is Swarm's, passed on as it is,
    but ``node.name``, which Swarm calls ``node.hostname``.
    """
    texts, rest, index = [], [], 0
    while index < len(argv):
        name, has_value, value = argv[index].partition("=")
        if name == "--constraint":
            if not has_value:
                if index + 1 >= len(argv):
                    raise ValueError("--constraint needs a value")
                index, value = index + 1, argv[index + 1]
            texts.append(value)
        else:
            rest.append(argv[index])
        index += 1
    gpu = [t for t in texts if t.strip().lower().startswith("gpu.")]
    swarm = tuple(_swarm_name(t) for t in texts if not t.strip().lower().startswith("gpu."))
    return Wanted(parse_all(gpu), swarm), rest


def swarm_constraints(wanted: Wanted) -> list[str]:
    """The ``docker service create`` options that carry ``wanted`` (see the module docstring)."""
    gpu = wanted.gpu.texts
    return [f"--constraint={c}" for c in wanted.swarm] + [
        f"--constraint={hint}" for hint in _label_hints(wanted.gpu)] + (
        [f"--env={Env.REQUEST_CONSTRAINTS}={json.dumps(list(gpu))}"] if gpu else [])


def _swarm_name(text: str) -> str:
    attr = text.strip()
    return "node.hostname" + attr[len("node.name"):] if attr.lower().startswith("node.name") and \
        attr[len("node.name"):].lstrip()[:2] in ("==", "!=") else text


def allowed_sizes(nodes: list[dict[str, Any]], constraints: Constraints) -> list[list[int]]:
    """Per node of ``GET /v1/nodes``, the total memory of each GPU ``constraints`` allow."""
    return [[g["memory_total"] for g in n["gpus"] if constraints.allows(_target(n, g))] for n in nodes]


def _label_hints(constraints: Constraints) -> list[str]:
    """Swarm constraints on the agents' node labels for exact ``==`` (mixed nodes have none: the hook checks)."""
    hints = []
    for c in constraints.items:
        label = SWARM_LABELS.get(c.attr)
        if c.attr == GPU_MPS:  # only an MPS node has the label: "not MPS" is "not labelled true"
            hints.append(f"node.labels.{label}{'==' if (c.op == '==') == (c.number == (1,)) else '!='}true")
            continue
        value = _value(c)
        if label is None or c.op != "==" or any(ch in value for ch in "*?["):
            continue
        if c.attr == GPU_MEMORY:
            value = str(c.number[0])
        elif c.attr == GPU_CC:
            value = ".".join(map(str, c.number[:2]))
        hints.append(f"node.labels.{label}=={value}")
    return hints


def _value(constraint: Constraint) -> str:
    return constraint.text.split(constraint.op, 1)[1].strip()


def _target(node: dict[str, Any], gpu: dict[str, Any]) -> Any:
    """A GPU of ``GET /v1/nodes`` as constraints read it."""
    return SimpleNamespace(node=node["name"], labels=node.get("labels") or {}, uuid=gpu["uuid"], index=gpu["index"],
                           total=gpu["memory_total"], name=gpu.get("name") or "",
                           compute_capability=gpu.get("compute_capability") or "", mps=bool(gpu.get("mps")))
