"""The chart's optional parts, rendered by the real Helm engine: monitoring (the scrape-only
metrics token, the Prometheus Operator ServiceMonitor and the Grafana dashboard, whose
queries are checked against the series the service really exposes) and the head's GCS
fault tolerance with an external Redis."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.metrics import ServiceMetrics
from service.settings import Settings
from service.store import Store
from tests.e2e.test_helm_chart import (
    CHART,
    FULLNAME,
    KUBE_VERSION,
    api_container,
    env_of,
    kinds,
    one,
    render_objects,
)

MONITORED = {
    "metrics": {
        "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
        "grafanaDashboard": {"enabled": True, "annotations": {"grafana_folder": "Training"}},
    }
}


def test_by_default_there_is_no_scrape_token_monitor_or_dashboard() -> None:
    objects = render_objects({})
    assert not kinds(objects, "ServiceMonitor") and not kinds(objects, "ConfigMap")
    assert f"{FULLNAME}-metrics-token" not in {o["metadata"]["name"] for o in objects}
    assert "ETRAIN_METRICS_TOKEN" not in env_of(api_container(objects))


def test_the_service_monitor_scrapes_the_api_with_the_token_the_service_accepts() -> None:
    objects = render_objects(MONITORED)
    monitor = one(objects, "ServiceMonitor", FULLNAME)
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    # It selects the API Service (and only it) and names one of its ports.
    selector = monitor["spec"]["selector"]["matchLabels"]
    services = [
        s
        for s in kinds(objects, "Service")
        if all(s["metadata"]["labels"].get(k) == v for k, v in selector.items())
    ]
    assert [s["metadata"]["name"] for s in services] == [FULLNAME]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in services[0]["spec"]["ports"]}
    assert (endpoint["path"], endpoint["interval"], endpoint["scrapeTimeout"]) == (
        "/metrics",
        "30s",
        "10s",
    )
    assert endpoint["authorization"]["type"] == "Bearer"
    credentials = endpoint["authorization"]["credentials"]
    # The Secret Prometheus reads is the one the service's ETRAIN_METRICS_TOKEN comes from.
    secret = one(objects, "Secret", credentials["name"])
    token = base64.b64decode(secret["data"][credentials["key"]]).decode()
    assert len(token) == 48
    env = env_of(api_container(objects))["ETRAIN_METRICS_TOKEN"]
    assert env["valueFrom"]["secretKeyRef"] == credentials
    assert "metrics_token" in Settings.model_fields  # the variable names a real setting
    for obj in (secret, one(objects, "Deployment")):
        assert kubernetes_validate.validate(obj, KUBE_VERSION, strict=True) == KUBE_VERSION


def test_an_existing_secret_holds_the_scrape_token() -> None:
    objects = render_objects(
        {
            "metrics": {
                "enabled": True,
                "existingSecret": "prometheus-scrape",
                "existingSecretKey": "token",
            }
        }
    )
    assert f"{FULLNAME}-metrics-token" not in {o["metadata"]["name"] for o in objects}
    env = env_of(api_container(objects))["ETRAIN_METRICS_TOKEN"]
    assert env["valueFrom"]["secretKeyRef"] == {"name": "prometheus-scrape", "key": "token"}
    assert not kinds(objects, "ServiceMonitor")


def test_lint_is_clean_with_monitoring_on() -> None:
    report = helm.lint(CHART, MONITORED, strict=True, kube_version="v1.32.0")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def exposed_series(tmp_path: Path) -> dict[str, set[str]]:
    """Sample name -> its label names, from the exposition of the service's own registry."""
    store = Store(f"sqlite:///{tmp_path / 'etrain.db'}")
    try:
        text = ServiceMetrics(store).exposition().decode()
    finally:
        store.close()
    labels = {
        "etrain_jobs": {"state"},
        "etrain_http_requests": {"route", "method", "status"},
        "etrain_http_request_duration_seconds": {"route", "method", "le"},
        "etrain_job_recovery_seconds": {"kind", "le"},
        "etrain_checkpoint_write_seconds": {"le"},
    }
    series: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        names = {
            "counter": [f"{family.name}_total"],
            "histogram": [f"{family.name}_{s}" for s in ("bucket", "sum", "count")],
        }.get(family.type, [family.name])
        for name in names:
            series[name] = labels.get(family.name, {"job", "owner"})
    return series


def test_the_grafana_dashboard_queries_only_series_the_service_exposes(tmp_path: Path) -> None:
    objects = render_objects(MONITORED)
    config = one(objects, "ConfigMap", f"{FULLNAME}-grafana-dashboard")
    assert config["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config["metadata"]["annotations"] == {"grafana_folder": "Training"}
    assert kubernetes_validate.validate(config, KUBE_VERSION, strict=True) == KUBE_VERSION
    dashboard: dict[str, Any] = json.loads(config["data"]["elastic-train.json"])
    assert dashboard["uid"] == "elastic-train"
    series = exposed_series(tmp_path)
    panels = dashboard["panels"]
    assert len(panels) >= 8
    used: set[str] = set()
    for panel in panels:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            names = set(re.findall(r"\betrain_[a-z_]+", expr))
            assert names, f"{panel['title']}: {expr}"
            unknown = names - set(series)
            assert not unknown, f"{panel['title']} queries {unknown}, which the service lacks"
            used |= names
            # Grouping and legend labels are labels those series carry.
            grouped = {
                label.strip()
                for group in re.findall(r"by \(([^)]*)\)", expr)
                for label in group.split(",")
            }
            legend = set(re.findall(r"\{\{(\w+)\}\}", target.get("legendFormat", "")))
            carried = set.union(*(series[n] for n in names))
            assert grouped <= carried and legend <= carried, f"{panel['title']}: {expr}"
    # Every family the service exposes has a panel.
    families = {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in series}
    assert families == {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in used}


def test_gcs_fault_tolerance_keeps_the_head_state_in_redis() -> None:
    objects = render_objects(
        {
            "ray": {
                "kuberay": {
                    "gcsFaultTolerance": {
                        "enabled": True,
                        "redisAddress": "redis-master.redis.svc:6379",
                        "passwordSecret": {"name": "redis", "key": "redis-password"},
                        "externalStorageNamespace": "etrain",
                    }
                }
            }
        }
    )
    cluster = one(objects, "RayCluster")
    password = {"secretKeyRef": {"name": "redis", "key": "redis-password"}}
    assert cluster["spec"]["gcsFaultToleranceOptions"] == {
        "redisAddress": "redis-master.redis.svc:6379",
        "redisPassword": {"valueFrom": password},
        "externalStorageNamespace": "etrain",
    }
    # Off by default: no Redis is assumed.
    assert "gcsFaultToleranceOptions" not in one(render_objects({}), "RayCluster")["spec"]


def test_gcs_fault_tolerance_without_a_redis_address_is_refused() -> None:
    with pytest.raises(helm.HelmRenderError) as refused:
        render_objects({"ray": {"kuberay": {"gcsFaultTolerance": {"enabled": True}}}})
    assert "gcsFaultTolerance.enabled is true but its redisAddress is empty" in str(refused.value)
