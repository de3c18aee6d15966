"""REST API v1: request validation and JSON views over the manager's use cases."""

from __future__ import annotations

import re
import shlex
import time
from collections.abc import Callable
from typing import Annotated, Any, Literal, cast

from flask import Blueprint, Response, current_app, g, jsonify, request
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    WithJsonSchema,
)

from gpumgr.manager.api.idempotent import Idempotency
from gpumgr.manager.api.lookup import resolve
from gpumgr.manager.api.nodes_cache import NodesCache
from gpumgr.manager.control.idempotency import HEADER, read_key
from gpumgr.manager.leading import NotKnownYet
from gpumgr.manager.model.bursts.limits import limit_of
from gpumgr.manager.model.records import Container, PlacementSpec
from gpumgr.manager.service import Manager
from gpumgr.manager.tenancy.policy import admit
from gpumgr.manager.tenancy.tenants import OPERATOR, TENANT_NAME, Principal, Tenant
from gpumgr.wire import defaults, protocol
from gpumgr.wire.constraints import MAX_CONSTRAINT_CHARS, MAX_CONSTRAINTS, parse_all
from gpumgr.wire.errors import Forbidden, InvalidRequest, NotFound, ProtocolError
from gpumgr.wire.names import LABEL_PREFIX, RESERVED_ENV, Label, State
from gpumgr.wire.runspec import RUN_FIELDS, RunSpec
from gpumgr.wire.units import MAX_BYTES, parse_bytes

bp = Blueprint("v1", __name__, url_prefix="/v1")

NAME_PATTERN = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]{0,127}$")
MAX_GPUS = defaults.MAX_GPUS_PER_REQUEST
#: The wire's bounds (wire/envelope.py ``unpack``): what the API accepts, the agent can decode.
MAX_FIELD = defaults.MAX_FIELD_BYTES
MAX_ITEMS = defaults.MAX_ITEMS
#: A create message may take a quarter of the frame bound: room for the envelope, the GPU ids the grant adds,
#: and for the container's record, which the agent repeats in its heartbeats.
MAX_CREATE_BYTES = defaults.MAX_MESSAGE_BYTES // 4
#: Node names as an agent may join with (``protocol.Join.node``).
MAX_NODE_NAME = 253
MAX_COMMAND_WORDS = 4096
#: ``command`` given as one string is split like a shell would; longer strings must come as a list.
MAX_COMMAND_STRING = MAX_FIELD
#: Longest ``type`` filter of ``GET /v1/events`` (a comma list of event type names).
MAX_TYPES_QUERY = 1024
#: Longest integer query parameter: ``since`` is a non-negative int64.
MAX_INT64 = 2**63 - 1
#: GPU ids are filled in by the grant after validation; budget this many bytes for each.
GPU_ID_BUDGET = 96
#: At most this many validation errors are listed in a 400.
MAX_ERRORS_LISTED = 5


def _memory(value: Any) -> int:
    try:
        return parse_bytes(value)
    except ValueError as exc:
        raise ValueError(str(exc)) from None


def _maybe_memory(value: Any) -> int | None:
    return None if value is None else _memory(value)


def _constraints(value: list[str]) -> list[str]:
    parse_all(value)  # a ValueError names the constraint that cannot be read: a 400
    return value


def _command(value: Any) -> Any:
    if isinstance(value, str):
        if len(value) > MAX_COMMAND_STRING:
            raise ValueError(f"a command string may be at most {MAX_COMMAND_STRING} characters; "
                             "send a longer command as a list of words")
        return shlex.split(value)
    return value


def _wire_text(value: str) -> str:
    """``value`` if the wire carries it: valid UTF-8 of at most ``MAX_FIELD`` bytes."""
    try:
        size = len(value.encode())
    except UnicodeEncodeError:
        raise ValueError("is not valid Unicode text (it holds a lone surrogate)") from None
    if size > MAX_FIELD:
        raise ValueError(f"is {size} bytes in UTF-8, over the wire's bound of {MAX_FIELD} bytes per string")
    return value


