"""The web dashboard in a real headless Chromium (Debian's package, driven by Playwright),
against the real service on a real multi-node Ray cluster. One browser and one server for
the module, a fresh browser context for each test; screenshots of every page go to
test-artifacts/dashboard/ (printed at the end)."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import (
    TOKEN,
    ClusterPool,
    LiveServer,
    create_user_token,
    free_port,
    make_settings,
    small_job,
    wait_for,
)

pytestmark = pytest.mark.ray

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "dashboard"
DESKTOP = {"width": 1280, "height": 720}
PHONE = {"width": 390, "height": 844}


@pytest.fixture(scope="module")
def live(
    ray_cluster: ClusterPool, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    with LiveServer(make_settings(tmp_path_factory.mktemp("dashboard"))) as server:
        yield server
        # A failed test must not leave a job holding the shared pool's workers.
        with server.client() as client:
            for job in client.get("/v1/jobs", params={"limit": 100}).json()["items"]:
                if job["state"] not in ("succeeded", "failed", "cancelled"):
                    client.post(f"/v1/jobs/{job['id']}/cancel")


@pytest.fixture(scope="module")
def api(live: LiveServer) -> Iterator[httpx.Client]:
    with live.client() as client:
        yield client


@pytest.fixture(scope="module")
def browser(request: pytest.FixtureRequest) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    assert Path(CHROMIUM).exists(), f"{CHROMIUM} is missing: `apt-get install chromium`"
    shutil.rmtree(ARTIFACTS, ignore_errors=True)
    ARTIFACTS.mkdir(parents=True)
    with sync_playwright() as p:
        launched = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield launched
        launched.close()
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print(f"\ndashboard screenshots: {ARTIFACTS}")


@pytest.fixture
def page(browser: Any, live: LiveServer) -> Iterator[Any]:
    """A fresh browser context (no session, no cache) per test, so no test depends on what
    an earlier one left signed in or on screen. ``page.sent`` records every request."""
    context = browser.new_context(viewport=DESKTOP)
    tab = context.new_page()
    errors: list[str] = []
    tab.sent = []
    tab.on("pageerror", lambda e: errors.append(str(e)))
    tab.on("request", lambda r: tab.sent.append((time.monotonic(), r.method, r.url)))
    tab.goto(live.url + "/")
    yield tab
    context.close()
    assert errors == [], errors  # no uncaught JavaScript error on any page
    # The token travels in a header only: never in a URL (which logs and proxies keep).
    assert [u for _, _, u in tab.sent if TOKEN in u] == []


@pytest.fixture(scope="module")
def pages_only(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The service's HTTP server without its lifespan (no Ray, no API behind the pages): the
    dashboard as a browser gets it, for what shows before anything is asked of the API."""
    import uvicorn

    from service.app import create_app

    app = create_app(make_settings(tmp_path_factory.mktemp("pages")))
    port = free_port()
    config = uvicorn.Config(app, port=port, lifespan="off", log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started or not thread.is_alive(), 30, 0.02, "the server to start")
    assert server.started
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(30)


@pytest.fixture
def pool(ray_cluster: ClusterPool) -> Iterator[ClusterPool]:
    ray_cluster.restore_pool()
    yield ray_cluster
    ray_cluster.restore_pool()


def shoot(page: Any, name: str) -> None:
    """The page at 1280x720 and at a phone's width (charts re-fit on resize)."""
    page.screenshot(path=ARTIFACTS / f"{name}-1280x720.png", full_page=True)
    page.set_viewport_size(PHONE)
    page.wait_for_timeout(300)
    page.screenshot(path=ARTIFACTS / f"{name}-390x844.png", full_page=True)
    page.set_viewport_size(DESKTOP)
    page.wait_for_timeout(200)


def sign_in(page: Any) -> None:
    if page.evaluate("sessionStorage.getItem('etrain.token')") is None:
        page.get_by_label("API token").fill(TOKEN)
        page.get_by_role("button", name="Sign in").click()
        page.get_by_role("heading", name="Jobs").wait_for()


