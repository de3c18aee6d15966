"""What a gang is: its request (:class:`GangSpec`), its record (:class:`Gang`) and its members' environment.

Every member's environment gets ``GPUMGR_GANG``, ``GPUMGR_GANG_RANK`` (from 0), ``GPUMGR_GANG_SIZE``
and torchrun's own ``PET_NNODES``, ``PET_NODE_RANK``, ``PET_NPROC_PER_NODE`` (its GPUs),
``PET_MASTER_ADDR``, ``PET_MASTER_PORT`` and ``PET_RDZV_ID``; with host networking ``NCCL_SOCKET_IFNAME``
leaves out ``docker`` and ``lo``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpumgr.manager.model.records import PlacementSpec

#: Environment names a gang's request may not set: gpumgr sets them.
RESERVED_ENV = ("GPUMGR_GANG", "PET_")
#: A gang's states: as a record's, plus ``restarting`` while a failed gang's members stop before it is placed again.
GANG_ENDED = frozenset({"exited", "failed", "killed", "removed", "expired", "preempted"})
LABEL = "gpumgr.gang"


@dataclass(frozen=True)
class GangSpec:
    """A validated ``POST /v1/gangs``: the member's spec and the gang's own settings."""

    member: PlacementSpec
    replicas: int
    one_per_node: bool = True
    restart: str = "never"
    max_restarts: int = 0
    #: an attachable network the members share: the master is rank 0's container name on it
    network: str | None = None


@dataclass
class Gang:
    """One gang: its members (record ids, rank order) and how it stands."""

    id: str
    spec: GangSpec
    tenant: str | None
    created_at: float
    rdzv_id: str
    state: str = "queued"
    members: list[str] = field(default_factory=list)
    reason: str | None = None
    exit_code: int | None = None
    finished_at: float | None = None
    restart_count: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    #: the host whose port it holds (released when it ends)
    port_host: str | None = None
    queued_at: float | None = None
    expires_mono: float | None = None
    #: when its first member exited 0 (monotonic), for ``gang_exit_grace``
    first_exit_mono: float | None = None
    #: when a member's node was first seen down (monotonic), for ``gang_grace``
    node_down_mono: float | None = None
    #: since when the zone rule holds (monotonic): the ``gang_grace`` wait is paused, and resumes where it stopped
    grace_paused_mono: float | None = None
    #: a failure to be followed by a restart once every member has stopped
    restart_pending: bool = False
    #: since when it waits (monotonic), for ``gang_reserve_after``
    waiting_mono: float | None = None


def gang_env(gang: Gang, rank: int, gpus: int, host_network: bool) -> dict[str, str]:
    """What member ``rank`` of ``gang`` finds in its environment: who it is and where its peers meet."""
    env = {"GPUMGR_GANG": gang.id, "GPUMGR_GANG_RANK": str(rank), "GPUMGR_GANG_SIZE": str(gang.spec.replicas),
           "PET_NNODES": str(gang.spec.replicas), "PET_NODE_RANK": str(rank), "PET_NPROC_PER_NODE": str(gpus),
           "PET_MASTER_ADDR": gang.master_addr or "", "PET_MASTER_PORT": str(gang.master_port or ""),
           "PET_RDZV_ID": gang.rdzv_id}
    if host_network:
        env["NCCL_SOCKET_IFNAME"] = "^docker,lo"
    return env

