"""The synchronous Python client of the elastic-train API.

from elastic_train import Client

client = Client()                       # ETRAIN_URL / ETRAIN_TOKEN, or `etrain login`
job = client.submit(spec)               # a dict or a jobs.spec.JobSpec, checked first
for point in job.stream_metrics():      # as the job reports them
    print(point["step"], point["loss"])
print(job.wait())                       # JobState.SUCCEEDED
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from httpx_sse import EventSource

from elastic.events import EventKind
from elastic.job_state import JobState
from elastic_train import checkpoint_download, code_upload, config, files_download, protocol
from elastic_train.code_upload import CodeSource
from elastic_train.errors import ConnectionFailed, PayloadTooLarge, from_problem
from elastic_train.models import (
    Checkpoint,
    Event,
    JobInfo,
    LogLine,
    Me,
    MetricSeries,
    log_lines,
    metric_point,
)

if TYPE_CHECKING:
    from jobs.spec import JobSpec

USER_AGENT = "elastic-train-client/0.1.0"


class Client:
    """A connection to one elastic-train service. ``url`` and ``token`` default to
    ``ETRAIN_URL`` / ``ETRAIN_TOKEN``, then to what ``etrain login`` saved.

    ``reconnect_for``: how long a live stream keeps trying to reconnect to a service that
    stopped answering before it raises :class:`ConnectionFailed`."""

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        timeout: float = 30.0,
        reconnect_for: float = 60.0,
    ) -> None:
        creds = config.resolve(url, token)
        self.url = creds.url
        self.timeout = timeout
        self.reconnect_for = reconnect_for
        headers = {"User-Agent": USER_AGENT}
        if creds.token:
            headers["Authorization"] = f"Bearer {creds.token}"
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    # -- plain requests --------------------------------------------------------------

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        """Any API call (e.g. the admin routes ``/v1/users``, ``/v1/tokens``): its JSON,
        or the typed :class:`ApiError` / :class:`ConnectionFailed`."""
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TransportError as e:
            raise ConnectionFailed(self.url, protocol.transport_reason(e)) from None
        if response.is_error:
            raise from_problem(response.status_code, response.content, dict(response.headers))
        return response.json() if response.content else None

    def me(self) -> Me:
        return Me.model_validate(self.request("GET", "/v1/me"))

    def upload_code(self, code: CodeSource) -> str:
        """Pack a directory of training code (see :mod:`elastic_train.code_archive` for
        what is left out), upload it and return its id, for a job spec's ``code``. Over the
        size limit: :class:`CodeTooLarge` naming the biggest files, before any upload."""
        archive = code_upload.packed_within(code)
        try:
            answer = self.request(
                "POST", code_upload.CODE_PATH, content=archive.data, headers=code_upload.HEADERS
            )
        except PayloadTooLarge as e:
            raise code_upload.too_large(e, archive) from None
        return str(answer["id"])

    def submit(
        self,
        spec: JobSpec | Mapping[str, Any],
        *,
        code: CodeSource | None = None,
        idempotency_key: str | None = None,
    ) -> Job:
        """Submit a job. The spec is checked with ``JobSpec`` first: an invalid one raises
        ``pydantic.ValidationError`` and nothing is sent. With ``code`` (a directory, or
        one packed already), it is uploaded first and the job runs on it."""
        body = protocol.spec_body(spec)
        if code is not None:
            body["code"] = self.upload_code(code)
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return Job(
            self,
            JobInfo.model_validate(self.request("POST", "/v1/jobs", json=body, headers=headers)),
        )

    def job(self, job_id: str) -> Job:
        return Job(self, self._job_info(job_id))

    def jobs(self, state: JobState | str | None = None, limit: int | None = None) -> list[Job]:
        """The caller's jobs (every job for an admin), newest first."""
        found: list[Job] = []
        cursor: str | None = None
        while limit is None or len(found) < limit:
            size = (
                protocol.JOBS_PAGE_SIZE
                if limit is None
                else min(protocol.JOBS_PAGE_SIZE, limit - len(found))
            )
            params: dict[str, Any] = {"limit": size}
            if state is not None:
                params["state"] = str(JobState(state))
            if cursor:
                params["cursor"] = cursor
            page = self.request("GET", "/v1/jobs", params=params)
            found.extend(Job(self, JobInfo.model_validate(item)) for item in page["items"])
            cursor = page.get("next_cursor")
            if not cursor:
                break
        return found

    def _job_info(self, job_id: str) -> JobInfo:
        return JobInfo.model_validate(self.request("GET", protocol.job_path(job_id)))

    def _download(self, path: str, target: Path) -> None:
        """GET ``path`` into the file ``target``, a block at a time (never whole in memory)."""
        try:
            with self._http.stream(
                "GET", path, timeout=protocol.download_timeout(self.timeout)
            ) as response:
                if response.is_error:
                    response.read()
                    raise from_problem(
                        response.status_code, response.content, dict(response.headers)
                    )
                with target.open("wb") as fh:
                    for block in response.iter_raw(1 << 20):
                        fh.write(block)
        except httpx.TransportError as e:
            # A body short of its Content-Length lands here too: the service ends the
            # stream when a part changes while it is sent.
            raise ConnectionFailed(
                self.url, f"the download ended early ({protocol.transport_reason(e)})"
            ) from None

    # -- event streams ----------------------------------------------------------------

    def _event_pages(self, path: str, after: int, params: dict[str, Any]) -> Iterator[Any]:
        while True:
            page = self.request(
                "GET", path, params={**params, "after": after, "limit": protocol.PAGE_SIZE}
            )
            yield page
            if page["next_after"] == after:
                return
            after = page["next_after"]

    def _follow(
        self, job_id: str, cursor: protocol.StreamCursor, deadline: float | None = None
    ) -> Iterator[Event]:
        """The job's events after ``cursor`` as they happen, until its terminal event,
        reconnecting with ``Last-Event-ID`` when the stream is cut or the service asks."""
        path = protocol.job_path(job_id, "events")
        retry = protocol.Retrier(self.url, self.reconnect_for)
        while not cursor.finished:
            delay = 0.2
            try:
                with self._http.stream(
                    "GET",
                    path,
                    params=cursor.params(),
                    headers={"Accept": "text/event-stream", **cursor.headers()},
                    timeout=protocol.stream_timeout(deadline, self.timeout),
                ) as response:
                    if response.is_error:
                        response.read()
                        error = from_problem(
                            response.status_code, response.content, dict(response.headers)
                        )
                        if error.status not in protocol.RETRYABLE_STATUS:
                            raise error
                        delay = retry.failed(error.line())
                    else:
                        retry.connected()
                        cursor.connections += 1
                        asked = False
                        for sse in EventSource(response).iter_sse():
                            got = cursor.take(sse)
                            if got is protocol.RECONNECT:
                                asked = True
                                break
                            if isinstance(got, Event):
                                yield got
                            if cursor.finished:
                                return
                            protocol.check_deadline(deadline)
                        if not asked:
                            delay = retry.failed("the stream ended before the job did")
            except httpx.TransportError as e:
                protocol.check_deadline(deadline)
                delay = retry.failed(protocol.transport_reason(e))
            protocol.check_deadline(deadline)
            time.sleep(delay)


