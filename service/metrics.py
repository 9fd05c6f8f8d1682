"""Prometheus metrics at ``GET /metrics``: the HTTP API's requests, and the jobs as the store
and their event log know them.

Job gauges are read from the store at scrape time, so they are right after a restart of the
service and cost nothing between scrapes. Recovery and checkpoint durations are histograms fed
by the events the service stores as they arrive (a restart starts them from zero, which
Prometheus reads as a counter reset). Each application has its own registry: several apps in
one process (the tests) do not share series.

Who may scrape: an admin token, or the scrape-only ``metrics_token`` (so that Prometheus
holds no admin rights). The series name job ids and owners, which ordinary users must not see.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterable, Iterator
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import Response
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from elastic.events import EventKind
from elastic.job_state import TERMINAL_STATES, JobState
from service.deps import BearerDep, ServicesDep, authenticate, unauthorized
from service.problems import Problem
from service.store import JobRow, Store

# Buckets for the API (a request is meant to take milliseconds) and for recoveries and
# checkpoint writes (seconds to minutes).
HTTP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
RECOVERY_BUCKETS = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
CHECKPOINT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
# Event kinds that end a recovery (their data carries recovery_seconds).
RECOVERY_KINDS = (EventKind.RESTORED, EventKind.RESIZED)
_ACTIVE = tuple(s.value for s in JobState if s not in TERMINAL_STATES)
# The `_created` timestamp series double what a scrape carries and no dashboard uses them.
disable_created_metrics()


class ServiceMetrics:
    """The registry of one application and the series it updates as things happen."""

    def __init__(self, store: Store) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "etrain_http_requests",
            "HTTP requests answered, by route template, method and status.",
            ("route", "method", "status"),
            registry=self.registry,
        )
        self.latency = Histogram(
            "etrain_http_request_duration_seconds",
            "Time from a request's arrival to its response headers, by route template.",
            ("route", "method"),
            buckets=HTTP_BUCKETS,
            registry=self.registry,
        )
        self.recovery = Histogram(
            "etrain_job_recovery_seconds",
            "Time from a failure (or a pause to grow) to the first step after it.",
            ("kind",),
            buckets=RECOVERY_BUCKETS,
            registry=self.registry,
        )
        self.checkpoint_write = Histogram(
            "etrain_checkpoint_write_seconds",
            "Time to write, sync and publish one checkpoint.",
            buckets=CHECKPOINT_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(JobsCollector(store))

    def observe_events(self, job_id: str, events: Iterable[dict[str, Any]]) -> None:
        """Called with every batch of events the service stores."""
        for event in events:
            data = event.get("data") or {}
            if event.get("kind") in RECOVERY_KINDS:
                seconds = data.get("recovery_seconds")
                if isinstance(seconds, int | float):
                    self.recovery.labels(event["kind"]).observe(float(seconds))
            elif event.get("kind") == EventKind.CHECKPOINT_SAVED:
                seconds = data.get("write_seconds")
                if isinstance(seconds, int | float):
                    self.checkpoint_write.observe(float(seconds))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class JobsCollector(Collector):
    """Jobs by state, and per unfinished job its progress, read from the store per scrape."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def describe(self) -> Iterable[Metric]:
        return ()  # computed per scrape: nothing to describe ahead

    def collect(self) -> Iterator[Metric]:
        by_state = GaugeMetricFamily(
            "etrain_jobs", "Jobs in the store, by state.", labels=["state"]
        )
        labels = ["job", "owner"]
        step = GaugeMetricFamily("etrain_job_step", "The job's last reported step.", labels=labels)
        rate = GaugeMetricFamily(
            "etrain_job_samples_per_second", "The job's last reported throughput.", labels=labels
        )
        world = GaugeMetricFamily(
            "etrain_job_world_size", "Workers in the job's current attempt.", labels=labels
        )
        restarts = GaugeMetricFamily(
            "etrain_job_restarts", "Restarts the job has made so far.", labels=labels
        )
        with self.store.session() as s:
            by_state_rows = s.execute(select(JobRow.state, func.count()).group_by(JobRow.state))
            counts: dict[str, int] = {state: n for state, n in by_state_rows.all()}
            active = s.execute(
                select(
                    JobRow.id,
                    JobRow.owner,
                    JobRow.step,
                    JobRow.samples_per_s,
                    JobRow.world_size,
                    JobRow.restarts,
                ).where(JobRow.state.in_(_ACTIVE))
            ).all()
        for state in JobState:
            by_state.add_metric([state.value], float(counts.get(state.value, 0)))
        for job_id, owner, job_step, samples_per_s, world_size, job_restarts in active:
            key = [job_id, owner]
            step.add_metric(key, float(job_step or 0))
            world.add_metric(key, float(world_size or 0))
            restarts.add_metric(key, float(job_restarts or 0))
            if samples_per_s is not None:
                rate.add_metric(key, float(samples_per_s))
        yield from (by_state, step, rate, world, restarts)


class HttpMetrics:
    """ASGI middleware counting every HTTP request by its route template (never the raw path:
    job ids would make a series per job). Latency runs to the response headers, so a live
    event stream counts its time to open, not its lifetime."""

    def __init__(self, app: ASGIApp, metrics: ServiceMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        began = time.perf_counter()
        seen: dict[str, Any] = {}

        async def record(message: Message) -> None:
            if message["type"] == "http.response.start" and not seen:
                seen["status"] = message["status"]
                self._observe(scope, message["status"], time.perf_counter() - began)
            await send(message)

        try:
            await self.app(scope, receive, record)
        except Exception:
            if not seen:  # the error handler below us answers 500
                self._observe(scope, 500, time.perf_counter() - began)
            raise

    def _observe(self, scope: Scope, status: int, seconds: float) -> None:
        route = getattr(scope.get("route"), "path", None) or "unmatched"
        method = scope.get("method", "")
        self.metrics.requests.labels(route, method, str(status)).inc()
        self.metrics.latency.labels(route, method).observe(seconds)


def require_scraper(services: ServicesDep, credentials: BearerDep) -> None:
    """An admin token or the scrape token; anyone else gets 401 or 403."""
    if credentials is None or credentials.scheme.lower() != "bearer":
        raise unauthorized("send 'Authorization: Bearer <token>'")
    scrape = services.settings.metrics_token
    if scrape is not None and secrets.compare_digest(
        credentials.credentials.encode(), scrape.get_secret_value().encode()
    ):
        return
    caller = authenticate(services, credentials.credentials)
    if caller is None:
        raise unauthorized("the token is not valid", "invalid_token")
    if not caller.is_admin:
        raise Problem(403, "Forbidden", "only an admin or the metrics token may read metrics")


router = APIRouter(tags=["metrics"])


@router.get(
    "/metrics",
    summary="Prometheus metrics (admin or the scrape token)",
    response_class=Response,
    dependencies=[Depends(require_scraper)],
)
def metrics(services: ServicesDep) -> Response:
    return Response(services.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
