"""The node's GPUs as labels of its Swarm node, so Swarm itself sends GPU-constrained tasks where they can run.

A task's ``gpu.*`` constraints are checked by the runtime hook on the node Swarm picked; without a
hint Swarm would pick nodes that cannot satisfy them again and again. So the agent writes what its
GPUs are into its Swarm node's labels (``gpumgr.gpu.count``; and, when all its GPUs agree,
``gpumgr.gpu.model``, ``gpumgr.gpu.memory`` in bytes and ``gpumgr.gpu.compute_capability``;
``gpumgr.gpu.mps=true`` where the agent runs with ``mps: true``), and
``docker gpu service create`` turns exact ``gpu.*`` constraints into Swarm constraints on them.
Only a Swarm manager may change a node's labels: on a worker the agent logs the command an operator
can run on a manager instead. Labels of ``gpumgr.gpu.`` it no longer has are removed.
"""

from __future__ import annotations

import logging
import shlex
from typing import Any

from gpumgr.agent.gpus.source import Device

log = logging.getLogger(__name__)
PREFIX = "gpumgr.gpu."
MODEL, MEMORY, CC, COUNT = PREFIX + "model", PREFIX + "memory", PREFIX + "compute_capability", PREFIX + "count"
MPS = PREFIX + "mps"


def labels_for(devices: list[Device], mps: bool = False) -> dict[str, str]:
    """The labels that describe ``devices``: their count, each attribute all of them share, and MPS if it runs."""
    labels = {COUNT: str(len(devices))} | ({MPS: "true"} if mps else {})
    for key, values in ((MODEL, {d.name for d in devices}), (MEMORY, {str(d.memory_total) for d in devices}),
                        (CC, {d.compute_capability for d in devices})):
        if len(values) == 1 and "" not in values:
            labels[key] = values.pop()
    return labels


def publish(client: Any, devices: list[Device], mps: bool = False) -> bool:
    """Write ``labels_for(devices, mps)`` on this engine's Swarm node; whether they are there now.

    Nothing happens outside a swarm; on a worker the command to run on a manager is logged.
    """
    try:
        swarm = client.info().get("Swarm") or {}
        if swarm.get("LocalNodeState") != "active" or not swarm.get("NodeID"):
            return False
        wanted = labels_for(devices, mps)
        if not swarm.get("ControlAvailable"):
            adds = " ".join(f"--label-add {shlex.quote(f'{k}={v}')}" for k, v in wanted.items())
            log.info("this Swarm node is a worker and cannot label itself; on a manager run: docker node update "
                     "%s %s", adds, swarm["NodeID"])
            return False
        node = client.nodes.get(swarm["NodeID"])
        spec = dict(node.attrs["Spec"])
        have = dict(spec.get("Labels") or {})
        labels = {k: v for k, v in have.items() if not k.startswith(PREFIX)} | wanted
        if labels != have:
            spec["Labels"] = labels
            node.update(spec)
            log.info("labelled this Swarm node with its GPUs: %s", wanted)
        return True
    except Exception as exc:  # the engine's API: a failure here only costs Swarm its hint
        log.warning("could not label this Swarm node with its GPUs: %s", exc)
        return False
