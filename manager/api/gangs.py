"""REST API v1 for gangs: ``POST/GET /v1/gangs``, ``GET/DELETE /v1/gangs/<id>``.

A gang's body is a container's (:class:`~gpumgr.manager.api.routes.CreateContainer`) plus ``replicas``,
``one_per_node`` and ``restart``/``max_restarts``; its ``gpus`` and ``gpu_memory`` are each member's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from flask import Blueprint, Response, jsonify
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from gpumgr.manager.api.routes import CreateContainer, _validated, manager, placement_of, principal
from gpumgr.manager.model.gangs import RESERVED_ENV, GangSpec
from gpumgr.wire import defaults
from gpumgr.wire.errors import InvalidRequest

bp = Blueprint("v1_gangs", __name__, url_prefix="/v1")
#: Network modes that are not a network the members share by name.
NOT_A_NETWORK = ("host", "none", "bridge", "default", "private")


class CreateGang(CreateContainer):
    """The body of ``POST /v1/gangs``: a container's, for each member, and the gang's own settings."""

    replicas: StrictInt = Field(ge=defaults.GANG_MIN_REPLICAS, le=defaults.GANG_MAX_REPLICAS,
                                description="how many members, each with gpus × gpu_memory")
    one_per_node: StrictBool = Field(True, description="every member on its own node")
    restart: Literal["never", "gang"] = Field("never", description="gang: a failed gang is placed again whole")
    max_restarts: StrictInt = Field(0, ge=0, le=100, description="with restart gang: how many times at most")
    compute_share: StrictInt | None = Field(None, description="not offered for gangs: any value is a 400")


@bp.post("/gangs")
def create_gang() -> tuple[Response, int]:
    """Place every member at once: 201 once all run, 202 while the gang waits whole, 409 no_fit or never_fits."""
    body = _validated(CreateGang)
    reserved = sorted(k for k in body.env if k.startswith(RESERVED_ENV))
    if reserved:
        raise InvalidRequest(f"env: {', '.join(reserved[:8])} are reserved: gpumgr sets GPUMGR_GANG* and PET_* "
                             "in each member (its rank and the rendezvous)")
    if body.compute_share is not None:  # a gang's one decision does not weigh shares: refused, never ignored
        raise InvalidRequest("compute_share is not offered for gangs: place each member with POST /v1/containers, "
                             "or leave compute_share out")
    if body.restart != "gang" and body.max_restarts:
        raise InvalidRequest("max_restarts needs restart: gang")
    member, tenant = placement_of(body)
    network = body.network if body.network and body.network not in NOT_A_NETWORK and \
        not body.network.startswith("container:") else None
    spec = GangSpec(member, body.replicas, body.one_per_node, body.restart, body.max_restarts, network)
    view, status = manager().create_gang(spec, queue=body.queue, queue_timeout=body.queue_timeout, tenant=tenant)
    return jsonify(view), status


@bp.get("/gangs")
def list_gangs() -> Response:
    """Every gang the caller may see."""
    return jsonify({"gangs": manager().cluster.gang_views(principal())})


@bp.get("/gangs/<gid>")
def get_gang(gid: str) -> Response:
    """One gang by id; 404 if none (or another tenant's)."""
    return jsonify(manager().cluster.gang_views(principal(), gid[:64])[0])


@bp.delete("/gangs/<gid>")
def delete_gang(gid: str) -> Response:
    """End a gang: every member is stopped and removed; a waiting gang is withdrawn."""
    manager().cluster.gang_views(principal(), gid[:64])  # another tenant's is a 404
    return jsonify(manager().remove_gang(gid[:64]))


class GangQueuePlace(BaseModel):
    """A waiting gang's place among the waiting gangs."""

    model_config = ConfigDict(extra="forbid")
    position: int


class GangView(BaseModel):
    """One gang (``Gangs.view``); its members are ordinary container records with ``gang`` and ``rank``."""

    model_config = ConfigDict(extra="forbid")
    id: str
    state: Literal["queued", "creating", "running", "restarting", "exited", "failed", "killed", "removed",
                   "expired", "preempted"]
    reason: str | None = Field(description="why it ended (the member that ended it), or why it restarts")
    exit_code: int | None
    tenant: str | None
    replicas: int
    gpus: int = Field(description="GPUs of each member")
    gpu_memory: int = Field(description="bytes per GPU of each member")
    one_per_node: bool
    restart: Literal["never", "gang"]
    max_restarts: int
    restart_count: int
    members: list[str] = Field(description="the members' record ids, rank order (empty while it waits)")
    master_addr: str | None = Field(description="PET_MASTER_ADDR: rank 0's node, or its container name on a network")
    master_port: int | None = Field(description="PET_MASTER_PORT, from gang_ports, unique on its host")
    rdzv_id: str = Field(description="PET_RDZV_ID, the same across restarts")
    image: str | None
    created_at: float
    finished_at: float | None
    queued_at: float | None
    queue: GangQueuePlace | None


class GangList(BaseModel):
    """``GET /v1/gangs``."""

    model_config = ConfigDict(extra="forbid")
    gangs: list[GangView]


def document_paths(operation: Callable[..., dict[str, Any]], path: Callable[..., dict[str, Any]]) -> dict[str, Any]:
    """The gang routes of the OpenAPI document (``openapi.document`` passes its builders)."""
    gid = path("gid", "the gang's id")
    return {
        "/v1/gangs": {
            "post": operation("Place every member of a gang at once; 201 once all run, 202 while it waits whole",
                              (201, GangView, "every member running"), (400, 403, 409, 413, 502, 503),
                              body=CreateGang, op_id="createGang",
                              also=(202, GangView, "queued whole: placed as soon as every member fits")),
            "get": operation("Every gang", (200, GangList, "the gangs the caller may see"), (), op_id="listGangs"),
        },
        "/v1/gangs/{gid}": {
            "get": operation("One gang", (200, GangView, "the gang"), (404,), params=[gid], op_id="getGang"),
            "delete": operation("End a gang: every member is stopped and removed; a waiting gang is withdrawn",
                                (200, GangView, "ended"), (404, 502, 503), params=[gid], op_id="removeGang"),
        },
    }
