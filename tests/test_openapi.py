"""The OpenAPI document at ``/openapi.json``, and schemathesis run against the API with it.

The API runs in process (WSGI) over a real agent link with a scripted agent registered, so creates
can succeed. Every generated request must get an answer that is not a 5xx, whose status the
document lists for that operation and whose body matches the document's schema.
"""

from __future__ import annotations

import threading
import uuid
from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings

from gpumgr.manager.api import openapi
from gpumgr.manager.api.app import create_app
from gpumgr.manager.api.routes import CreateContainer
from gpumgr.manager.config import ManagerSettings
from gpumgr.manager.service import Manager
from gpumgr.wire import defaults
from tests.fake_agent import FakeAgent

CHECKS = [schemathesis.checks.not_a_server_error, schemathesis.checks.status_code_conformance,
          schemathesis.checks.response_schema_conformance, schemathesis.checks.content_type_conformance]


@pytest.fixture
def live(tmp_path):
    """A manager with one scripted agent (2 GPUs of 24 GiB) that answers every create and remove."""
    manager = Manager(ManagerSettings(agents="tcp://127.0.0.1:0", state_dir=str(tmp_path / "s"), create_timeout=2.0,
                                      heartbeat_interval=60.0))  # no heartbeats here: the node must not go down
    manager.start()
    app = create_app(manager)
    agent = FakeAgent(manager.link.bound_endpoint, manager.admission.token(), node="fake")
    agent.register()
    stop = threading.Event()
    thread = agent.serve(stop)
    yield manager, app
    stop.set()
    thread.join(2)
    agent.close()
    manager.stop()


@pytest.fixture
def api_schema(live):
    _, app = live
    return schemathesis.openapi.from_wsgi("/openapi.json", app)


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_every_answer_matches_the_document(case) -> None:
    case.call_and_validate(checks=CHECKS)


def test_chained_calls_match_the_document(live) -> None:
    """Schemathesis's stateful phase: calls chained through the document's links (a create's id to GET,
    PATCH, kill and DELETE of that record; the map's node names to forget), every answer checked.

    Creates are given a body that places (64 MiB of the scripted node's GPUs; odd bodies are the
    other phases' work, above), so their records are there to chain to; every other call, and what
    it is chained to, is generated."""
    chained_schema = schemathesis.openapi.from_wsgi("/openapi.json", live[1])
    reached: Counter[tuple[str, str, int]] = Counter()

    class Workflow(chained_schema.as_state_machine()):  # type: ignore[misc]
        def before_call(self, case) -> None:
            # schemathesis's WSGI transport asks for gzip but does not decode it (gzip is tested on its own)
            case.headers = {**(case.headers or {}), "Accept-Encoding": "identity"}
            if case.operation.method.upper() == "POST" and case.operation.path == "/v1/containers":
                # small enough that 60 sequences of 10 calls never fill the node: a create placed in one
                # sequence and refused in a later one would change which links the same choices reach,
                # and Hypothesis refuses a strategy that draws differently for the same choices
                case.body = {"image": "img", "gpu_memory": "64MiB", "labels": {"chained": "1"}}
                # a fresh key each time, for the same reason: a key drawn again in a later sequence would be
                # answered with the first sequence's record, which that sequence may have removed
                case.headers["Idempotency-Key"] = str(uuid.uuid4())

        def validate_response(self, response, case, additional_checks=None, **kwargs) -> None:
            reached[(case.operation.method.upper(), case.operation.path, response.status_code)] += 1
            case.validate_response(response, checks=CHECKS, transport_kwargs=kwargs)

    # the manager keeps what earlier examples made, so a failing sequence cannot be replayed as it ran:
    # generate only, and report the first failure as it happened
    Workflow.run(settings=settings(max_examples=60, stateful_step_count=10, deadline=None, database=None,
                                   phases=[Phase.generate], suppress_health_check=list(HealthCheck)))
    chained = {(method, path) for method, path, status in reached if status < 300 and "{cid}" in path}
    assert len(chained) >= 2, f"the links led to no call on a created record: {sorted(reached)}"


