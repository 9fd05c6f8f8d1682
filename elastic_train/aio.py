"""The asynchronous Python client: :class:`Client`'s methods as coroutines and async
iterators, for notebooks and asyncio services.

    async with AsyncClient() as client:
        job = await client.submit(spec)
        async for point in job.stream_metrics():
            ...
        state = await job.wait()
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from httpx_sse import EventSource

from elastic.events import EventKind
from elastic.job_state import JobState
from elastic_train import checkpoint_download, code_upload, config, files_download, protocol
from elastic_train.client import USER_AGENT
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


class AsyncClient:
    """Like :class:`elastic_train.Client`, with ``await`` and ``async for``."""

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
        self._http = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=timeout)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = await self._http.request(method, path, **kwargs)
        except httpx.TransportError as e:
            raise ConnectionFailed(self.url, protocol.transport_reason(e)) from None
        if response.is_error:
            raise from_problem(response.status_code, response.content, dict(response.headers))
        return response.json() if response.content else None

    async def me(self) -> Me:
        return Me.model_validate(await self.request("GET", "/v1/me"))

    async def upload_code(self, code: CodeSource) -> str:
        """As :meth:`Client.upload_code`; the packing runs in a thread."""
        archive = await asyncio.to_thread(code_upload.packed_within, code)
        try:
            answer = await self.request(
                "POST", code_upload.CODE_PATH, content=archive.data, headers=code_upload.HEADERS
            )
        except PayloadTooLarge as e:
            raise code_upload.too_large(e, archive) from None
        return str(answer["id"])

    async def submit(
        self,
        spec: JobSpec | Mapping[str, Any],
        *,
        code: CodeSource | None = None,
        idempotency_key: str | None = None,
    ) -> AsyncJob:
        body = protocol.spec_body(spec)
        if code is not None:
            body["code"] = await self.upload_code(code)
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        answer = await self.request("POST", "/v1/jobs", json=body, headers=headers)
        return AsyncJob(self, JobInfo.model_validate(answer))

    async def job(self, job_id: str) -> AsyncJob:
        return AsyncJob(self, await self._job_info(job_id))

    async def jobs(
        self, state: JobState | str | None = None, limit: int | None = None
    ) -> list[AsyncJob]:
        found: list[AsyncJob] = []
        cursor: str | None = None
        while limit is None or len(found) < limit:
            size = protocol.JOBS_PAGE_SIZE
            if limit is not None:
                size = min(size, limit - len(found))
            params: dict[str, Any] = {"limit": size}
            if state is not None:
                params["state"] = str(JobState(state))
            if cursor:
                params["cursor"] = cursor
            page = await self.request("GET", "/v1/jobs", params=params)
            found.extend(AsyncJob(self, JobInfo.model_validate(item)) for item in page["items"])
            cursor = page.get("next_cursor")
            if not cursor:
                break
        return found

    async def _job_info(self, job_id: str) -> JobInfo:
        return JobInfo.model_validate(await self.request("GET", protocol.job_path(job_id)))

    async def _download(self, path: str, target: Path) -> None:
        """As :meth:`Client._download`."""
        try:
            async with self._http.stream(
                "GET", path, timeout=protocol.download_timeout(self.timeout)
            ) as response:
                if response.is_error:
                    await response.aread()
                    raise from_problem(
                        response.status_code, response.content, dict(response.headers)
                    )
                with target.open("wb") as fh:
                    async for block in response.aiter_raw(1 << 20):
                        fh.write(block)
        except httpx.TransportError as e:
            raise ConnectionFailed(
                self.url, f"the download ended early ({protocol.transport_reason(e)})"
            ) from None

    async def _event_pages(
        self, path: str, after: int, params: dict[str, Any]
    ) -> AsyncIterator[Any]:
        while True:
            page = await self.request(
                "GET", path, params={**params, "after": after, "limit": protocol.PAGE_SIZE}
            )
            yield page
            if page["next_after"] == after:
                return
            after = page["next_after"]

    async def _follow(
        self, job_id: str, cursor: protocol.StreamCursor, deadline: float | None = None
    ) -> AsyncIterator[Event]:
        path = protocol.job_path(job_id, "events")
        retry = protocol.Retrier(self.url, self.reconnect_for)
        while not cursor.finished:
            delay = 0.2
            try:
                async with self._http.stream(
                    "GET",
                    path,
                    params=cursor.params(),
                    headers={"Accept": "text/event-stream", **cursor.headers()},
                    timeout=protocol.stream_timeout(deadline, self.timeout),
                ) as response:
                    if response.is_error:
                        await response.aread()
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
                        async for sse in EventSource(response).aiter_sse():
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
            await asyncio.sleep(delay)


class AsyncJob:
    """Like :class:`elastic_train.Job`, with ``await`` and ``async for``."""

    def __init__(self, client: AsyncClient, info: JobInfo) -> None:
        self.client = client
        self.info = info

    def __repr__(self) -> str:
        return f"AsyncJob(id={self.id!r}, name={self.info.name!r}, state={self.state.value!r})"

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def state(self) -> JobState:
        return self.info.state

    async def refresh(self) -> AsyncJob:
        self.info = await self.client._job_info(self.id)
        return self

    async def wait(self, timeout: float | None = None) -> JobState:
        deadline = None if timeout is None else time.monotonic() + timeout
        await self.refresh()
        if not self.state.is_terminal:
            cursor = protocol.StreamCursor(kinds=(EventKind.STATE,))
            async for _ in self.client._follow(self.id, cursor, deadline):
                pass
            await self.refresh()
        return self.state

    async def events(
        self, follow: bool = False, *, after: int = 0, kinds: Iterable[str] | None = None
    ) -> AsyncIterator[Event]:
        if follow:
            async for event in self.client._follow(self.id, protocol.StreamCursor(after, kinds)):
                yield event
            return
        params = {"kind": list(kinds)} if kinds is not None else {}
        path = protocol.job_path(self.id, "events")
        async for page in self.client._event_pages(path, after, params):
            for item in page["items"]:
                yield Event.model_validate(item)

    async def stream_metrics(self, *, after: int = 0) -> AsyncIterator[dict[str, Any]]:
        async for event in self.events(follow=True, after=after, kinds=(EventKind.METRICS,)):
            yield metric_point(event)

    async def logs(
        self, follow: bool = False, *, rank: int | None = None, after: int = 0
    ) -> AsyncIterator[LogLine]:
        if follow:
            async for event in self.events(follow=True, after=after, kinds=(EventKind.LOG,)):
                for line in log_lines(event):
                    if rank is None or line.rank == rank:
                        yield line
            return
        async for page in self.client._event_pages(protocol.job_path(self.id, "logs"), after, {}):
            for item in page["items"]:
                line = LogLine.model_validate(item)
                if rank is None or line.rank == rank:
                    yield line

    async def metrics(self, *, every: int | None = None, points: int | None = None) -> MetricSeries:
        params = {k: v for k, v in (("every", every), ("points", points)) if v is not None}
        answer = await self.client.request(
            "GET", protocol.job_path(self.id, "metrics"), params=params
        )
        return MetricSeries.model_validate(answer)

    async def checkpoints(self) -> list[Checkpoint]:
        answer = await self.client.request("GET", protocol.job_path(self.id, "checkpoints"))
        return [Checkpoint.model_validate(item) for item in answer["items"]]

    async def download_checkpoint(
        self, step: int | None = None, into: str | os.PathLike[str] = "."
    ) -> Path:
        """As :meth:`Job.download_checkpoint`; the unpacking and hashing run in a thread."""
        if step is None:
            step = checkpoint_download.newest_step(self.id, await self.checkpoints())
        dest = checkpoint_download.destination(into, self.id, step)
        with checkpoint_download.staging(dest) as stage:
            archive = stage / checkpoint_download.ARCHIVE
            await self.client._download(protocol.download_path(self.id, step), archive)
            return await asyncio.to_thread(checkpoint_download.unpack, archive, stage, dest)

    async def download_files(self, into: str | os.PathLike[str] = ".") -> Path:
        """As :meth:`Job.download_files`; the unpacking runs in a thread."""
        dest = files_download.destination(into, self.id)
        with checkpoint_download.staging(dest) as stage:
            archive = stage / files_download.ARCHIVE
            await self.client._download(files_download.files_path(self.id), archive)
            return await asyncio.to_thread(files_download.unpack, archive, stage, dest, self.id)

    async def cancel(self) -> AsyncJob:
        answer = await self.client.request("POST", protocol.job_path(self.id, "cancel"))
        self.info = JobInfo.model_validate(answer)
        return self
