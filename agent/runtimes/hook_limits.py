"""What a grant asked through the runtime hook may be: a Swarm task's acts as the operator, a plain run's does not.

Anyone who may run ``docker run -e GPUMGR_REQUEST_MEMORY=...`` on a node gets a grant through the
runtime hook. A Swarm task was placed by whoever controls the swarm, so it keeps acting as the
operator; a container a plain ``docker run`` created gets at most the node's ``hook_max_priority``
(0 by default: it preempts no one) and counts against the node's ``hook_tenant`` if one is set. A
task is known by the engine's own record of the container: the labels Swarm writes on it, which the
guard refuses on every create that comes through the API.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpumgr.wire.errors import InvalidRequest
from gpumgr.wire.names import Env
from gpumgr.wire.protocol import Reserve

#: The label Swarm's executor writes on every task container (a plain create may not carry it).
SWARM_TASK_LABEL = "com.docker.swarm.task.id"


@dataclass(frozen=True)
class HookLimits:
    """The node's limits on hook grants of containers that are not Swarm tasks."""

    tenant: str | None = None
    max_priority: int = 0
    #: the most GPU memory a plain run may ask (``hook_max_memory``); None: the manager's limits alone
    max_memory: int | None = None

    def apply(self, request: Reserve, engine_labels: dict[str, Any] | None) -> Reserve:
        """``request`` as the manager may grant it: unchanged for a Swarm task, limited for a plain run.

        A plain run asking for more memory than ``max_memory`` is refused (InvalidRequest), not cut down:
        a grant smaller than the container expects would only end in its kill.
        """
        if (engine_labels or {}).get(SWARM_TASK_LABEL):
            return request
        if self.max_memory is not None and request.gpu_memory > self.max_memory:
            raise InvalidRequest(f"{Env.REQUEST_MEMORY} asks for {request.gpu_memory} bytes: this node lets a "
                                 f"container that is no Swarm task ask for at most {self.max_memory} (hook_max_memory)")
        return request.model_copy(update={"priority": min(request.priority, self.max_priority),
                                          "tenant": self.tenant or ""})