def go(page: Any, route: str) -> None:
    page.evaluate(f"location.hash = {route!r}")


def job_state(api: httpx.Client, job_id: str) -> str:
    return str(api.get(f"/v1/jobs/{job_id}").json()["state"])


def chart_column(page: Any, chart: str, column: int) -> list[Any]:
    return list(page.evaluate(f"document.querySelector('#{chart}').chart.data[{column}]"))


def test_sign_in_submit_a_job_see_it_succeed_live_and_open_it(
    page: Any, api: httpx.Client, live: LiveServer
) -> None:
    from playwright.sync_api import expect

    expect(page.get_by_role("heading", name="Sign in")).to_be_visible()
    page.get_by_label("API token").fill("not-the-token")
    page.get_by_role("button", name="Sign in").click()
    expect(page.locator("#token-error")).to_have_text("That token is not valid.")
    shoot(page, "01-sign-in")
    sign_in(page)
    page.evaluate("window.notReloaded = true")

    page.get_by_role("link", name="Submit", exact=True).click()
    page.get_by_label("Name").fill("dash-demo")
    page.get_by_label("Max steps").fill("30")
    page.get_by_label("Global batch").fill("32")
    page.get_by_label("Min workers").fill("1")
    page.get_by_label("Max workers").fill("1")
    page.get_by_label("Checkpoint every (steps)").fill("10")
    shoot(page, "02-submit")
    page.get_by_role("button", name="Submit job").click()

    expect(page.get_by_role("status").filter(has_text="Submitted “dash-demo”")).to_be_visible()
    row = page.locator("#jobs-table tbody tr", has_text="dash-demo")
    expect(row).to_have_count(1)
    # From here on every request for the jobs list fails: the row's state can only come
    # from the /v1/events stream (the page re-reads the list every 2 s for steps and losses).
    jobs_list = f"{live.url}/v1/jobs"
    page.route(lambda url: url.split("?")[0] == jobs_list, lambda route: route.abort())
    routed_at = time.monotonic()
    expect(row).to_have_attribute("data-state", "succeeded", timeout=120_000)
    assert page.evaluate("window.notReloaded") is True  # no page reload
    # One stream (the jobs page's, opened when it was shown), open all along: not re-opened.
    events = f"{live.url}/v1/events"
    opened = [t for t, m, u in page.sent if m == "GET" and u.startswith(events)]
    assert opened and all(t < routed_at for t in opened), (opened, routed_at)
    page.unroute_all()
    go(page, "#/submit")  # and back: the list is read again, with the final step
    go(page, "#/jobs")
    expect(row.locator("[data-label=Step]")).to_have_text("30 / 30")
    (listed,) = [j for j in api.get("/v1/jobs").json()["items"] if j["name"] == "dash-demo"]
    assert "spec" not in listed  # a page of the list carries the table's columns only
    assert (listed["min_workers"], listed["max_workers"]) == (1, 1)
    job = api.get(f"/v1/jobs/{listed['id']}").json()
    assert job["name"] == "dash-demo" and job["state"] == "succeeded"
    assert job["spec"]["hyperparameters"]["max_steps"] == 30
    assert job["spec"]["hyperparameters"]["global_batch_size"] == 32
    assert job["spec"]["scaling"] == {
        "min_workers": 1,
        "max_workers": 1,
        "cpus_per_worker": 1.0,
        "gpus_per_worker": 0,
        "memory_per_worker_gb": None,
    }
    assert job["spec"]["checkpoint"] == {"every_steps": 10, "keep": 3}
    shoot(page, "03-jobs")

    row.get_by_role("link", name="dash-demo").click()
    expect(page.locator("#job-title .state")).to_have_text("succeeded")
    page.wait_for_function("() => document.querySelector('#chart-loss').dataset.points > 0")
    steps = chart_column(page, "chart-loss", 0)
    losses = chart_column(page, "chart-loss", 1)
    assert steps == list(range(1, 31))  # every step reported, drawn once each
    assert all(isinstance(v, float) and v > 0 for v in losses)
    assert int(page.locator("#chart-rate").get_attribute("data-points") or 0) == 30
    timeline = page.locator("#timeline li[data-kind=state] .what")
    expect(timeline.first).to_have_text("running → succeeded")
    expect(timeline).to_have_count(4)  # queued, starting, running, succeeded
    expect(page.locator("#timeline li[data-kind=checkpoint_saved]")).to_have_count(3)
    expect(page.locator("table.checkpoints tbody tr").first.locator("td").first).to_have_text("30")
    expect(page.get_by_role("button", name="Cancel job")).to_be_disabled()
    shoot(page, "04-job")


