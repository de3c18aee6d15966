"""``GET /metrics`` against a real manager and agent: every metric the issue names, parsed as Prometheus parses it.

Real parts: a ``gpumgr manager`` process with an operator token and a tenant, a ``gpumgr agent`` on the
Docker runtime with simulated GPUs (usage declared by real processes in real containers).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.procs import AgentProc, ManagerProc, wait_for

GiB = 1 << 30
OPERATOR = "operator-token-metrics-0123"
ALICE = "alice-token-metrics-0123456"
POLITE = "trap 'exit 0' TERM; while :; do sleep 1; done"


def scrape(manager: ManagerProc) -> dict[str, list[Any]]:
    """Every sample by metric name, from the text format parsed as Prometheus would."""
    response = manager.get("/metrics")
    assert response.status_code == 200, response.text
    assert response.headers["Content-Type"].startswith("text/plain; version=")
    samples: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def value(samples: dict[str, list[Any]], metric: str, **labels: str) -> float | None:
    for sample in samples.get(metric, []):
        if all(sample.labels.get(k) == v for k, v in labels.items()):
            return float(sample.value)
    return None


@pytest.fixture
def stack(tmp_path: Path, test_image: str, cleanup_containers: None):
    config = tmp_path / "manager.yaml"
    config.write_text(yaml.safe_dump({"token": OPERATOR, "tenants": {"alice": {"token": ALICE,
                                                                                "gpu_memory": "3GiB"}}}))
    manager = ManagerProc(tmp_path, "--config", str(config))
    manager.http.headers["Authorization"] = f"Bearer {OPERATOR}"
    agent = AgentProc(tmp_path, manager, "metrics-node", gpus="sim:2x24GiB")
    yield manager, agent
    agent.stop()
    manager.stop()


def job(image: str, memory: str, use: int, **extra: Any) -> dict[str, Any]:
    return {"image": image, "gpu_memory": memory, "env": {"GPUMGR_SIM_USAGE_FILE": "/tmp/use"},
            "command": ["sh", "-c", f"echo {use} > /tmp/use; {POLITE}"], **extra}


def test_metrics_show_the_map_the_grants_the_outcomes_and_the_api(stack, test_image):
    manager, agent = stack
    alice = requests.Session()
    alice.headers["Authorization"] = f"Bearer {ALICE}"
    placed = manager.post("/v1/containers", json=job(test_image, "2GiB", GiB, name="metrics-job")).json()
    assert alice.post(manager.url + "/v1/containers", json=job(test_image, "4GiB", 0), timeout=30).status_code == 403
    assert manager.post("/v1/containers", json=job(test_image, "30GiB", 0)).status_code == 409
    killed = manager.post("/v1/containers", json=job(test_image, "1GiB", 2 * GiB)).json()
    ended = wait_for(lambda: (r := manager.get(f"/v1/containers/{killed['id']}").json())["state"] == "killed" and r,
                     15, what="the overrunning container killed")
    # the sample that killed it counts toward its peak, and the overrun is told once, under "overrun"
    assert ended["gpu_memory_peak"] == 2 * GiB and ended["detail"]["overrun"]["observed"] == 2 * GiB
    assert set(ended["detail"]) == {"overrun"}, ended["detail"]
    wait_for(lambda: manager.get(f"/v1/containers/{placed['id']}").json()["gpu_memory_used"] == GiB, 10,
             what="usage sampled")

    samples = scrape(manager)
    gpu = placed["gpus"][0]["uuid"]
    labels = {"node": "metrics-node", "gpu": gpu}
    assert value(samples, "gpumgr_gpu_memory_total_bytes", **labels, index=str(placed["gpus"][0]["index"]),
                 model=placed["gpus"][0]["name"]) == 24 * GiB
    assert value(samples, "gpumgr_gpu_memory_reserved_bytes", **labels) == 2 * GiB
    assert value(samples, "gpumgr_gpu_memory_used_bytes", **labels) == GiB
    assert value(samples, "gpumgr_gpu_memory_unmanaged_bytes", **labels) == 0
    container = {**labels, "container": placed["id"], "name": "metrics-job", "tenant": ""}
    assert value(samples, "gpumgr_container_memory_grant_bytes", **container) == 2 * GiB
    assert value(samples, "gpumgr_container_memory_used_bytes", **container) == GiB
    assert value(samples, "gpumgr_node_up", node="metrics-node") == 1
    assert value(samples, "gpumgr_overrun_kills_total", node="metrics-node") == 1
    assert value(samples, "gpumgr_placements_total", outcome="placed") == 2
    assert value(samples, "gpumgr_placements_total", outcome="no_fit") == 1
    assert value(samples, "gpumgr_placements_total", outcome="quota_exceeded") == 1
    assert value(samples, "gpumgr_placements_total", outcome="failed") == 0
    assert value(samples, "gpumgr_queue_length", tenant="alice") == 0
    posts = value(samples, "gpumgr_request_duration_seconds_count", route="/v1/containers", method="POST")
    assert posts == 4  # the 201s, the 409 and alice's 403; the raw path never becomes a label
    assert value(samples, "gpumgr_request_duration_seconds_count", route="/v1/containers/<cid>", method="GET")

    # a queued request of alice's shows in the queue's length
    blocker = manager.post("/v1/containers", json=job(test_image, "22GiB", 0)).json()
    other = manager.post("/v1/containers", json=job(test_image, "22GiB", 0)).json()
    waiting = alice.post(manager.url + "/v1/containers", json=job(test_image, "3GiB", 0, queue=True), timeout=30)
    assert waiting.status_code == 202, waiting.text
    assert value(scrape(manager), "gpumgr_queue_length", tenant="alice") == 1
    for cid in (blocker["id"], other["id"], waiting.json()["id"]):
        manager.delete(f"/v1/containers/{cid}")

    # a node that stops heartbeating is down
    agent.stop()
    wait_for(lambda: value(scrape(manager), "gpumgr_node_up", node="metrics-node") == 0, 10, what="node_up 0")


def test_metrics_need_the_operators_token(stack):
    manager, _ = stack
    assert requests.get(manager.url + "/metrics", timeout=10).status_code == 401
    tenant = requests.get(manager.url + "/metrics", headers={"Authorization": f"Bearer {ALICE}"}, timeout=10)
    assert tenant.status_code == 403 and tenant.json()["error"]["code"] == "forbidden"
    assert manager.get("/metrics").status_code == 200


def test_the_shipped_grafana_dashboard_and_scrape_job_use_only_metrics_that_exist(tmp_path):
    """examples/monitoring: every metric a panel queries is one the manager exports, the job scrapes /metrics."""
    import json
    import re

    from gpumgr.manager.api.app import create_app
    from gpumgr.manager.config import ManagerSettings
    from gpumgr.manager.service import Manager

    manager = Manager(ManagerSettings(state_dir=str(tmp_path / "state"), agents="tcp://127.0.0.1:0"))
    try:
        client = create_app(manager).test_client()
        client.get("/v1/nodes")
        exported = {f.name for f in text_string_to_metric_families(client.get("/metrics").data.decode())}
    finally:
        manager.stop()
    exported |= {f"{name}_{suffix}" for name in exported for suffix in ("bucket", "count", "sum", "total")}
    folder = Path(__file__).resolve().parent.parent / "examples" / "monitoring"
    dashboard = json.loads((folder / "grafana-dashboard.json").read_text())
    used = {m for panel in dashboard["panels"] for target in panel["targets"]
            for m in re.findall(r"gpumgr_[a-z_]+", target["expr"])}
    assert used and used <= exported, used - exported
    job = yaml.safe_load((folder / "prometheus.yml").read_text())["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics" and job["authorization"]["type"] == "Bearer"
