"""REST API v1: request validation and JSON views over the manager's use cases."""

from __future__ import annotations

import re
import shlex
from typing import Annotated, Any, Literal, cast

from flask import Blueprint, Response, current_app, jsonify, request
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictInt, StrictStr, ValidationError

from gpumgr.manager.cluster import PlacementSpec
from gpumgr.manager.service import Manager
from gpumgr.wire import defaults
from gpumgr.wire.errors import InvalidRequest
from gpumgr.wire.names import LABEL_PREFIX, Label, State
from gpumgr.wire.units import parse_bytes

bp = Blueprint("v1", __name__, url_prefix="/v1")

NAME_PATTERN = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]{0,127}$")
MAX_GPUS = defaults.MAX_GPUS_PER_REQUEST


def _memory(value: Any) -> int:
    try:
        return parse_bytes(value)
    except ValueError as exc:
        raise ValueError(str(exc)) from None


def _command(value: Any) -> Any:
    if isinstance(value, str):
        return shlex.split(value)
    return value


class CreateContainer(BaseModel):
    """The body of ``POST /v1/containers``; unknown fields are refused."""

    model_config = ConfigDict(extra="forbid", strict=True)

    gpu_memory: Annotated[int, BeforeValidator(_memory)]
    image: StrictStr | None = Field(None, min_length=1, max_length=512)
    command: Annotated[list[StrictStr], BeforeValidator(_command)] = Field(default_factory=list, max_length=4096)
    gpus: StrictInt = Field(1, ge=1, le=MAX_GPUS)
    name: StrictStr | None = Field(None, pattern=NAME_PATTERN.pattern)
    env: dict[StrictStr, StrictStr] = Field(default_factory=dict)
    labels: dict[StrictStr, StrictStr] = Field(default_factory=dict)
    node: StrictStr | None = Field(None, min_length=1)
    placement: Literal["spread", "binpack"] | None = None
    on_overrun: Literal["kill", "stop", "report"] | None = None


def manager() -> Manager:
    """The manager behind the running app."""
    return cast(Manager, current_app.extensions["gpumgr.manager"])


@bp.post("/containers")
def create_container() -> tuple[Response, int]:
    """Place and start a container; 201 with its record once it runs."""
    body = _validated(CreateContainer)
    if any(k.startswith(LABEL_PREFIX) for k in body.labels):
        raise InvalidRequest(f"labels starting with {LABEL_PREFIX!r} are reserved for gpumgr")
    if body.image is None and manager().cluster.needs_image():
        raise InvalidRequest("image is required: the ready nodes run containers with Docker")
    settings = manager().settings
    spec = PlacementSpec(
        memory=body.gpu_memory, count=body.gpus, placement=body.placement or settings.placement, image=body.image,
        command=body.command, name=body.name, env=body.env, labels=body.labels, node=body.node,
        on_overrun=body.on_overrun or settings.on_overrun,
    )
    return jsonify(manager().create(spec)), 201


@bp.get("/containers")
def list_containers() -> Response:
    """Every container record, optionally filtered by ``state`` and ``node``."""
    state = request.args.get("state")
    if state is not None and state not in {s.value for s in State}:
        raise InvalidRequest(f"state must be one of {', '.join(s.value for s in State)}, not {state!r}")
    cluster = manager().cluster
    records = cluster.containers(state=state, node=request.args.get("node"))
    service = request.args.get("service")
    if service is not None:
        records = [r for r in records if r.labels.get(Label.SERVICE) == service]
    return jsonify({"containers": [cluster.view(r) for r in records]})


@bp.get("/containers/<cid>")
def get_container(cid: str) -> Response:
    """One container record; 404 for an unknown id."""
    cluster = manager().cluster
    return jsonify(cluster.view(cluster.get(cid)))


@bp.delete("/containers/<cid>")
def delete_container(cid: str) -> Response:
    """Stop and remove a container; its grant is freed."""
    return jsonify(manager().remove(cid))


@bp.get("/nodes")
def list_nodes() -> Response:
    """The machine × GPU map."""
    return Response(manager().cluster.nodes_json(), mimetype="application/json")


@bp.delete("/nodes/<name>")
def delete_node(name: str) -> Response:
    """Forget a node that is down and its agent's binding (409 while it is up, 404 if unknown)."""
    return jsonify(manager().forget_node(name))


@bp.get("/events")
def list_events() -> Response:
    """Recent events, oldest first; ``since`` skips ids up to it, ``type`` filters (comma list)."""
    since = request.args.get("since", "0")
    if not since.isdigit():
        raise InvalidRequest(f"since must be a non-negative integer, not {since!r}")
    kinds = set(filter(None, request.args.get("type", "").split(","))) or None
    return jsonify({"events": manager().events.since(int(since), kinds)})


def _validated(model: type[BaseModel]) -> Any:
    if not request.is_json:
        raise InvalidRequest("send a JSON body with Content-Type: application/json")
    data = request.get_json(silent=True)
    if not isinstance(data, dict):
        raise InvalidRequest("the body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise InvalidRequest(_describe(exc)) from None


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "body"
        text = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
        parts.append(f"{where}: {text.removeprefix('Value error, ')}")
    return "; ".join(parts)