def _no_nul(value: str) -> str:
    if "\0" in value:
        raise ValueError("must not hold a NUL character (a process's arguments and environment cannot)")
    return value


def _env_name(value: str) -> str:
    if not value or "=" in value:
        raise ValueError("an environment variable's name must be non-empty and hold no '='")
    if value in RESERVED_ENV:
        raise ValueError(f"{value} is set by gpumgr from the grant; a request cannot set it")
    return value


#: A string the wire carries (every string of a request that reaches an agent).
WireStr = Annotated[StrictStr, AfterValidator(_wire_text), WithJsonSchema({"type": "string", "maxLength": MAX_FIELD})]
#: A wire string that can become a process argument or environment entry.
ArgStr = Annotated[WireStr, AfterValidator(_no_nul)]
EnvName = Annotated[ArgStr, AfterValidator(_env_name),
                    WithJsonSchema({"type": "string", "minLength": 1, "maxLength": MAX_FIELD})]
#: ``gpu_memory`` as the document shows it: positive bytes, or a size string (its ASCII subset that is always read).
MEMORY_SCHEMA = {"anyOf": [{"type": "integer", "minimum": 1, "maximum": MAX_BYTES},
                           {"type": "string", "maxLength": 64,
                            "pattern": "^[0-9]{1,12}([kKmMgGtT]i?[bB]?|[bB])?$"}],
                 "examples": ["8GiB", 536870912]}
COMMAND_SCHEMA = {"anyOf": [{"type": "string", "maxLength": MAX_COMMAND_STRING},
                            {"type": "array", "maxItems": MAX_COMMAND_WORDS,
                             "items": {"type": "string", "maxLength": MAX_FIELD}}]}