def test_every_bound_is_published_in_json_schema_s_own_words() -> None:
    """``queue_timeout``'s bounds were written as pydantic's ``gt``/``le``, which JSON Schema does not
    know, so the document allowed a negative wait the API refuses; devices now say they are absolute."""
    found: list[str] = []

    def walk(node: object, where: str) -> None:
        if isinstance(node, dict):
            found.extend(f"{where}/{key}" for key in ("gt", "ge", "lt", "le") if key in node)
            for key, value in node.items():
                walk(value, f"{where}/{key}")
        elif isinstance(node, list):
            for index, value in enumerate(node):
                walk(value, f"{where}/{index}")

    document = openapi.document()
    walk(document, "")
    assert not found, f"bounds JSON Schema does not read: {found}"
    create = document["components"]["schemas"]["CreateContainer"]["properties"]
    assert create["queue_timeout"]["anyOf"][0] == {"type": "number", "exclusiveMinimum": 0,
                                                   "maximum": defaults.MAX_QUEUE_TIMEOUT}
    assert create["devices"]["items"]["pattern"] == "^/"


def test_the_document_is_served_open_and_generated_from_the_models(tmp_path) -> None:
    manager = Manager(ManagerSettings(agents="tcp://127.0.0.1:0", token="s3cret", state_dir=str(tmp_path)))
    client = create_app(manager).test_client()
    response = client.get("/openapi.json")  # no token: it describes the API and holds no state
    assert response.status_code == 200 and response.is_json
    doc = response.json
    assert doc["openapi"].startswith("3.")
    body = doc["paths"]["/v1/containers"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/CreateContainer"}
    generated = CreateContainer.model_json_schema(ref_template="#/components/schemas/{model}")
    assert doc["components"]["schemas"]["CreateContainer"]["properties"] == generated["properties"]
    assert doc == openapi.document()
    assert client.get("/v1/nodes").status_code == 401  # the rest still needs the token


def test_a_created_container_and_the_map_match_the_document(live) -> None:
    """One successful create, so the record, list, map and event shapes are checked on real data."""
    _, app = live
    client = app.test_client()
    doc_schema = schemathesis.openapi.from_wsgi("/openapi.json", app)
    created = client.post("/v1/containers", json={"gpu_memory": "1GiB", "image": "x", "labels": {"a": "b"}})
    assert created.status_code == 201, created.json
    cid = created.json["id"]
    for method, path, response in [
        ("POST", "/v1/containers", created),
        ("GET", "/v1/containers", client.get("/v1/containers")),
        ("GET", "/v1/containers/{cid}", client.get(f"/v1/containers/{cid}")),
        ("GET", "/v1/nodes", client.get("/v1/nodes")),
        ("GET", "/v1/events", client.get("/v1/events")),
        ("DELETE", "/v1/containers/{cid}", client.delete(f"/v1/containers/{cid}")),
        ("GET", "/healthz", client.get("/healthz")),
    ]:
        operation = doc_schema[path][method]
        operation.validate_response(response)


def test_a_resize_through_the_api_is_answered_by_the_scripted_agent(live) -> None:
    """The scripted agent behind the generated calls answers a resize as a real one does: a PATCH that
    names a live record (an id prefix such as ``0`` may) once waited out its timeout and answered 504."""
    _, app = live
    client = app.test_client()
    made = client.post("/v1/containers", json={"image": "img", "gpu_memory": "4GiB"})
    assert made.status_code == 201, made.json
    cid = made.json["id"]
    grown = client.patch(f"/v1/containers/{cid[:1]}", json={"gpu_memory": "8GiB"})
    assert grown.status_code == 200, grown.json
    assert grown.json["gpu_memory"] == 8 << 30


def test_an_ambiguous_id_prefix_is_a_documented_409_on_every_call_that_takes_one(live) -> None:
    """``GET`` and ``DELETE`` of ``/v1/containers/{cid}`` once left out the 409 an ambiguous prefix answers."""
    _, app = live
    client = app.test_client()
    made: list[str] = []  # until two records share a first character: that prefix names both
    while len({r[0] for r in made}) == len(made):
        answer = client.post("/v1/containers", json={"image": "img", "gpu_memory": "1GiB"})
        assert answer.status_code == 201, answer.json
        made.append(answer.json["id"])
    prefix = next(r[0] for r in made if sum(o[0] == r[0] for o in made) > 1)
    document = client.get("/openapi.json").json["paths"]["/v1/containers/{cid}"]
    for method in ("get", "delete", "patch"):
        answer = client.open(f"/v1/containers/{prefix}", method=method.upper(),
                             json={"gpu_memory": "2GiB"} if method == "patch" else None)
        assert answer.status_code == 409 and answer.json["error"]["code"] == "conflict", answer.json
        assert "409" in document[method]["responses"], method