def test_the_sign_in_hint_shows_the_command_and_the_setting_as_code(
    browser: Any, pages_only: str
) -> None:
    """Text in the page is not markdown: a command in backticks showed its backticks."""
    from playwright.sync_api import expect

    context = browser.new_context(viewport=DESKTOP)
    tab = context.new_page()
    errors: list[str] = []
    tab.on("pageerror", lambda e: errors.append(str(e)))
    tab.goto(pages_only + "/")
    hint = tab.locator("#token-hint")
    expect(hint).to_have_text(
        "The token that etrain serve printed (or ETRAIN_API_TOKEN). It is kept in this "
        "browser tab only, until you sign out or close it."
    )
    expect(hint.locator("code")).to_have_text(["etrain serve", "ETRAIN_API_TOKEN"])
    context.close()
    assert errors == [], errors


def test_sign_out_forgets_the_token_and_ends_the_stream(page: Any, live: LiveServer) -> None:
    from playwright.sync_api import expect

    sign_in(page)
    assert page.evaluate("sessionStorage.getItem('etrain.token')") == TOKEN
    page.get_by_role("button", name="Sign out").click()
    expect(page.get_by_role("heading", name="Sign in")).to_be_visible()
    assert page.evaluate("sessionStorage.getItem('etrain.token')") is None
    assert page.evaluate("JSON.stringify(Object.keys(localStorage))") == "[]"
    # Nothing more goes to the API once signed out.
    signed_out_at = time.monotonic()
    page.wait_for_timeout(3000)
    late = [u for t, _, u in page.sent if t > signed_out_at and "/v1/" in u]
    assert late == [], late


def test_an_invalid_spec_shows_its_field_errors_and_creates_nothing(
    page: Any, api: httpx.Client
) -> None:
    from playwright.sync_api import expect

    sign_in(page)
    before = len(api.get("/v1/jobs").json()["items"])
    go(page, "#/submit")
    page.get_by_label("Name").fill("bad/name")
    page.get_by_label("Min workers").fill("3")
    page.get_by_label("Max workers").fill("2")
    page.get_by_role("button", name="Submit job").click()

    expect(page.locator("#f-scaling-min_workers-error")).to_have_text(
        "min_workers (3) must not exceed max_workers (2)"
    )
    expect(page.get_by_label("Min workers")).to_have_attribute("aria-invalid", "true")
    expect(page.locator("#f-name-error")).to_contain_text("String should match pattern")
    expect(page.get_by_label("Max workers")).not_to_have_attribute("aria-invalid", "true")
    expect(page.locator("#submit-errors")).to_contain_text("nothing was created")
    shoot(page, "05-submit-errors")

    page.get_by_role("tab", name="Raw JSON").click()
    page.get_by_label("Job spec (JSON)").fill(
        '{"name": "raw", "workload": "image-classification",'
        ' "hyperparameters": {"max_steps": 5, "learning_rate": -1}}'
    )
    page.get_by_role("button", name="Submit JSON").click()
    expect(page.locator("#submit-errors li")).to_have_text(
        ["hyperparameters.learning_rate: Input should be greater than 0"]
    )
    assert len(api.get("/v1/jobs").json()["items"]) == before


