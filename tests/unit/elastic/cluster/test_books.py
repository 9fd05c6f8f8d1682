"""The cluster scheduler's books (elastic/cluster/books.py) without Ray: what a supervisor
is told after each change, and what GET /v1/queue shows."""

from __future__ import annotations

from elastic.cluster.books import SchedulerBook
from elastic.cluster.scheduling import Change, Demand

NODES = [{"CPU": 1.0}, {"CPU": 1.0}, {"CPU": 1.0}]


def demand(
    job_id: str, owner: str = "alice", priority: int = 50, lo: int = 1, hi: int = 3, at: float = 0.0
) -> Demand:
    return Demand(job_id, owner, priority, lo, hi, {"CPU": 1.0}, at)


def test_a_decision_is_booked_at_once_and_stays_news_until_it_changes() -> None:
    book = SchedulerBook()
    assert book.target("low") is None  # never registered: it sizes itself
    book.register(demand("low", priority=0), now=1.0)
    assert book.replan(NODES, now=1.0)
    low = book.target("low")
    assert low is not None and (low.size, low.change) == (3, Change.START)
    assert not book.replan(NODES, now=2.0)  # nothing changed: no news, the decision stays
    assert book.target("low") == low

    book.register(demand("high", priority=100, lo=2, hi=2, at=3.0), now=3.0)
    assert book.replan(NODES, now=3.0)
    shrunk, started = book.target("low"), book.target("high")
    assert shrunk is not None and started is not None
    assert (shrunk.size, shrunk.change, shrunk.for_job) == (1, Change.SHRINK, "high")
    assert shrunk.reason == "shrunk for job high (priority 100)"
    assert (started.size, started.change) == (2, Change.START)
    # Booked before either supervisor acts: a third low job finds no free worker.
    book.register(demand("third", priority=0, lo=1, hi=1, at=4.0), now=4.0)
    book.replan(NODES, now=4.0)
    waiting = book.target("third")
    assert waiting is not None and (waiting.size, waiting.change) == (0, Change.WAIT)

    view = book.view()
    assert [(e["job_id"], e["position"]) for e in view["queue"]] == [("third", 1)]
    assert [(r["job_id"], r["size"], r["borrowed"]) for r in view["running"]] == [
        ("high", 2, 0),
        ("low", 1, 0),
    ]

    assert book.unregister("high") and not book.unregister("high")
    assert book.target("high") is None
    assert book.replan(NODES, now=5.0)
    third = book.target("third")
    assert third is not None and (third.size, third.change) == (1, Change.START)


def test_an_owner_without_a_quota_of_their_own_gets_the_default() -> None:
    book = SchedulerBook()
    book.set_quotas({"*": {"workers": 1, "gpus": None}, "bob": {"workers": None, "gpus": None}})
    book.register(demand("a1", at=1.0), now=1.0)
    book.register(demand("b1", owner="bob", hi=1, at=2.0), now=2.0)
    book.register(demand("a2", hi=1, at=3.0), now=3.0)
    book.replan(NODES, now=3.0)
    sizes = {j: p.size for j, p in book.placements.items()}
    borrowed = {j: p.borrowed for j, p in book.placements.items()}
    # Alice (the default: 1 worker) borrows the third worker; bob (no limit) holds his own.
    assert sizes == {"a1": 2, "b1": 1, "a2": 0} or sizes == {"a1": 1, "b1": 1, "a2": 1}
    assert sum(borrowed.values()) == 1 and borrowed["b1"] == 0
    assert book.jobs["a1"].borrowed + book.jobs["a2"].borrowed == 1  # recorded back
    assert book.view()["quotas"] == {
        "*": {"workers": 1, "gpus": None},
        "bob": {"workers": None, "gpus": None},
    }


def test_throughput_is_kept_per_size_and_nonsense_is_ignored() -> None:
    book = SchedulerBook()
    book.register(demand("j"), now=0.0)
    book.observe("j", 2, 80.0)
    book.observe("j", 3, 0.0)
    book.observe("j", 0, 50.0)
    book.observe("unknown", 2, 10.0)
    assert book.jobs["j"].throughput == {2: 80.0}
    book.register(demand("j", priority=100), now=9.0)  # a re-created supervisor: kept
    assert book.jobs["j"].throughput == {2: 80.0} and book.jobs["j"].demand.priority == 100


