"""Fan-out of stored events to live subscribers (SSE clients), never blocking the writer.

Every subscriber has a bounded queue. The event pump publishes only what it has already
stored; a subscriber that falls too far behind is marked overflowed and told to reconnect
with its last id, which it can, because the store has everything.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from elastic.events import EventKind
from elastic.job_state import TERMINAL_STATES
from service.schemas import event_json

# Asked again, at least every keep-alive interval, whether the stream's token still works.
StillAllowed = Callable[[], Awaitable[bool]]


class Subscription:
    """One live reader. It is cut off when it lags more than ``limit`` items behind what has
    been published: by sequence number for a job's events (however they were batched), by
    items waiting for the all-jobs stream."""

    def __init__(self, limit: int, token: str | None = None) -> None:
        self.limit = limit
        self.token = token
        self.items: deque[dict[str, Any]] = deque()
        self.ready = asyncio.Event()
        self.last_sent = 0
        self.overflowed = False
        self.closed = False
        self.revoked = False

    def close(self) -> None:
        """End the stream (the service is shutting down): the reader says so and stops."""
        self.closed = True
        self.ready.set()

    def revoke(self) -> None:
        """End the stream at once: its token no longer works."""
        self.revoked = True
        self.ready.set()

    def offer(self, item: dict[str, Any]) -> None:
        if self.overflowed:
            return
        lag = item["seq"] - self.last_sent if "seq" in item else len(self.items) + 1
        if lag > self.limit:
            self.overflowed = True
            self.items.clear()
        else:
            self.items.append(item)
        self.ready.set()

    async def next(self, timeout: float) -> dict[str, Any] | None:
        """The next item, or None after ``timeout`` seconds of silence."""
        if self.revoked:
            return None
        if not self.items and not self.overflowed and not self.closed:
            self.ready.clear()
            try:
                await asyncio.wait_for(self.ready.wait(), timeout)
            except TimeoutError:
                return None
        return self.items.popleft() if self.items else None


class Hub:
    def __init__(self, buffer: int, streams_per_token: int = 1_000_000) -> None:
        self.buffer = buffer
        self.streams_per_token = streams_per_token
        self._jobs: dict[str, set[Subscription]] = {}
        self._everyone: set[Subscription] = set()
        self._streams: Counter[str] = Counter()
        self.closing = False
        self._observers: list[Callable[[str, list[dict[str, Any]]], None]] = []

    def claim_stream(self, token: str) -> bool:
        """Take one of ``token``'s stream slots; False when all are taken."""
        if self._streams[token] >= self.streams_per_token:
            return False
        self._streams[token] += 1
        return True

    def release_stream(self, token: str) -> None:
        self._streams[token] -= 1
        if self._streams[token] <= 0:
            del self._streams[token]

    def streams_of(self, token: str) -> int:
        return self._streams[token]

    def revoke(self, token: str) -> int:
        """End every live stream of ``token`` now; returns how many."""
        subs = [s for s in self._all() if s.token == token]
        for sub in subs:
            sub.revoke()
        return len(subs)

    def _all(self) -> list[Subscription]:
        return [*self._everyone, *(s for subs in self._jobs.values() for s in subs)]

    def subscribe(self, job_id: str | None, token: str | None = None) -> Subscription:
        sub = Subscription(self.buffer, token)
        if self.closing:
            sub.close()
        (self._everyone if job_id is None else self._jobs.setdefault(job_id, set())).add(sub)
        return sub

    def unsubscribe(self, job_id: str | None, sub: Subscription) -> None:
        if job_id is None:
            self._everyone.discard(sub)
            return
        subs = self._jobs.get(job_id)
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del self._jobs[job_id]

    def observe(self, observer: Callable[[str, list[dict[str, Any]]], None]) -> None:
        """Also hand every published batch to ``observer`` (the metrics), readers or not."""
        self._observers.append(observer)

    def publish(self, job_id: str, events: Iterable[dict[str, Any]]) -> None:
        events = list(events)
        for observer in self._observers:
            observer(job_id, events)
        subs = list(self._jobs.get(job_id, ()))
        if not subs:
            return
        # Formatted once, whatever the number of readers: 100 watchers cost one json.dumps.
        items = [live_item(e) for e in events]
        for sub in subs:
            for item in items:
                sub.offer(item)

    def publish_all(self, item: dict[str, Any]) -> None:
        subs = list(self._everyone)
        if not subs:
            return
        entry = {"job": item["job"], "text": sse_message(item, "job")}
        for sub in subs:
            sub.offer(entry)

    def close(self) -> None:
        """Tell every live stream to end; new ones end at once."""
        self.closing = True
        for sub in self._all():
            sub.close()

    def subscriber_count(self, job_id: str | None) -> int:
        return len(self._everyone if job_id is None else self._jobs.get(job_id, ()))


def live_item(event: dict[str, Any]) -> dict[str, Any]:
    """What a job's live readers get: enough to filter and stop on, and the text to send."""
    return {
        "seq": event["seq"],
        "kind": event["kind"],
        "terminal": _is_terminal(event),
        "text": sse_message(event_json(event), event["kind"], event["seq"]),
    }


