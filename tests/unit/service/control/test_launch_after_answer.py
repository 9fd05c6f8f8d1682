"""A submission's launch happens after the answer: what the background launcher records when
the launch fails. The stored spec cannot be launched (as one stored by an older version
whose rules changed), so the launch fails whether or not this process is connected to Ray
(in the full suite it is)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from elastic.job_state import JobState
from service.control import JobControl
from service.settings import Settings
from service.store import Store
from service.streams import Hub
from tests.conftest import small_job


def test_a_launch_that_fails_is_recorded_on_the_job(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "svc", checkpoint_dir=str(tmp_path / "ckpt"))
    store = Store(settings.resolved_database_url)
    spec = small_job()
    spec["scaling"] = {"min_workers": 3, "max_workers": 1}  # refused at launch
    job = store.create_job(spec["name"], "alice", spec["workload"], spec)
    announced: list[dict[str, object]] = []
    hub = Hub(16)
    hub.observe(lambda job_id, events: announced.extend(events))

    async def scenario() -> None:
        control = JobControl(settings, store, hub)
        control.start()
        try:
            control.request_launch(job.id)
            control.request_launch(job.id)  # asked twice: still one failure recorded
            deadline = time.monotonic() + 10
            # The store is written in a thread and the hub told after it: a loaded machine
            # can show the stored failure before it was told, and a stop then ends the telling.
            while (
                store.get_job(job.id).state == JobState.QUEUED.value  # type: ignore[union-attr]
                or not announced
            ):
                assert time.monotonic() < deadline, "the failed launch was never stored and told"
                await asyncio.sleep(0.05)
        finally:
            await control.stop()

    asyncio.run(scenario())
    ended = store.get_job(job.id)
    assert ended is not None and ended.state == "failed"
    assert ended.message is not None
    assert ended.message.startswith("could not start the job on Ray: "), ended.message
    events = store.events(job.id)
    assert [(e.seq, e.kind, e.data["state"]) for e in events] == [
        (1, "state", "queued"),
        (2, "state", "failed"),
    ]
    assert events[1].data["reason"] == ended.message
    assert [e["seq"] for e in announced] == [2]  # told to live readers once it was stored
    store.close()
