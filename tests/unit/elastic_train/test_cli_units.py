"""The client's and the CLI's pure parts: job files and --set, problem documents, where the
credentials come from, how a stream resumes, and that `etrain` stays light."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import tomllib
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from httpx_sse import ServerSentEvent

from elastic_train import config, errors, jobfile, models, protocol, render
from elastic_train.cli import cli
from elastic_train.cli import main as etrain_main

ROOT = Path(__file__).resolve().parents[3]


# -- job files and --set -------------------------------------------------------------


def test_the_example_job_file_is_the_readme_job() -> None:
    from tests.conftest import small_job

    assert jobfile.load(str(ROOT / "examples" / "job.yaml")) == small_job()


def test_the_readme_posts_with_curl_the_json_file_it_shows_which_is_shipped() -> None:
    from tests.conftest import small_job

    readme = (ROOT / "README.md").read_text()
    assert re.findall(r" -d @(\S+)", readme) == ["examples/job.json"]
    shipped = (ROOT / "examples" / "job.json").read_text()
    start = readme.index('{"name": "demo"')
    assert readme[start : readme.index("```", start)] == shipped
    assert jobfile.load(str(ROOT / "examples" / "job.json")) == small_job()


def test_job_files_are_yaml_or_json(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text('{"name": "x", "workload": "w"}')
    (tmp_path / "b.yml").write_text("name: x\nworkload: w\n")
    assert jobfile.load(str(tmp_path / "a.json")) == jobfile.load(str(tmp_path / "b.yml"))

    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(jobfile.JobFileError, match=r"list.yaml: a job spec is a mapping"):
        jobfile.load(str(tmp_path / "list.yaml"))
    (tmp_path / "bad.json").write_text("{name: ")
    with pytest.raises(jobfile.JobFileError, match=r"bad.json: not valid JSON"):
        jobfile.load(str(tmp_path / "bad.json"))
    with pytest.raises(jobfile.JobFileError, match=r"missing.yaml: No such file"):
        jobfile.load(str(tmp_path / "missing.yaml"))


def test_a_yaml_error_says_where_it_is(tmp_path: Path) -> None:
    """PyYAML's first line ("while scanning a simple key") names neither the problem nor its
    place: the message carries both, lines and columns counted from 1 as editors do."""
    (tmp_path / "job.yaml").write_text(
        "name: demo\nworkload: image-classification\nscaling\n  min_workers: 1\n"
    )
    with pytest.raises(jobfile.JobFileError) as e:
        jobfile.load(str(tmp_path / "job.yaml"))
    assert str(e.value) == (
        f"{tmp_path / 'job.yaml'}: not valid YAML: line 4, column 14: could not find "
        "expected ':' (while scanning a simple key at line 3, column 1)"
    )
    (tmp_path / "unclosed.yaml").write_text("name: demo\nscaling: {min_workers: 1\n")
    with pytest.raises(jobfile.JobFileError) as e:
        jobfile.load(str(tmp_path / "unclosed.yaml"))
    assert str(e.value) == (
        f"{tmp_path / 'unclosed.yaml'}: not valid YAML: line 3, column 1: expected ',' or '}}', "
        "but got '<stream end>' (while parsing a flow mapping at line 2, column 10)"
    )


@pytest.mark.parametrize(
    ("text", "keys", "value"),
    [
        ("hyperparameters.learning_rate=0.01", ["hyperparameters", "learning_rate"], 0.01),
        ("scaling.max_workers=4", ["scaling", "max_workers"], 4),
        ("hyperparameters.augment=none", ["hyperparameters", "augment"], "none"),
        ("hyperparameters.flag=true", ["hyperparameters", "flag"], True),
        ("name='2'", ["name"], "2"),
        ("hyperparameters.sizes=[1, 2]", ["hyperparameters", "sizes"], [1, 2]),
        ("name=a=b", ["name"], "a=b"),
        ("name=", ["name"], ""),
    ],
)
def test_set_values_are_read_as_yaml(text: str, keys: list[str], value: Any) -> None:
    assert jobfile.parse_override(text) == (keys, value)


def test_set_creates_mappings_and_leaves_the_file_alone() -> None:
    spec = {"name": "a", "scaling": {"min_workers": 1}}
    out = jobfile.apply_overrides(
        spec, ["scaling.max_workers=3", "distributed.strategy=fsdp", "name=b"]
    )
    assert out == {
        "name": "b",
        "scaling": {"min_workers": 1, "max_workers": 3},
        "distributed": {"strategy": "fsdp"},
    }
    assert spec == {"name": "a", "scaling": {"min_workers": 1}}


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("learning_rate", r"'learning_rate': expected a dotted path, '=' and a value"),
        ("hyperparameters..lr=1", r"expected a dotted path"),
        ("=1", r"expected a dotted path"),
        ("name.first=x", r"^name: is 'a', not a mapping; cannot set name.first$"),
        (
            "name=[1",
            r"^name: the value '\[1' is not valid YAML: line 1, column 3: expected ',' or "
            r"'\]', but got '<stream end>' \(while parsing a flow sequence at line 1, column 1\)$",
        ),
    ],
)
def test_a_bad_set_names_what_is_wrong(override: str, message: str) -> None:
    with pytest.raises(jobfile.JobFileError, match=message):
        jobfile.apply_overrides({"name": "a"}, [override])


# -- problem documents -----------------------------------------------------------------


def test_a_refused_spec_reads_as_one_line_naming_each_field() -> None:
    body = {
        "type": "about:blank",
        "title": "Invalid job spec",
        "status": 422,
        "detail": "hyperparameters.learning_rate: Input should be greater than 0",
        "errors": [
            {"field": "hyperparameters.learning_rate", "message": "Input should be greater than 0"},
            {"field": "scaling.min_workers", "message": "too many"},
        ],
    }
    e = errors.from_problem(422, json.dumps(body).encode())
    assert isinstance(e, errors.InvalidRequest)
    assert str(e) == (
        "hyperparameters.learning_rate: Input should be greater than 0; "
        "scaling.min_workers: too many (422 Invalid job spec)"
    )
    assert e.errors[0] == errors.FieldError(
        "hyperparameters.learning_rate", "Input should be greater than 0"
    )


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, errors.BadRequest),
        (401, errors.Unauthorized),
        (403, errors.Forbidden),
        (404, errors.NotFound),
        (409, errors.Conflict),
        (413, errors.PayloadTooLarge),
        (429, errors.RateLimited),
        (500, errors.ServerError),
        (503, errors.ServerError),
        (418, errors.ApiError),
    ],
)
def test_each_status_has_its_error(status: int, kind: type[errors.ApiError]) -> None:
    body = json.dumps({"title": "T", "status": status, "detail": "what happened"}).encode()
    e = errors.from_problem(status, body, {"retry-after": "2"})
    assert type(e) is kind
    assert str(e) == f"what happened ({status} T)"
    assert e.retry_after == 2.0


def test_an_answer_that_is_no_problem_document_still_reads_well() -> None:
    e = errors.from_problem(502, b"<html>\n<body>Bad Gateway</body></html>")
    assert isinstance(e, errors.ServerError)
    assert str(e) == "<html> (502 Bad Gateway)"
    assert str(errors.from_problem(404, b"")) == "Not Found (404 Not Found)"


# -- credentials -----------------------------------------------------------------------


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(config.URL_ENV, raising=False)
    monkeypatch.delenv(config.TOKEN_ENV, raising=False)
    return tmp_path / "xdg" / "etrain"


def test_login_saves_for_the_user_only(home: Path) -> None:
    path = config.save(config.Credentials("http://h:1", "secret"))
    assert path == home / "config.json" == config.config_path()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    assert json.loads(path.read_text()) == {"url": "http://h:1", "token": "secret"}
    path.chmod(0o644)  # saving again tightens a file someone loosened
    config.save(config.Credentials("http://h:1", "other"))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in home.iterdir()] == ["config.json"]


def test_where_url_and_token_come_from(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert config.resolve() == config.Credentials(config.DEFAULT_URL, None)
    config.save(config.Credentials("http://saved:8000", "saved-token"))
    assert config.resolve() == config.Credentials("http://saved:8000", "saved-token")
    monkeypatch.setenv(config.TOKEN_ENV, "env-token")
    assert config.resolve() == config.Credentials("http://saved:8000", "env-token")
    assert config.resolve(token="arg") == config.Credentials("http://saved:8000", "arg")
    monkeypatch.delenv(config.TOKEN_ENV)
    # The saved token goes to the saved URL only, never to another server.
    monkeypatch.setenv(config.URL_ENV, "other:9000")
    assert config.resolve() == config.Credentials("http://other:9000", None)
    monkeypatch.setenv(config.URL_ENV, "http://saved:8000/")
    assert config.resolve() == config.Credentials("http://saved:8000", "saved-token")
    assert config.resolve(url="x:1") == config.Credentials("http://x:1", None)


def test_an_unreadable_config_says_what_to_do(home: Path) -> None:
    home.mkdir(parents=True)
    (home / "config.json").write_text("{not json")
    with pytest.raises(errors.ConfigError, match=r"config.json: unreadable .*etrain login"):
        config.resolve()
    # Logging in again works whatever the old file held.
    assert config.resolve("h:1", "t") == config.Credentials("http://h:1", "t")


def test_the_client_variables_are_no_service_setting() -> None:
    from service.settings import Settings

    for variable in (config.URL_ENV, config.TOKEN_ENV):
        assert variable.startswith("ETRAIN_")
        assert variable.removeprefix("ETRAIN_").lower() not in Settings.model_fields


# -- resuming streams --------------------------------------------------------------------


def sse(seq: int, kind: str, **data: Any) -> ServerSentEvent:
    body = {"seq": seq, "kind": kind, "time": "2026-11-23T10:00:01.5Z", "data": data}
    return ServerSentEvent(event=kind, data=json.dumps(body), id=str(seq))


def test_a_cursor_hands_on_new_events_once_and_remembers_the_last_id() -> None:
    cursor = protocol.StreamCursor()
    assert cursor.headers() == {} and cursor.params() == {}
    first = cursor.take(sse(1, "state", state="queued"))
    assert isinstance(first, models.Event) and first.seq == 1
    # a keep-alive comment: httpx-sse reports a data-less message with the kept id
    assert cursor.take(ServerSentEvent(id="1")) is None
    assert cursor.take(sse(1, "state", state="queued")) is None
    assert cursor.take(ServerSentEvent(event="reconnect", data='{"last_event_id": 1}')) is (
        protocol.RECONNECT
    )
    assert cursor.headers() == {"Last-Event-ID": "1"}
    assert not cursor.finished
    assert isinstance(cursor.take(sse(2, "state", state="cancelled")), models.Event)
    assert cursor.finished


def test_a_filtered_cursor_asks_for_the_state_too_and_stops_at_the_end() -> None:
    cursor = protocol.StreamCursor(after=3, kinds=("log",))
    assert cursor.params() == {"kind": ["log", "state"]}
    assert cursor.headers() == {"Last-Event-ID": "3"}
    assert cursor.take(sse(4, "state", state="running")) is None
    assert cursor.last_id == 4
    line = ["2026-11-23T10:00:01Z", "stdout", "hi"]
    log = cursor.take(sse(5, "log", rank=0, attempt=1, lines=[line]))
    assert isinstance(log, models.Event)
    at = datetime(2026, 11, 23, 10, 0, 1, tzinfo=UTC)
    assert log.time == datetime(2026, 11, 23, 10, 0, 1, 500000, tzinfo=UTC)
    assert models.log_lines(log) == [
        models.LogLine(seq=5, rank=0, attempt=1, time=at, stream="stdout", line="hi")
    ]
    assert cursor.take(sse(6, "state", state="succeeded")) is None
    assert cursor.finished and cursor.last_id == 6


def test_reconnects_back_off_and_give_up_when_the_service_stays_away() -> None:
    now = [0.0]
    retry = protocol.Retrier("http://h:1", give_up_after=10, clock=lambda: now[0])
    delays = []
    for _ in range(7):
        delays.append(retry.failed("refused"))
        now[0] += 1
    assert delays == [0.25, 0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    retry.connected()
    now[0] += 100
    assert retry.failed("refused") == 0.25  # a fresh outage starts over
    now[0] += 10
    with pytest.raises(errors.ConnectionFailed) as e:
        retry.failed("connection refused")
    assert str(e.value) == "could not reach http://h:1: connection refused"


def test_a_spec_is_checked_before_it_is_sent() -> None:
    from pydantic import ValidationError

    from jobs.spec import JobSpec
    from tests.conftest import small_job

    assert protocol.spec_body(small_job()) == small_job()  # sent as written
    spec = JobSpec.model_validate(small_job())
    assert protocol.spec_body(spec)["hyperparameters"]["momentum"] == 0.9
    bad = small_job(learning_rate=-1)
    with pytest.raises(ValidationError) as e:
        protocol.spec_body(bad)
    assert e.value.errors()[0]["loc"] == ("hyperparameters", "learning_rate")
    # A job file's priority, as written or set with --set (read as YAML: 7 is a number).
    for override, value in (("priority=low", "low"), ("priority=7", 7)):
        body = protocol.spec_body(jobfile.apply_overrides(small_job(), [override]))
        assert body["priority"] == value
    with pytest.raises(ValidationError) as e:
        protocol.spec_body(jobfile.apply_overrides(small_job(), ["priority=urgent"]))
    assert e.value.errors()[0]["loc"] == ("priority",)


def test_the_client_reads_what_the_service_sends() -> None:
    from service import schemas

    pairs = [
        (models.JobInfo, schemas.JobOut),
        (models.Event, schemas.EventOut),
        (models.Checkpoint, schemas.CheckpointOut),
        (models.LogLine, schemas.LogLine),
        (models.MetricSeries, schemas.MetricSeries),
        (models.Me, schemas.Me),
        (models.Limits, schemas.Limits),
    ]
    for ours, theirs in pairs:
        assert list(ours.model_fields) == list(theirs.model_fields), ours.__name__


# -- words -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "data", "text"),
    [
        ("state", {"state": "running", "world_size": 2}, "state running on 2 workers"),
        ("state", {"state": "failed", "reason": "boom"}, "state failed: boom"),
        (
            "attempt_started",
            {"attempt": 2, "world_size": 1, "checkpoint_step": 20},
            "attempt 2 started on 1 worker from the checkpoint of step 20",
        ),
        (
            "metrics",
            {"step": 5, "total_steps": 50, "loss": 1.23456, "samples_per_s": 99.6, "world_size": 2},
            "metrics step 5/50, loss 1.235, 100 samples/s, 2 workers",
        ),
        (
            "worker_lost",
            {"ranks": [1], "from_world": 3, "reason": "node died"},
            "worker lost: rank 1 of 3 workers (node died)",
        ),
        (
            "worker_lost",
            {"replicas": [0, 2], "from_world": 3, "to_world": 1, "pause_seconds": 0.7712},
            "worker lost: replica 0, 2 of 3 workers, training paused 0.77 s",
        ),
        (
            "resized",
            {"from_world": 3, "to_world": 2, "steps_redone": 4, "recovery_seconds": 15.24},
            "resized from 3 to 2 workers (4 steps redone, recovered in 15.2 s)",
        ),
        (
            "restored",
            {"checkpoint_step": 20, "steps_redone": 1},
            "restored the checkpoint of step 20 (1 step redone)",
        ),
        (
            "checkpoint_saved",
            {"step": 10, "size_bytes": 60928},
            "checkpoint of step 10 saved (59.5 KiB)",
        ),
        ("something_new", {"b": 1, "a": 2}, 'something_new {"a": 2, "b": 1}'),
    ],
)
def test_events_in_words(kind: str, data: dict[str, Any], text: str) -> None:
    assert render.describe(models.Event(seq=1, kind=kind, time=0.0, data=data)) == text


# -- the command line ------------------------------------------------------------------------


def test_a_code_directory_with_a_link_out_is_refused_before_anything_is_sent(
    home: Path, tmp_path: Path
) -> None:
    code = tmp_path / "project"
    code.mkdir()
    (code / "train.py").write_text("print('hi')\n")
    (code / "data").symlink_to("/etc")
    result = CliRunner().invoke(
        cli,
        ["submit", str(ROOT / "examples" / "job.yaml"), "--code", str(code)],
        env={config.URL_ENV: "http://127.0.0.1:9"},  # nothing is sent
    )
    assert (result.exit_code, result.output) == (
        2,
        "error: data: a link to /etc, outside the directory\n",
    )


def test_a_bad_set_value_is_one_line_naming_the_field_and_status_2(home: Path) -> None:
    result = CliRunner().invoke(
        cli,
        [
            "submit",
            str(ROOT / "examples" / "job.yaml"),
            "--set",
            "hyperparameters.learning_rate=fast",
        ],
        env={config.URL_ENV: "http://127.0.0.1:9"},  # nothing is sent
    )
    assert result.exit_code == 2
    assert result.output == (
        "error: hyperparameters.learning_rate: Input should be a valid number, "
        "unable to parse string as a number\n"
    )


def test_serve_goes_to_the_service_cli_untouched(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        etrain_main(["serve", "--help"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith(
        "usage: etrain serve [-h] [--host HOST] [--port PORT]"
    )
    with pytest.raises(SystemExit) as e:
        etrain_main(["serve", "--port", "not-a-number"])
    assert e.value.code == 2
    assert "argument --port: invalid int value" in capsys.readouterr().err


def test_the_console_script_is_this_cli() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"etrain": "elastic_train.cli:main"}


def test_a_command_loads_no_service_ray_or_torch(tmp_path: Path) -> None:
    """`etrain jobs` starts fast: it imports neither the service (FastAPI) nor Ray nor torch."""
    probe = (
        "import sys\n"
        "from elastic_train.cli import main\n"
        "code = main(['jobs'])\n"
        "heavy = sorted(m for m in ('fastapi', 'ray', 'torch', 'service', 'uvicorn') "
        "if m in sys.modules)\n"
        "print(code, heavy)\n"
    )
    env = {
        **os.environ,
        config.URL_ENV: "http://127.0.0.1:9",
        config.TOKEN_ENV: "t",
        "XDG_CONFIG_HOME": str(tmp_path),
    }
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.stdout == "1 []\n", done.stderr
    assert done.stderr == "error: could not reach http://127.0.0.1:9: connection refused\n"


def new_job() -> models.JobInfo:
    """A job as `etrain submit --follow` finds it: just submitted, queued, no step yet."""
    now = datetime.now(UTC)
    return models.JobInfo.model_validate(
        {
            **dict.fromkeys(["message", "total_steps", "last_loss", "samples_per_s"]),
            **dict.fromkeys(["started_at", "finished_at"]),
            "id": "job-1",
            "name": "n",
            "owner": "o",
            "workload": "w",
            "state": "queued",
            "world_size": 0,
            "step": 0,
            "restarts": 0,
            "spec": {},
            "created_at": now,
            "updated_at": now,
        }
    )


def test_off_a_terminal_follow_prints_the_news_verbatim_and_a_tenth_of_the_metrics() -> None:
    import io

    from rich.console import Console

    from elastic_train.progress import FollowView

    out = io.StringIO()
    with FollowView(Console(file=out, width=40), new_job()) as view:
        assert not view.live
        view.show(models.Event(seq=1, kind="state", time=0.0, data={"state": "running"}))
        for step in range(1, 51):
            data = {"step": step, "total_steps": 50, "loss": 1.0, "world_size": 2}
            view.show(models.Event(seq=1 + step, kind="metrics", time=0.0, data=data))
        reason = "ValueError('[bold]x[/] [rank 1]') " + "y" * 40
        view.show(
            models.Event(seq=52, kind="state", time=0.0, data={"state": "failed", "reason": reason})
        )
    lines = [line.split("  ", 1)[1] for line in out.getvalue().splitlines()]
    assert lines[0] == "state running"
    assert [int(line.split()[2].split("/")[0]) for line in lines[1:-1]] == [
        1,
        5,
        10,
        15,
        20,
        25,
        30,
        35,
        40,
        45,
        50,
    ]
    assert lines[-1] == f"state failed: {reason}"  # no markup, not wrapped at 40 columns


def test_before_its_first_step_the_bar_says_what_the_job_waits_for() -> None:
    """Not `step 0/?`: a queued or starting job has no step, total, loss or speed yet."""
    import io

    from rich.console import Console

    from elastic_train.progress import FollowView

    def bar(view: FollowView) -> str:
        """The bar as the terminal shows it now, without its bar graphic."""
        assert view.progress is not None
        shown = io.StringIO()
        Console(file=shown, width=120, color_system=None).print(view.progress.get_renderable())
        state, _, rest = shown.getvalue().rstrip().partition(" ")
        return f"{state} | {rest.lstrip().lstrip('━╸╺ ')}"

    def event(seq: int, kind: str, **data: Any) -> models.Event:
        return models.Event(seq=seq, kind=kind, time=0.0, data=data)

    terminal = Console(file=io.StringIO(), force_terminal=True, width=120)
    with FollowView(terminal, new_job()) as view:
        assert view.live
        frames = [bar(view)]
        view.show(event(2, "state", state="starting", world_size=2))
        frames.append(bar(view))
        view.show(event(3, "state", state="running", world_size=2))
        metrics = {"total_steps": 50, "loss": 2.5, "samples_per_s": 900.0, "world_size": 2}
        view.show(event(4, "metrics", step=1, **metrics))
        frames.append(bar(view))
        view.show(event(5, "state", state="recovering", reason="rank 1: OSError"))
        frames.append(bar(view))
    assert frames == [
        "queued | waiting in the queue",
        "starting | waiting for the first step on 2 workers",
        "running | step 1/50 loss 2.5 900 samples/s 2 workers ETA -:--:--",
        "recovering | step 1/50 loss 2.5 900 samples/s 2 workers ETA -:--:--",
    ]