class CreateContainer(RunSpec):
    """The body of ``POST /v1/containers``; unknown fields are refused.

    Besides the grant and the placement it takes how the container runs (:class:`RunSpec`: mounts,
    ports, network, namespaces, limits), named as docker-py's ``containers.run`` names them.

    Every string is bounded by the wire's per-field bound in UTF-8 bytes, every list and map by its
    item bound, and the whole create message by ``MAX_CREATE_BYTES``: a request the agent could not
    decode is a 400 at once, never a create that times out.
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    gpu_memory: Annotated[int, BeforeValidator(_memory), WithJsonSchema(MEMORY_SCHEMA)] = Field(
        description="GPU memory granted on each GPU: bytes, or a size such as '512MiB', '8GiB', '8G'")
    gpu_memory_limit: Annotated[int | None, BeforeValidator(_maybe_memory), WithJsonSchema(MEMORY_SCHEMA)] = Field(
        None, description="a burstable grant: what it may use on each GPU while the GPU has room (at least "
        "gpu_memory; absent: gpu_memory, no burst); bursts are reclaimed, by stopping it, when a request needs them")
    image: StrictStr | None = Field(None, min_length=1, max_length=512)
    command: Annotated[list[ArgStr], BeforeValidator(_command), WithJsonSchema(COMMAND_SCHEMA)] = Field(
        default_factory=list, max_length=MAX_COMMAND_WORDS, description="a list of words, or one string split "
        "like a shell would")
    gpus: StrictInt = Field(1, ge=1, le=MAX_GPUS)
    name: StrictStr | None = Field(None, pattern=NAME_PATTERN.pattern)
    env: dict[EnvName, ArgStr] = Field(default_factory=dict, max_length=MAX_ITEMS)
    labels: dict[WireStr, WireStr] = Field(default_factory=dict, max_length=MAX_ITEMS)
    node: StrictStr | None = Field(None, min_length=1, max_length=MAX_NODE_NAME)
    placement: Literal["spread", "binpack"] | None = None
    constraints: Annotated[list[StrictStr], AfterValidator(_constraints)] = Field(
        default_factory=list, max_length=MAX_CONSTRAINTS, description="where it may run, in Swarm's syntax: "
        "node.name, node.labels.KEY, gpu.model (a glob), gpu.uuid, gpu.index, gpu.memory, gpu.compute_capability, "
        "gpu.mps with ==, != (and >=, <= for numbers and sizes), e.g. 'gpu.model==*H100*', 'gpu.memory>=40GiB'",
        json_schema_extra={"items": {"type": "string", "maxLength": MAX_CONSTRAINT_CHARS}})
    on_overrun: Literal["kill", "stop", "report"] | None = None
    tenant: StrictStr | None = Field(None, pattern=TENANT_NAME.pattern, description="the operator only: act for "
                                     "this tenant")
    priority: StrictInt | None = Field(None, ge=-defaults.MAX_PRIORITY, le=defaults.MAX_PRIORITY,
                                       description="higher is placed first; default and ceiling: the tenant's")
    preemptible: StrictBool = Field(False, description="may be stopped (state preempted) to make room for a "
                                    "queued request of higher priority")
    compute_share: StrictInt | None = Field(None, ge=1, le=defaults.MAX_COMPUTE_SHARE, description="percent of "
                                            "each GPU's SMs (1-100; leave it out for none): placed only on nodes "
                                            "that run MPS, at most 100 per GPU, and given to its processes as "
                                            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    queue: StrictBool = Field(False, description="wait for room (202, state queued) instead of 409 no_fit")
    # one number type (a strict float takes ints too): on a union of int and float the bounds were
    # written into the document as keywords JSON Schema does not know, so they were not published
    queue_timeout: StrictFloat | None = Field(None, gt=0, le=defaults.MAX_QUEUE_TIMEOUT,
                                              description="seconds to wait in the queue before the request "
                                              "ends as expired")


class ResizeContainer(BaseModel):
    """The body of ``PATCH /v1/containers/{cid}``: the new grant per GPU."""

    model_config = ConfigDict(extra="forbid", strict=True)

    gpu_memory: Annotated[int | None, BeforeValidator(_maybe_memory), WithJsonSchema(MEMORY_SCHEMA)] = Field(
        None, description="the new grant on each of its GPUs: bytes, or a size such as '8GiB' (absent: kept)")
    gpu_memory_limit: Annotated[int | None, BeforeValidator(_maybe_memory), WithJsonSchema(MEMORY_SCHEMA)] = Field(
        None, description="the new burst limit on each of its GPUs, at least the grant (absent: kept)")
    force: StrictBool = Field(False, description="shrink below what the container uses now (its node then acts "
                              "on the overrun)")


def manager() -> Manager:
    """The manager behind the running app."""
    return cast(Manager, current_app.extensions["gpumgr.manager"])


def principal() -> Principal:
    """Who the current request acts as (set by the app's authorization)."""
    return cast(Principal, g.get("principal", OPERATOR))


@bp.post("/containers")
def create_container() -> tuple[Response, int]:
    """Place and start a container: 201 with its record once it runs, or 202 while it waits in the queue.

    With an ``Idempotency-Key`` header it runs at most once per key (:mod:`gpumgr.manager.api.idempotent`).
    """
    key = read_key(request.headers.get(HEADER))
    create = _creation(_validated(CreateContainer))
    if key is None:
        record, status = create()
        return jsonify(record), status
    keys = cast(Idempotency, current_app.extensions["gpumgr.idempotency"])
    return keys.respond(key, principal(), "POST /v1/containers", request.get_json(), create)


def _creation(body: CreateContainer) -> Callable[[], tuple[dict[str, Any], int]]:
    """Check ``body`` against tenants, policy and the wire's bounds (4xx), and return the create to run."""
    spec, tenant = placement_of(body)
    return lambda: manager().create(spec, queue=body.queue, queue_timeout=body.queue_timeout, tenant=tenant)


def placement_of(body: CreateContainer) -> tuple[PlacementSpec, Tenant | None]:
    """``body`` checked against tenants, policy and the wire's bounds (4xx): what to place, and for which tenant."""
    tenant = manager().acting_as(principal(), body.tenant)
    ceiling = tenant.priority if tenant is not None else None
    priority = body.priority if body.priority is not None else (ceiling or 0)
    if ceiling is not None and priority > ceiling:
        raise Forbidden(f"priority {priority} is above tenant {tenant.name if tenant else ''}'s ceiling of {ceiling}",
                        code="priority_not_allowed")
    if any(k.startswith(LABEL_PREFIX) for k in body.labels):
        raise InvalidRequest(f"labels starting with {LABEL_PREFIX!r} are reserved for gpumgr")
    if body.image is None and manager().cluster.needs_image():
        raise InvalidRequest("image is required: the ready nodes run containers with Docker")
    settings = manager().settings
    run = RunSpec.model_validate(body.model_dump(include=set(RUN_FIELDS), mode="json", exclude_defaults=True))
    admit(run, settings.policy, tenant)
    _check_message_size(body, body.on_overrun or settings.on_overrun, run)
    spec = PlacementSpec(
        memory=body.gpu_memory, count=body.gpus, placement=body.placement or settings.placement, image=body.image,
        command=body.command, name=body.name, env=body.env, labels=body.labels, node=body.node,
        on_overrun=body.on_overrun or settings.on_overrun, priority=priority, preemptible=body.preemptible,
        run=run.given(), constraints=body.constraints, compute_share=body.compute_share or 0,
        memory_limit=limit_of(body.gpu_memory, body.gpu_memory_limit),
    )
    return spec, tenant


@bp.get("/containers")
def list_containers() -> Response:
    """Every container record, optionally filtered by ``state`` and ``node``."""
    state = _query("state", 64)
    if state is not None and state not in {s.value for s in State}:
        raise InvalidRequest(f"state must be one of {', '.join(s.value for s in State)}, not {state!r}")
    cluster = manager().cluster
    tenant = _query("tenant", 64)
    records = cluster.containers(state=state, node=_query("node", MAX_NODE_NAME), principal=principal())
    if tenant is not None:
        records = [r for r in records if r.tenant == tenant]
    service = _query("service", MAX_FIELD)
    if service is not None:
        records = [r for r in records if r.labels.get(Label.SERVICE) == service]
    return jsonify({"containers": cluster.views(records)})


@bp.get("/containers/<cid>")
def get_container(cid: str) -> Response:
    """One container record by id, name or unique id prefix; 404 if none (or another tenant's), 409 if ambiguous."""
    return jsonify(manager().cluster.view(lookup(cid)))


@bp.patch("/containers/<cid>")
def resize_container(cid: str) -> Response:
    """Grow or shrink a running (or queued) container's grant in place; 200 with the new record."""
    found = lookup(cid).id  # another tenant's id is a 404 before the body is even read
    body = _validated(ResizeContainer)
    if body.gpu_memory is None and body.gpu_memory_limit is None:
        raise InvalidRequest("send gpu_memory, gpu_memory_limit or both")
    return jsonify(manager().resize(found, body.gpu_memory, force=body.force, principal=principal(),
                                    limit=body.gpu_memory_limit))


@bp.delete("/containers/<cid>")
def delete_container(cid: str) -> tuple[Response, int]:
    """Stop and remove a container (or withdraw a queued request); its grant is freed."""
    record, status = manager().remove(lookup(cid).id)
    return jsonify(record), status


def lookup(ref: str) -> Container:
    """The caller's container that ``ref`` names: an id, a name or a unique id prefix (see ``lookup.resolve``).

    A miss while nodes known at the term's start have not registered again is 503 ``not_known_yet``, not 404:
    the container may run on one of them (a failover, or a restart, a moment ago).
    """
    try:
        return resolve(manager().cluster, ref, principal())
    except NotFound:
        unheard = manager().leading.unheard()
        if unheard:
            raise NotKnownYet(f"no container {ref[:64]!r} on the map yet, but node(s) {', '.join(unheard[:5])} have "
                              "not registered with this manager since it began leading: it may be there; "
                              "retry in a moment") from None
        raise


@bp.get("/nodes")
def list_nodes() -> Response:
    """The machine × GPU map (a tenant sees every figure, but only its own containers' ids).

    ``?since=<version>``: only the nodes changed after that version and the names of those removed (issue 20).
    """
    cache = cast(NodesCache, current_app.extensions["gpumgr.nodes"])  # issue 20
    if principal().operator:
        return cache.response(request)
    cache.since_of(request.args.get("since"))  # issue 20: a malformed since is a 400 for a tenant too
    # issue 20: a tenant's view is filtered per caller, so it is always whole ("full": true)
    return jsonify({"version": cache.version_token(), "full": True, "removed": [],  # issue 20
                    "nodes": manager().cluster.nodes_view(principal())})


@bp.delete("/nodes/<name>")
def delete_node(name: str) -> Response:
    """Forget a node that is down and its agent's binding (409 while it is up, 404 if unknown)."""
    _operator_only("forget a node")
    return jsonify(manager().forget_node(name))


@bp.get("/tenants")
def list_tenants() -> Response:
    """Tenants with their quotas, what each holds and has queued; a tenant sees only itself."""
    return jsonify({"tenants": manager().cluster.tenants_view(principal())})


@bp.get("/accounts")
def list_accounts() -> Response:
    """Accounts with their fair shares and allocations; a tenant sees its own and those above it.

    Without ``accounts:`` configured the list is empty (not a 404), so a client needs no special case.
    """
    return jsonify({"accounts": manager().cluster.accounts_view(principal()) or []})


def _operator_only(what: str) -> None:
    if not principal().operator:
        raise Forbidden(f"only the operator may {what}")


@bp.get("/events")
def list_events() -> Response:
    """Recent events, oldest first; ``since`` skips ids up to it, ``type`` filters (comma list)."""
    since = _query("since", len(str(MAX_INT64))) or "0"
    # ASCII digits only: str.isdigit() also takes '①' and '²', which int() then refuses
    if not (since.isascii() and since.isdigit()) or int(since) > MAX_INT64:
        raise InvalidRequest(f"since must be a non-negative integer of at most {MAX_INT64}, not {since!r}")
    kinds = set(filter(None, (_query("type", MAX_TYPES_QUERY) or "").split(","))) or None
    events = manager().events.since(int(since), kinds)
    caller = principal()
    if not caller.operator:
        events = [e for e in events if e.get("tenant") == caller.tenant]
    return jsonify({"events": events})


def _query(name: str, limit: int) -> str | None:
    """The query parameter ``name``, or None; a 400 if it is over ``limit`` characters."""
    value = request.args.get(name)
    if value is not None and len(value) > limit:
        raise InvalidRequest(f"{name}: at most {limit} characters, got {len(value)}")
    return value


def _check_message_size(body: CreateContainer, on_overrun: str, run: RunSpec) -> None:
    """A 400 unless the create message the agent will get, GPU ids and grant included, fits ``MAX_CREATE_BYTES``."""
    spec = protocol.ContainerSpec(
        grant="0" * 16, name=body.name or "gpumgr-" + "0" * 16, image=body.image, command=body.command,
        env=body.env, labels=body.labels, gpus=["0" * GPU_ID_BUDGET] * body.gpus, gpu_memory=body.gpu_memory,
        on_overrun=on_overrun, created_at=time.time(), run=run,
    )
    try:
        size = len(protocol.encode(protocol.Create(spec=spec)))
    except ProtocolError:
        size = defaults.MAX_MESSAGE_BYTES + 1
    if size > MAX_CREATE_BYTES:
        raise InvalidRequest(f"body: the create message for the agent would be {size} bytes, over the bound of "
                             f"{MAX_CREATE_BYTES} bytes (a quarter of the wire's {defaults.MAX_MESSAGE_BYTES}); "
                             "send a smaller command, env or labels")


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
    """Where and why, for the first few errors; a key or value from the request is never echoed whole."""
    parts = []
    errors = exc.errors(include_url=False, include_input=False)
    for err in errors[:MAX_ERRORS_LISTED]:
        where = ".".join(_short(str(p)) for p in err["loc"]) or "body"
        text = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
        parts.append(f"{where}: {_short(text.removeprefix('Value error, '), 400)}")
    if len(errors) > MAX_ERRORS_LISTED:
        parts.append(f"and {len(errors) - MAX_ERRORS_LISTED} more errors")
    return "; ".join(parts)


def _short(text: str, limit: int = 64) -> str:
    return text if len(text) <= limit else f"{text[:limit - 16]}...({len(text)} chars)"