def test_a_node_dies_the_charts_show_it_and_the_user_cancels_from_the_job_page(
    page: Any, api: httpx.Client, pool: ClusterPool
) -> None:
    """One job (starting workers is the slow part here) for three things a user sees: which
    nodes hold its workers, the world-size drop with its markers, and cancelling it."""
    from playwright.sync_api import expect

    sign_in(page)
    spec = small_job(max_steps=1_000_000, report_every_steps=10)
    spec |= {
        "name": "elastic-demo",
        "scaling": {"min_workers": 1, "max_workers": 3, "cpus_per_worker": 1},
    }
    job = api.post("/v1/jobs", json=spec).json()
    go(page, "#/cluster")

    def at_three() -> bool:
        j = api.get(f"/v1/jobs/{job['id']}").json()
        return j["state"] == "running" and j["world_size"] == 3 and j["step"] >= 20

    # The whole pool: after a node dies there is no spare one to stay at full size with.
    wait_for(at_three, 180, what="training at 3 workers")
    cluster = api.get("/v1/cluster").json()
    (placed,) = [j for j in cluster["jobs"] if j["id"] == job["id"]]
    pool_nodes = {n["node_id"]: n for n in cluster["nodes"] if n["alive"] and not n["is_head"]}
    assert sorted(placed["workers"]) == ["0", "1", "2"]
    busy = set(placed["workers"].values())
    assert busy == set(pool_nodes)  # one worker on each pool node
    for node_id, node in pool_nodes.items():
        assert [(w["job_id"], w["rank"]) for w in node["workers"]] == [
            (job["id"], int(r)) for r, n in placed["workers"].items() if n == node_id
        ]
        assert node["total"] == {"CPU": 1.0, "GPU": 0.0}
        assert node["available"] == {"CPU": 0.0 if node_id in busy else 1.0, "GPU": 0.0}
    expect(page.locator(f"#placement-table tr[data-job-id='{job['id']}'] li")).to_have_count(
        3, timeout=10_000
    )
    expect(page.locator("#nodes-table tbody tr")).to_have_count(4)  # the head and 3 workers
    expect(page.locator("#nodes-table tbody tr .chips li")).to_have_count(3)
    shoot(page, "06-cluster")

    go(page, f"#/jobs/{job['id']}")
    page.wait_for_function("() => document.querySelector('#chart-world').dataset.points > 0")
    killed_at = time.time()
    (victim,) = [n for n in pool.pool if n.node_id == placed["workers"]["1"]]
    pool.kill_node(victim)

    def shrunk() -> bool:
        j = api.get(f"/v1/jobs/{job['id']}").json()
        assert j["state"] not in ("failed", "succeeded", "cancelled"), j
        return j["state"] == "running" and j["world_size"] == 2

    wait_for(shrunk, 120, what="training at 2 workers")
    world = page.locator("#chart-world")
    expect(world.locator(".marker[data-kind=worker_lost]")).to_have_count(1, timeout=15_000)
    expect(world.locator(".marker[data-kind=resized]")).to_have_count(1)
    # In place (the job's default): the survivors train on, nothing is restored.
    expect(world.locator(".marker[data-kind=restored]")).to_have_count(0)
    page.wait_for_function(
        "() => { const d = document.querySelector('#chart-world').chart.data;"
        " return d[1].length && d[1][d[1].length - 1] === 2; }",
        timeout=15_000,
    )
    times, sizes = chart_column(page, "chart-world", 0), chart_column(page, "chart-world", 1)
    before = [n for t, n in zip(times, sizes, strict=True) if t < killed_at]
    after = [n for t, n in zip(times, sizes, strict=True) if t > killed_at]
    # In place, the killed node's replica outlives its raylet by up to a 50 ms poll
    # (elastic/train/orphan.py) and may take part in a step at 3 after one at 2: the
    # chart shows what trained. It ends at 2.
    assert set(before) == {3} and after[-1] == 2 and after.count(2) >= 1
    lost = world.locator(".marker[data-kind=worker_lost]")
    lost.hover()
    expect(lost.locator(".tip")).to_be_visible()
    expect(lost.locator(".tip")).to_contain_text("lost 1 worker at 3 workers, training paused")
    expect(page.locator("#timeline li[data-kind=resized] .what")).to_contain_text(
        "resized 3 → 2 workers"
    )
    page.screenshot(path=ARTIFACTS / "07-job-after-node-loss-hover-1280x720.png", full_page=True)
    shoot(page, "08-job-after-node-loss")

    page.get_by_role("button", name="Cancel job").click()
    page.get_by_role("button", name="Yes, cancel it").click()
    expect(page.locator("#job-title .state")).to_have_text("cancelled", timeout=30_000)
    assert job_state(api, job["id"]) == "cancelled"
    expect(page.locator("#timeline li[data-kind=state] .what").first).to_have_text(
        "running → cancelled: cancelled by the user"
    )
    expect(page.get_by_role("button", name="Cancel job")).to_be_disabled()