def test_the_queue_shown_follows_every_change_of_the_books() -> None:
    """The queue's order is kept between plans (reads far outnumber changes): every read
    still shows each booking, cancel and start, and a page numbers its entries from where
    it starts."""
    book = SchedulerBook()
    book.register(demand("running", lo=3, hi=3), now=0.0)
    rows = [demand(f"row-{i}", lo=2, hi=2, at=float(i + 1)) for i in range(4)]
    book.hold_rows(rows, now=1.0)
    book.replan(NODES, now=1.0)

    def shown(after_position: int = 0, limit: int | None = None) -> list[tuple[str, int]]:
        page = book.view(after_position, limit)["queue"]
        return [(e["job_id"], e["position"]) for e in page]

    assert shown() == [("row-0", 1), ("row-1", 2), ("row-2", 3), ("row-3", 4)]
    assert shown(1, 2) == [("row-1", 2), ("row-2", 3)]
    assert shown(1, 2) == [("row-1", 2), ("row-2", 3)]  # read again: the same
    assert book.unregister("row-1")  # cancelled
    assert shown() == [("row-0", 1), ("row-2", 2), ("row-3", 3)]
    assert book.view()["waiting"] == 3
    late = demand("late", lo=2, hi=2, at=9.0)
    assert book.hold_rows([rows[0], rows[2], rows[3], late], now=2.0)
    book.replan(NODES, now=2.0)
    assert shown(2) == [("row-3", 3), ("late", 4)]
    assert book.unregister("running")
    book.replan(NODES, now=3.0)  # row-0 starts
    assert shown() == [("row-2", 1), ("row-3", 2), ("late", 3)]
    view = book.view()
    assert (view["waiting"], [r["job_id"] for r in view["running"]]) == (3, ["row-0"])


def test_with_nobody_waiting_idle_workers_go_to_a_job_measured_not_to_gain() -> None:
    """A noisy measurement (no faster at 3 than at 1) must not keep a job alone on an idle
    cluster from growing back: the workers would sit idle for nobody."""
    book = SchedulerBook()
    book.register(demand("flat"), now=0.0)
    book.observe("flat", 1, 100.0)
    book.observe("flat", 3, 99.0)
    book.replan(NODES, now=0.0)
    flat = book.target("flat")
    assert flat is not None and flat.size == 3
    # With another job waiting, the policy's own sharing decides: the idle workers are its.
    book.register(demand("next", hi=2, at=1.0), now=100.0)
    book.replan(NODES, now=100.0)
    assert {j: p.size for j, p in book.placements.items()} == {"flat": 1, "next": 2}


def test_queued_rows_are_booked_in_order_and_a_supervisor_takes_one_over() -> None:
    """The service books its queued jobs without a supervisor: they queue as any job does,
    the one told to start is taken over by its supervisor, and a row no longer given (a
    cancel) leaves the books; a supervised job is never unbooked by the rows."""
    book = SchedulerBook()
    book.register(demand("running", lo=3, hi=3), now=0.0)
    rows = [demand(f"row-{i}", lo=2, hi=2, at=float(i + 1)) for i in range(3)]
    assert book.hold_rows(rows, now=1.0)
    assert not book.hold_rows(rows, now=1.5)  # the same rows again: nothing changes
    book.replan(NODES, now=2.0)
    assert [(e["job_id"], e["position"]) for e in book.view()["queue"]] == [
        ("row-0", 1),
        ("row-1", 2),
        ("row-2", 3),
    ]
    assert book.supervised("running") and not book.supervised("row-0")
    # A page: the waiting entries after a position, with how many wait in all.
    page = book.view(after_position=1, limit=1)
    assert ([e["job_id"] for e in page["queue"]], page["waiting"]) == (["row-1"], 3)
    assert [e["position"] for e in book.view(after_position=2, limit=5)["queue"]] == [3]

    assert book.unregister("running")
    book.replan(NODES, now=3.0)
    first = book.target("row-0")
    assert first is not None and (first.size, first.change) == (2, Change.START)
    book.register(rows[0], now=4.0)  # its supervisor, launched on that decision
    assert book.supervised("row-0") and book.target("row-0") == first

    # row-1 is cancelled: the service gives the rest; the supervised job stays booked.
    assert book.hold_rows([rows[2]], now=5.0)
    assert set(book.jobs) == {"row-0", "row-2"} and book.rows == {"row-2"}
    assert book.target("row-1") is None
    book.replan(NODES, now=5.0)
    waiting = book.target("row-2")
    assert waiting is not None and waiting.size == 0
    assert waiting.reason == "waiting: only 1 of 2 workers free"
