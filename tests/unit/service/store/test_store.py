"""The store on SQLite always, and on PostgreSQL when ETRAIN_TEST_DATABASE_URL is set."""

import time

import pytest

from elastic.job_state import IllegalTransition, JobState
from service.store import Store
from tests.conftest import small_job


def state_event(seq: int, state: str, **data: object) -> dict:
    return {"seq": seq, "kind": "state", "time": time.time(), "data": {"state": state, **data}}


def test_a_new_job_is_queued_with_its_first_event(store: Store) -> None:
    job = store.create_job("demo", "admin", "image-classification", small_job())
    assert job.state == "queued" and job.last_seq == 1
    events = store.events(job.id)
    assert [(e.seq, e.kind, e.data["state"]) for e in events] == [(1, "state", "queued")]
    assert store.get_job(job.id).spec == small_job()  # type: ignore[union-attr]


def test_events_fold_into_the_summary(store: Store) -> None:
    job = store.create_job("demo", "admin", "image-classification", small_job())
    now = time.time()
    store.append_events(
        job.id,
        [
            state_event(2, "starting", world_size=2),
            {"seq": 3, "kind": "attempt_started", "time": now, "data": {"world_size": 2}},
            state_event(4, "running", world_size=2),
            {
                "seq": 5,
                "kind": "metrics",
                "time": now,
                "data": {
                    "step": 10,
                    "loss": 1.5,
                    "samples_per_s": 900.0,
                    "world_size": 2,
                    "total_steps": 50,
                },
            },
            {
                "seq": 6,
                "kind": "checkpoint_saved",
                "time": now,
                "data": {"step": 10, "path": "/c/step_10", "size_bytes": 123, "created_at": now},
            },
            {
                "seq": 7,
                "kind": "checkpoint_saved",
                "time": now,
                "data": {"step": 20, "path": "/c/step_20", "size_bytes": 124, "created_at": now},
            },
            {
                "seq": 8,
                "kind": "checkpoint_removed",
                "time": now,
                "data": {"step": 10, "path": "/c/step_10"},
            },
        ],
    )
    row = store.get_job(job.id)
    assert row is not None
    assert (row.state, row.world_size, row.step, row.last_loss, row.total_steps) == (
        "running",
        2,
        10,
        1.5,
        50,
    )
    assert row.started_at is not None and row.last_seq == 8
    assert [(c.step, c.path, c.size_bytes) for c in store.checkpoints(job.id)] == [
        (20, "/c/step_20", 124)
    ]
    store.append_events(job.id, [state_event(9, "succeeded")])
    row = store.get_job(job.id)
    assert row is not None and row.state == "succeeded" and row.finished_at is not None


def test_replayed_events_are_ignored_and_gaps_refused(store: Store) -> None:
    job = store.create_job("demo", "admin", "image-classification", small_job())
    store.append_events(job.id, [state_event(2, "starting")])
    store.append_events(job.id, [state_event(2, "starting")])  # a re-delivery
    assert [e.seq for e in store.events(job.id)] == [1, 2]
    with pytest.raises(ValueError, match="leaves a gap after 2"):
        store.append_events(job.id, [state_event(4, "running")])
    assert [e.seq for e in store.events(job.id)] == [1, 2]


def test_an_illegal_transition_stores_nothing(store: Store) -> None:
    job = store.create_job("demo", "admin", "image-classification", small_job())
    with pytest.raises(IllegalTransition):
        store.append_events(job.id, [state_event(2, "succeeded")])
    row = store.get_job(job.id)
    assert row is not None and row.state == "queued" and row.last_seq == 1


def test_list_is_newest_first_with_cursor_and_filter(store: Store) -> None:
    ids = []
    for i in range(5):
        ids.append(store.create_job(f"j{i}", "admin", "image-classification", small_job()).id)
        time.sleep(0.002)
    store.append_events(ids[1], [state_event(2, "cancelled")])
    store.append_events(ids[3], [state_event(2, "cancelled")])

    first = store.list_jobs(None, 2, None)
    assert [j.id for j in first.items] == [ids[4], ids[3]]
    second = store.list_jobs(None, 2, first.next_cursor)
    assert [j.id for j in second.items] == [ids[2], ids[1]]
    third = store.list_jobs(None, 2, second.next_cursor)
    assert [j.id for j in third.items] == [ids[0]] and third.next_cursor is None

    cancelled = store.list_jobs(JobState.CANCELLED, 10, None)
    assert [j.id for j in cancelled.items] == [ids[3], ids[1]]
    assert {j.id for j in store.active_jobs()} == {ids[0], ids[2], ids[4]}
    with pytest.raises(ValueError, match="cursor"):
        store.list_jobs(None, 2, "bm90LWEtam9i")


def test_a_page_of_the_list_is_summaries_with_the_worker_bounds_not_specs(store: Store) -> None:
    from service.schemas import JobOut, JobSummary

    spec = {**small_job(), "scaling": {"min_workers": 2, "max_workers": 3, "cpus_per_worker": 1}}
    job = store.create_job("bounds", "admin", "image-classification", spec)
    (row,) = store.list_jobs(None, 10, None).items
    summary = JobSummary.model_validate(row).model_dump(mode="json")
    assert "spec" not in summary and (summary["min_workers"], summary["max_workers"]) == (2, 3)
    full = JobOut.model_validate(store.get_job(job.id)).model_dump(mode="json")
    assert summary == {k: v for k, v in full.items() if k != "spec"}
    assert full["spec"] == spec