def table_rows(page: Any, table: str) -> list[list[str]]:
    """Each body row's cells as the user reads them."""
    return list(
        page.evaluate(
            f"[...document.querySelectorAll('#{table} tbody tr')]"
            ".map((tr) => [...tr.children].map((c) => c.innerText.trim()))"
        )
    )


def priority_text(priority: int) -> str:
    names = {0: "low", 50: "normal", 100: "high"}
    return f"{names[priority]} ({priority})" if priority in names else str(priority)


def test_the_cluster_page_shows_the_queue_who_holds_what_and_the_quotas(
    page: Any, api: httpx.Client, pool: ClusterPool
) -> None:
    """A high-priority job on the whole pool and a job that must wait: the queue section's
    rows are what GET /v1/queue answers (position, job, owner, priority, reason), its holders
    rows the running jobs' sizes, and the quotas a user's limits and the default."""
    from playwright.sync_api import expect

    sign_in(page)
    create_user_token(api, "quota-user")
    assert api.put("/v1/users/quota-user/limits", json={"max_workers": 2}).status_code == 200
    spec = small_job(max_steps=1_000_000)
    big = api.post(
        "/v1/jobs",
        json={
            **spec,
            "name": "whole-pool",
            "priority": "high",
            "scaling": {"min_workers": 3, "max_workers": 3, "cpus_per_worker": 1},
        },
    ).json()
    wait_for(
        lambda: api.get(f"/v1/jobs/{big['id']}").json()["world_size"] == 3,
        180,
        what="the high-priority job on the whole pool",
    )
    waits = api.post(
        "/v1/jobs",
        json={**spec, "name": "must-wait", "scaling": {"min_workers": 1, "max_workers": 1}},
    ).json()
    go(page, "#/cluster")
    expect(page.get_by_role("heading", name="Queue")).to_be_visible()
    expect(page.locator("#nodes-table tbody tr")).to_have_count(4, timeout=30_000)

    def shown_as_answered() -> bool:
        q = api.get("/v1/queue").json()
        queue = [
            [
                str(e["position"]),
                e["name"],
                e["owner"],
                priority_text(e["priority"]),
                e["reason"] or "\u2013",  # the page's dash for none
            ]
            for e in q["queue"]
        ]
        holders = [
            [
                e["name"],
                e["owner"],
                priority_text(e["priority"]),
                f"{e['size']} / {e['min_workers']}..{e['max_workers']}",
                str(e["borrowed"]),
            ]
            for e in q["running"]
        ]
        return table_rows(page, "queue-table") == queue and (
            table_rows(page, "holders-table") == holders
        )

    wait_for(shown_as_answered, 30, what="the queue section showing GET /v1/queue's answer")
    # The waiting job's row, once the scheduler lists it: its link opens its page.
    for row in page.locator("#queue-table tbody tr").all():
        assert row.get_attribute("data-job-id") == waits["id"]
        expect(row.get_by_role("link", name="must-wait")).to_have_attribute(
            "href", f"#/jobs/{waits['id']}"
        )
    expect(page.locator("#queue-empty")).to_be_visible(
        visible=not page.locator("#queue-table tbody tr").count()
    )
    expect(page.locator("#queue-more")).to_be_hidden()  # one page holds the whole queue
    assert table_rows(page, "quotas-table") == [
        ["everyone else (default)", "no limit", "no limit"],
        ["quota-user", "2 workers", "no limit"],
    ]
    shoot(page, "09-cluster-queue")
    go(page, "#/jobs")
    row = page.locator(f"#jobs-table tbody tr[data-job-id='{big['id']}']")
    expect(row.locator("[data-label=Priority]")).to_have_text("high (100)")
    expect(
        page.locator(f"#jobs-table tbody tr[data-job-id='{waits['id']}'] [data-label=Priority]")
    ).to_have_text("normal (50)")
    for job in (big, waits):
        assert api.post(f"/v1/jobs/{job['id']}/cancel").status_code == 200