class Job:
    """A job on the service: ``info`` is its last known state (see :meth:`refresh`)."""

    def __init__(self, client: Client, info: JobInfo) -> None:
        self.client = client
        self.info = info

    def __repr__(self) -> str:
        return f"Job(id={self.id!r}, name={self.info.name!r}, state={self.state.value!r})"

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def state(self) -> JobState:
        return self.info.state

    def refresh(self) -> Job:
        self.info = self.client._job_info(self.id)
        return self

    def wait(self, timeout: float | None = None) -> JobState:
        """Block until the job has ended; its final state. TimeoutError after ``timeout`` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self.refresh()
        if not self.state.is_terminal:
            for _ in self.client._follow(
                self.id, protocol.StreamCursor(kinds=(EventKind.STATE,)), deadline
            ):
                pass
            self.refresh()
        return self.state

    def events(
        self, follow: bool = False, *, after: int = 0, kinds: Iterable[str] | None = None
    ) -> Iterator[Event]:
        """The job's event log after ``after``; with ``follow``, live until the job ends."""
        if follow:
            yield from self.client._follow(self.id, protocol.StreamCursor(after, kinds))
            return
        params = {"kind": list(kinds)} if kinds is not None else {}
        for page in self.client._event_pages(protocol.job_path(self.id, "events"), after, params):
            yield from (Event.model_validate(item) for item in page["items"])

    def stream_metrics(self, *, after: int = 0) -> Iterator[dict[str, Any]]:
        """Each metrics report (``time``, ``step``, ``loss``, ``samples_per_s``,
        ``world_size``, ...) as it arrives, from the first, until the job ends."""
        for event in self.events(follow=True, after=after, kinds=(EventKind.METRICS,)):
            yield metric_point(event)

    def logs(
        self, follow: bool = False, *, rank: int | None = None, after: int = 0
    ) -> Iterator[LogLine]:
        """The workers' output lines (of one ``rank`` if given); with ``follow``, live
        until the job ends."""
        if follow:
            for event in self.events(follow=True, after=after, kinds=(EventKind.LOG,)):
                yield from (line for line in log_lines(event) if rank is None or line.rank == rank)
            return
        for page in self.client._event_pages(protocol.job_path(self.id, "logs"), after, {}):
            for item in page["items"]:
                line = LogLine.model_validate(item)
                if rank is None or line.rank == rank:
                    yield line

    def metrics(self, *, every: int | None = None, points: int | None = None) -> MetricSeries:
        params = {k: v for k, v in (("every", every), ("points", points)) if v is not None}
        return MetricSeries.model_validate(
            self.client.request("GET", protocol.job_path(self.id, "metrics"), params=params)
        )

    def checkpoints(self) -> list[Checkpoint]:
        answer = self.client.request("GET", protocol.job_path(self.id, "checkpoints"))
        return [Checkpoint.model_validate(item) for item in answer["items"]]

    def download_checkpoint(
        self, step: int | None = None, into: str | os.PathLike[str] = "."
    ) -> Path:
        """Download checkpoint ``step`` (the newest when None) into
        ``into/<job id>-step-<step>/`` (its ``manifest.json`` and parts) and return that
        directory. Every part is checked against the manifest's size and SHA-256 here:
        :class:`CheckpointCorrupt` when one differs, and nothing is kept. An existing
        directory of that name is never overwritten."""
        if step is None:
            step = checkpoint_download.newest_step(self.id, self.checkpoints())
        dest = checkpoint_download.destination(into, self.id, step)
        with checkpoint_download.staging(dest) as stage:
            archive = stage / checkpoint_download.ARCHIVE
            self.client._download(protocol.download_path(self.id, step), archive)
            return checkpoint_download.unpack(archive, stage, dest)

    def download_files(self, into: str | os.PathLike[str] = ".") -> Path:
        """Download what the job's code wrote in its own directory (``ETRAIN_CHECKPOINT_DIR``)
        into ``into/<job id>/`` and return that directory. Unpacked safely: nothing lands
        outside it, and a link the job made that leaves it is left out (with a warning).
        :class:`NotFound` when the job wrote nothing there or runs a built-in workload; an
        existing directory of that name is never overwritten."""
        dest = files_download.destination(into, self.id)
        with checkpoint_download.staging(dest) as stage:
            archive = stage / files_download.ARCHIVE
            self.client._download(files_download.files_path(self.id), archive)
            return files_download.unpack(archive, stage, dest, self.id)

    def cancel(self) -> Job:
        """Ask the service to cancel the job (Conflict if it has already ended)."""
        self.info = JobInfo.model_validate(
            self.client.request("POST", protocol.job_path(self.id, "cancel"))
        )
        return self