def sse_message(data: Any, event: str | None = None, id: int | str | None = None) -> str:
    lines = []
    if id is not None:
        lines.append(f"id: {id}")
    if event is not None:
        lines.append(f"event: {event}")
    lines.extend(f"data: {line}" for line in json.dumps(data).splitlines() or [""])
    return "\n".join(lines) + "\n\n"


KEEPALIVE = ": keep-alive\n\n"
SHUTTING_DOWN = "the service is shutting down; reconnect in a few seconds"
REVOKED = sse_message({"reason": "the token of this stream no longer works"}, "revoked")


class TokenWatch:
    """Whether a stream's token still works: known at once when it is revoked through this
    service (``Hub.revoke``), and asked of the store at least every ``every_s`` seconds,
    however busy the stream (the token may be revoked elsewhere, or its user removed)."""

    def __init__(self, sub: Subscription, still_allowed: StillAllowed | None, every_s: float):
        self.sub, self.still_allowed, self.every_s = sub, still_allowed, every_s
        self.next_check = time.monotonic() + every_s

    async def lost(self) -> bool:
        if self.sub.revoked:
            return True
        if self.still_allowed is None or time.monotonic() < self.next_check:
            return False
        self.next_check = time.monotonic() + self.every_s
        if not await self.still_allowed():
            self.sub.revoke()
            return True
        return False


BACKLOG_PAGE = 500


def _is_terminal(event: dict[str, Any]) -> bool:
    return event["kind"] == EventKind.STATE and event["data"].get("state") in TERMINAL_STATES


async def job_events(
    store: Any,
    hub: Hub,
    job_id: str,
    after: int,
    keepalive_s: float,
    kinds: tuple[str, ...] | None = None,
    token: str | None = None,
    still_allowed: StillAllowed | None = None,
) -> Any:
    """SSE text for a job's events after ``after``: what is stored, then live, until the
    job's terminal event (at once when the job has ended and nothing after ``after`` is
    left). ``kinds`` narrows what is sent, not when the stream ends. It ends early when the
    token it was opened with stops working."""
    from service.store import event_dict

    sub = hub.subscribe(job_id, token)  # before reading the backlog: nothing falls in between
    watch = TokenWatch(sub, still_allowed, keepalive_s)
    last = sub.last_sent = after
    try:
        while True:
            if await watch.lost():
                yield REVOKED
                return
            rows = await asyncio.to_thread(store.events, job_id, last, BACKLOG_PAGE)
            for row in rows:
                event = event_dict(row)
                last = sub.last_sent = event["seq"]
                if kinds is None or event["kind"] in kinds:
                    yield sse_message(event_json(event), event["kind"], event["seq"])
                if _is_terminal(event):
                    return
            if len(rows) < BACKLOG_PAGE:
                job = await asyncio.to_thread(store.get_job, job_id)
                if job is None or job.state in TERMINAL_STATES:
                    if rows:
                        continue  # what was stored while this page was read
                    return  # ended, and nothing after ``last``: no event will come
                break
        while True:
            if await watch.lost():
                yield REVOKED
                return
            live = await sub.next(keepalive_s)
            if sub.revoked:
                yield REVOKED
                return
            if live is None and sub.closed:
                yield sse_message({"reason": SHUTTING_DOWN, "last_event_id": last}, "reconnect")
                return
            if sub.overflowed:
                yield sse_message(
                    {
                        "reason": "this client fell too far behind; reconnect with Last-Event-ID",
                        "last_event_id": last,
                    },
                    "reconnect",
                )
                return
            if live is None:
                yield KEEPALIVE
                continue
            if live["seq"] <= last:
                continue  # already sent from the backlog
            last = sub.last_sent = live["seq"]
            if kinds is None or live["kind"] in kinds:
                yield live["text"]
            if live["terminal"]:
                return
    finally:
        hub.unsubscribe(job_id, sub)


async def all_jobs(
    hub: Hub,
    keepalive_s: float,
    visible: Any,
    token: str | None = None,
    still_allowed: StillAllowed | None = None,
) -> Any:
    """SSE text of job-level changes across the jobs ``visible(job)`` lets the caller see.
    These carry no ids: after a reconnect, a client reloads the job list. It ends when the
    token it was opened with stops working."""
    sub = hub.subscribe(None, token)
    watch = TokenWatch(sub, still_allowed, keepalive_s)
    try:
        yield KEEPALIVE  # headers and a first byte now: the client knows it is subscribed
        while True:
            if await watch.lost():
                yield REVOKED
                return
            item = await sub.next(keepalive_s)
            if sub.revoked:
                yield REVOKED
                return
            if item is None and sub.closed:
                yield sse_message({"reason": SHUTTING_DOWN}, "reconnect")
                return
            if sub.overflowed:
                yield sse_message(
                    {
                        "reason": "this client fell too far behind; reload the "
                        "job list and reconnect"
                    },
                    "reconnect",
                )
                return
            if item is None:
                yield KEEPALIVE
                continue
            if visible(item["job"]):
                yield item["text"]
    finally:
        hub.unsubscribe(None, sub)
