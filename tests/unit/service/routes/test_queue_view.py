"""GET /v1/queue's filter on its own: the scheduler's ``queue()`` as each caller may see it,
with the store's names and states."""

from __future__ import annotations

from typing import Any

from service.auth import Caller
from service.routes.cluster import visible_queue
from service.store import JobRow

# What the scheduler's queue() answers (elastic/cluster/capacity.py's docstring has the format).
VIEW: dict[str, Any] = {
    "queue": [
        {
            "job_id": "job-b2",
            "owner": "bob",
            "priority": 50,
            "position": 2,
            "reason": "waiting: bob's quota of 2 workers is in use",
            "expected_start_s": None,
        },
        {
            "job_id": "job-a1",
            "owner": "alice",
            "priority": 100,
            "position": 1,
            "reason": "waiting behind 0 jobs of priority 100",
            "expected_start_s": 12.5,
        },
    ],
    "waiting": 2,
    "running": [
        {
            "job_id": "job-b1",
            "owner": "bob",
            "priority": 50,
            "size": 3,
            "borrowed": 1,
            "min_workers": 1,
            "max_workers": 4,
        }
    ],
    "quotas": {"*": {"workers": 8, "gpus": None}, "bob": {"workers": 2, "gpus": 0}},
}
ROWS = {
    "job-a1": JobRow(id="job-a1", name="alices", state="queued"),
    "job-b1": JobRow(id="job-b1", name="bobs-running", state="running"),
    "job-b2": JobRow(id="job-b2", name="bobs-waiting", state="queued"),
}


def test_an_admin_sees_every_entry_with_its_name_and_state() -> None:
    out = visible_queue(VIEW, Caller("root", "admin", "t"), ROWS).model_dump(mode="json")
    assert out == {
        "queue": [
            {
                "position": 1,
                "priority": 100,
                "visible": True,
                "job_id": "job-a1",
                "name": "alices",
                "owner": "alice",
                "state": "queued",
                "reason": "waiting behind 0 jobs of priority 100",
                "expected_start_s": 12.5,
            },
            {
                "position": 2,
                "priority": 50,
                "visible": True,
                "job_id": "job-b2",
                "name": "bobs-waiting",
                "owner": "bob",
                "state": "queued",
                "reason": "waiting: bob's quota of 2 workers is in use",
                "expected_start_s": None,
            },
        ],
        "waiting": 2,
        "next_after_position": None,
        "running": [
            {
                "priority": 50,
                "visible": True,
                "job_id": "job-b1",
                "name": "bobs-running",
                "owner": "bob",
                "state": "running",
                "size": 3,
                "borrowed": 1,
                "min_workers": 1,
                "max_workers": 4,
            }
        ],
        "quotas": {"*": {"workers": 8, "gpus": None}, "bob": {"workers": 2, "gpus": 0.0}},
    }


def test_a_user_sees_where_others_stand_but_not_whose_or_which_jobs() -> None:
    out = visible_queue(VIEW, Caller("alice", "user", "t"), ROWS).model_dump(mode="json")
    assert out["queue"] == [
        {
            "position": 1,
            "priority": 100,
            "visible": True,
            "job_id": "job-a1",
            "name": "alices",
            "owner": "alice",
            "state": "queued",
            "reason": "waiting behind 0 jobs of priority 100",
            "expected_start_s": 12.5,
        },
        {
            "position": 2,
            "priority": 50,
            "visible": False,
            "job_id": None,
            "name": None,
            "owner": None,
            "state": None,
            "reason": None,
            "expected_start_s": None,
        },
    ]
    assert out["running"] == [
        {
            "priority": 50,
            "visible": False,
            "job_id": None,
            "name": None,
            "owner": None,
            "state": None,
            "size": 3,
            "borrowed": 1,
            "min_workers": 1,
            "max_workers": 4,
        }
    ]
    assert out["quotas"] == {"*": {"workers": 8, "gpus": None}}  # not bob's
    assert "bob" not in str(out) and "job-b" not in str(out)
    bobs = visible_queue(VIEW, Caller("bob", "user", "t"), ROWS).model_dump(mode="json")
    assert bobs["quotas"] == {"*": {"workers": 8, "gpus": None}, "bob": {"workers": 2, "gpus": 0}}


def test_an_entry_the_store_does_not_hold_keeps_its_place_without_a_name() -> None:
    out = visible_queue(VIEW, Caller("root", "admin", "t"), {})
    assert [(e.position, e.job_id, e.name, e.state) for e in out.queue] == [
        (1, "job-a1", None, None),
        (2, "job-b2", None, None),
    ]


def test_a_page_of_a_long_queue_says_how_many_wait_and_where_the_next_page_starts() -> None:
    """The scheduler answered positions 3 and 4 of 5: the next page starts after 4; the
    page holding the last entry has no next."""
    page = {**VIEW, "queue": [{**VIEW["queue"][1], "position": p} for p in (3, 4)], "waiting": 5}
    out = visible_queue(page, Caller("root", "admin", "t"), ROWS)
    assert ([e.position for e in out.queue], out.waiting, out.next_after_position) == (
        [3, 4],
        5,
        4,
    )
    last = visible_queue({**page, "waiting": 4}, Caller("root", "admin", "t"), ROWS)
    assert (last.waiting, last.next_after_position) == (4, None)
    empty = visible_queue({**VIEW, "queue": [], "waiting": 0}, Caller("root", "admin", "t"), ROWS)
    assert (empty.queue, empty.waiting, empty.next_after_position) == ([], 0, None)