def seed_finished_run(live: LiveServer, points: int) -> str:
    """A finished job with ``points`` metrics, written straight into the store's tables
    (training that long would take minutes; the dashboard only reads the store)."""
    from datetime import UTC, datetime

    from sqlalchemy import insert

    from service.deps import services_of
    from service.store import JobRow, MetricRow, new_job_id

    job_id = new_job_id()
    start = time.time() - points / 100
    at = lambda t: datetime.fromtimestamp(t, UTC)  # noqa: E731
    with services_of(live.app).store.session() as s:
        s.add(
            JobRow(
                id=job_id,
                name="long-run",
                owner="admin",
                workload="image-classification",
                spec=small_job(max_steps=points),
                state="succeeded",
                message=None,
                world_size=0,
                step=points,
                total_steps=points,
                last_loss=0.1,
                samples_per_s=6400.0,
                restarts=0,
                last_seq=points,
                created_at=at(start),
                updated_at=at(start + points / 100),
                started_at=at(start),
                finished_at=at(start + points / 100),
            )
        )
        s.flush()
        s.execute(
            insert(MetricRow),
            [
                {
                    "job_id": job_id,
                    "seq": i,
                    "step": i,
                    "time": start + i / 100,
                    "loss": 2.3 / (1 + i / 5000),
                    "accuracy": min(1.0, i / points),
                    "samples_per_s": 6400.0,
                    "learning_rate": 0.05,
                    "world_size": 1,
                }
                for i in range(1, points + 1)
            ],
        )
    return job_id


def test_a_run_of_100_000_steps_charts_from_a_downsampled_series(
    page: Any, live: LiveServer
) -> None:
    from playwright.sync_api import expect

    sign_in(page)
    job_id = seed_finished_run(live, 100_000)
    asked: list[str] = []

    def note(request: Any) -> None:
        if "/metrics" in request.url:
            asked.append(request.url)

    page.on("request", note)
    started = time.monotonic()
    go(page, f"#/jobs/{job_id}")
    page.wait_for_function("() => document.querySelector('#chart-loss').dataset.points > 0")
    drawn_s = time.monotonic() - started
    page.remove_listener("request", note)
    steps = chart_column(page, "chart-loss", 0)
    assert steps[0] == 1 and steps[-1] == 100_000 and len(steps) <= 1501
    assert [u.split("/v1/", 1)[1] for u in asked] == [f"jobs/{job_id}/metrics?points=1500"]
    assert drawn_s < 5, drawn_s
    expect(page.locator("#job-title .state")).to_have_text("succeeded")
    page.locator("#chart-loss .u-over").hover()  # the cursor follows at once: few points
    x_value = page.locator("#chart-loss .u-legend .u-series").first.locator(".u-value")
    expect(x_value).not_to_have_text("--")
    shoot(page, "09-job-100k-steps")
