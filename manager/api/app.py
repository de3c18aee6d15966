"""The Flask app factory: blueprints, auth, and the one JSON error handler."""

from __future__ import annotations

import time
from typing import Any

from flask import Flask, Response, g, jsonify, request
from flask.json.provider import DefaultJSONProvider
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from werkzeug.exceptions import HTTPException

from gpumgr.manager import forward
from gpumgr.manager.api import containers_io, dashboard, gangs, openapi
from gpumgr.manager.api import routes as api
from gpumgr.manager.api.idempotent import Idempotency
from gpumgr.manager.api.nodes_cache import NodesCache
from gpumgr.manager.service import Manager
from gpumgr.manager.tenancy.tenants import TenantBook
from gpumgr.wire.errors import Forbidden, GpumgrError

#: Open without the token: liveness, and the API's description (its shape is public, it holds no state).
OPEN_PATHS = frozenset({"/healthz", "/openapi.json"})


def create_app(manager: Manager, test_config: dict[str, Any] | None = None) -> Flask:
    """Build the REST app around a started or unstarted ``manager``."""
    app = Flask("gpumgr")
    app.config.update(MAX_CONTENT_LENGTH=1024 * 1024)
    app.json = _UnsortedJson(app)
    app.config.update(test_config or {})
    app.extensions["gpumgr.manager"] = manager
    app.extensions["gpumgr.nodes"] = NodesCache(manager.cluster)
    app.extensions["gpumgr.idempotency"] = Idempotency(manager)
    app.register_blueprint(api.bp)
    app.register_blueprint(containers_io.bp)
    app.register_blueprint(gangs.bp)
    app.register_blueprint(dashboard.bp)
    app.add_url_rule("/healthz", "healthz", lambda: healthz(manager))
    app.add_url_rule("/openapi.json", "openapi", lambda: jsonify(openapi.document()))
    app.add_url_rule("/metrics", "metrics", lambda: metrics(manager))
    app.before_request(_start_timer)
    app.before_request(lambda: forward.front(manager))
    app.before_request(lambda: _authorize(manager.tenants))
    app.after_request(lambda response: _observe(manager, response))
    app.register_error_handler(GpumgrError, _gpumgr_error)
    app.register_error_handler(HTTPException, _http_error)
    return app


class _UnsortedJson(DefaultJSONProvider):
    """Keep keys in the order the views build them (id first, detail last) instead of sorting them."""

    sort_keys = False


def healthz(manager: Manager) -> Response:
    """Liveness plus a short summary: is the manager serving, how many nodes are ready, does the API want a token.

    With several managers it says this one's role, who leads (their API), the epoch and whether this
    manager's tenants match the leader's (``warning`` when they differ).
    """
    return jsonify({"status": "ok", "nodes_ready": manager.cluster.ready_nodes(),
                    "token_required": not manager.tenants.open, **forward.health(manager)})


def metrics(manager: Manager) -> Response:
    """``GET /metrics``: the Prometheus text format; the operator's (it shows every tenant's containers)."""
    if not g.get("principal") or not g.principal.operator:
        raise Forbidden("/metrics shows every tenant's containers: scrape it with the operator's token")
    return Response(generate_latest(manager.metrics.registry), content_type=CONTENT_TYPE_LATEST)


def _start_timer() -> None:
    g.started = time.perf_counter()


def _observe(manager: Manager, response: Response) -> Response:
    """Time every request by its URL rule (``/v1/containers/<cid>``), never by its raw path: few series."""
    started = g.get("started")
    if started is not None:
        route = request.url_rule.rule if request.url_rule is not None else "unmatched"
        manager.metrics.observe(route, request.method, started)
    return response


def _authorize(tenants: TenantBook) -> tuple[Response, int] | None:
    """Only ``Authorization: Bearer <token>`` opens the API when it has tokens; the token says who acts.

    The operator's token acts as the operator, a tenant's as that tenant (every token is compared in
    constant time). With no token configured at all, every caller is the operator.
    """
    if request.path in OPEN_PATHS or request.path == "/" or request.path.startswith(dashboard.OPEN_PREFIX):
        return None
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    found = tenants.identify(given.strip() if scheme.lower() == "bearer" else "\0")
    if found is not None and (scheme.lower() == "bearer" or tenants.open):
        g.principal = found
        return None
    response, status = _error("unauthorized", "send 'Authorization: Bearer <token>' with the manager's token", 401)
    response.headers["WWW-Authenticate"] = 'Bearer realm="gpumgr"'
    return response, status


def _gpumgr_error(exc: GpumgrError) -> Response:
    response = jsonify({"error": exc.to_dict()})
    response.status_code = exc.status
    retry_after = getattr(exc, "retry_after", None)
    if retry_after is not None:  # no leader or no quorum for now: when to try again
        response.headers["Retry-After"] = str(retry_after)
    return response


def _http_error(exc: HTTPException) -> tuple[Response, int]:
    code = (exc.name or "error").lower().replace(" ", "_")
    return _error(code, exc.description or exc.name, exc.code or 500)


def _error(code: str, message: str, status: int) -> tuple[Response, int]:
    return jsonify({"error": {"code": code, "message": message}}), status
