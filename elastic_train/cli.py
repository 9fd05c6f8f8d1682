"""``etrain``: submit and watch jobs from a terminal; ``etrain serve`` runs the service.

Exit status: 0 done (for ``submit --follow``: the job succeeded); 1 the job did not
succeed, the service refused, or it could not be reached; 2 a bad command line or job spec.
Expected errors are one line on stderr, never a traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click

from elastic.job_state import JobState
from elastic_train import config
from elastic_train.errors import (
    BadRequest,
    CodeArchiveError,
    ElasticTrainError,
    InvalidRequest,
    Unauthorized,
)
from elastic_train.jobfile import JobFileError

if TYPE_CHECKING:
    from rich.console import Console

    from elastic_train.client import Client

STATES = [s.value for s in JobState]
USAGE_ERROR = 2


def fail(message: str, code: int = 1) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


class EtrainGroup(click.Group):
    """Turns the errors a user can cause or meet into one line and an exit status."""

    def invoke(self, ctx: click.Context) -> Any:
        from pydantic import ValidationError

        try:
            return super().invoke(ctx)
        except ValidationError as e:
            from jobs.validation import describe

            fail(
                "; ".join(f"{x['field']}: {x['message']}" for x in describe(e.errors())),
                USAGE_ERROR,
            )
        except (JobFileError, CodeArchiveError) as e:
            fail(str(e), USAGE_ERROR)
        except Unauthorized as e:
            fail(f"{e.line()}; run `etrain login URL` or set ETRAIN_TOKEN")
        except (InvalidRequest, BadRequest) as e:
            fail(e.line(), USAGE_ERROR)
        except ElasticTrainError as e:
            fail(str(e))


def _client() -> Client:
    from elastic_train.client import Client

    return Client()


def _console() -> Console:
    from rich.console import Console

    # Piped into a file or another program, rows are never folded to 80 columns.
    return Console(highlight=False, width=None if sys.stdout.isatty() else 10_000)


def _cells(*values: str) -> list[str]:
    """Table cells shown as they are: a `[` in a path is text, not rich markup."""
    from rich.markup import escape

    return [escape(v) for v in values]


def _json(value: Any) -> None:
    from elastic_train.render import json_text

    click.echo(json_text(value))


@click.group(cls=EtrainGroup, context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """elastic-train: elastic PyTorch training on Ray.

    Commands other than serve talk to the service at ETRAIN_URL with ETRAIN_TOKEN, or to
    the one `etrain login` saved.
    """


@cli.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    add_help_option=False,
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def serve(args: tuple[str, ...]) -> None:
    """Run the API service (`etrain serve --help` for its options)."""
    sys.exit(_serve([*args]))


def _serve(args: list[str]) -> int:
    # The service registers its command under this entry point, so that the client's package
    # never imports the service's (FastAPI, Ray): every other command starts fast.
    from importlib.metadata import entry_points

    found = entry_points(group="etrain.server", name="serve")
    if not found:
        print("etrain serve: the service is not installed with this client", file=sys.stderr)
        return 2
    serve_main = next(iter(found)).load()
    return int(serve_main(["serve", *args]))


@cli.command()
@click.argument("url")
@click.option("--token", help="The API token (default: asked for, or read from stdin).")
def login(url: str, token: str | None) -> None:
    """Check a token against the service at URL and save both for later commands.

    They go to the user's config directory (readable by the user only);
    ETRAIN_URL and ETRAIN_TOKEN override them.
    """
    from elastic_train.client import Client

    url = config.normalize_url(url)
    if token is None:
        if sys.stdin.isatty():
            token = click.prompt("Token", hide_input=True)
        else:
            token = sys.stdin.readline()
    token = (token or "").strip()
    if not token:
        fail("no token given", USAGE_ERROR)
    with Client(url, token) as client:
        me = client.me()
    path = config.save(config.Credentials(url, token))
    click.echo(f"logged in to {url} as {me.user} ({me.role}); saved in {path}")


@cli.command()
@click.argument("job_file", type=click.Path(dir_okay=False, allow_dash=True))
@click.option("-f", "--follow", is_flag=True, help="Watch the job to its end.")
@click.option("--name", help="The job's name (overrides the file's).")
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="PATH=VALUE",
    help="Set a field, e.g. hyperparameters.learning_rate=0.01 (VALUE is read as YAML).",
)
@click.option(
    "--code",
    "code_dir",
    type=click.Path(exists=True, file_okay=False),
    help="A directory of training code to upload and run the job on.",
)
def submit(
    job_file: str,
    follow: bool,
    name: str | None,
    overrides: tuple[str, ...],
    code_dir: str | None,
) -> None:
    """Submit the job in JOB_FILE (YAML or JSON; - for stdin) and print its id.

    With --code, the directory is packed (leaving out .git, virtual environments, caches
    and what .gitignore and .etrainignore exclude) and uploaded first.

    With --follow, show its progress until it ends: exit status 0 when it succeeds,
    1 otherwise.
    """
    from elastic_train import jobfile

    spec = jobfile.apply_overrides(jobfile.load(job_file), list(overrides))
    if name is not None:
        spec["name"] = name
    code = None
    if code_dir is not None:
        from elastic_train import code_upload, protocol

        protocol.spec_body(spec)  # an invalid spec fails before the directory is packed
        code = code_upload.packed_within(code_dir)
        click.echo(f"code: {code_upload.summary(code)}")
    with _client() as client:
        job = client.submit(spec, code=code)
        click.echo(job.id)
        if follow:
            sys.exit(_follow(client, job.id))


@cli.command("run-local")
@click.argument("job_file", type=click.Path(dir_okay=False, allow_dash=True))
@click.option(
    "--code",
    "code_dir",
    type=click.Path(exists=True, file_okay=False),
    default=".",
    show_default=True,
    help="The directory the job's code is in (its command runs there).",
)
@click.option("--workers", type=click.IntRange(1, 64), default=2, show_default=True)
@click.option("--set", "overrides", multiple=True, metavar="PATH=VALUE", help="Set a field.")
def run_local(job_file: str, code_dir: str, workers: int, overrides: tuple[str, ...]) -> None:
    """Run the job in JOB_FILE (a command, or a loop of the package) on this machine, with no
    service and no Ray: WORKERS processes with torchrun's environment, as the cluster's
    workers run it. Exit status: the first failed process's, or 0."""
    from elastic_train import jobfile, protocol
    from elastic_train.run_local import RunLocalError, own_program
    from elastic_train.run_local import run_local as run

    spec = jobfile.apply_overrides(jobfile.load(job_file), list(overrides))
    try:
        own_program(spec)
        # The service would refuse an invalid spec: so does this. The code is this
        # directory, not an upload yet: any id stands for it.
        protocol.spec_body({**spec, "code": spec.get("code") or "0" * 64})
        sys.exit(run(spec, code_dir, workers, out=click.echo))
    except RunLocalError as e:
        fail(str(e), 2)


def _follow(client: Client, job_id: str) -> int:
    from elastic_train.progress import FOLLOWED_KINDS, FollowView

    job = client.job(job_id)
    console = _console()
    try:
        with FollowView(console, job.info) as view:
            for event in job.events(follow=True, kinds=FOLLOWED_KINDS):
                view.show(event)
    except KeyboardInterrupt:
        click.echo(
            f"stopped watching; {job_id} carries on (`etrain cancel {job_id}` ends it)", err=True
        )
        return 130
    job.refresh()
    ending = f"{job.id} {job.state.value}"
    if job.info.message and job.state != JobState.SUCCEEDED:
        ending += f": {job.info.message}"
    console.print(ending, highlight=False, markup=False, soft_wrap=True)
    return 0 if job.state == JobState.SUCCEEDED else 1


@cli.command("jobs")
@click.option("--state", type=click.Choice(STATES), help="Only jobs in this state.")
@click.option("--limit", type=click.IntRange(1), default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def list_jobs(state: str | None, limit: int, as_json: bool) -> None:
    """List jobs, newest first."""
    from elastic_train.render import age, number, steps

    with _client() as client:
        found = client.jobs(state=state, limit=limit)
    if as_json:
        _json([j.info.model_dump(mode="json") for j in found])
        return
    from rich.table import Table

    table = Table(box=None, pad_edge=False)
    for column in ("ID", "NAME", "STATE", "STEP", "LOSS", "WORKERS", "AGE"):
        table.add_column(column, no_wrap=column in ("ID", "STATE"))
    for j in found:
        info = j.info
        table.add_row(
            *_cells(
                info.id,
                info.name,
                info.state.value,
                steps(info.step, info.total_steps),
                number(info.last_loss),
                str(info.world_size),
                age(info.created_at),
            )
        )
    _console().print(table)


@cli.command()
@click.argument("job_id")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def status(job_id: str, as_json: bool) -> None:
    """Show a job: state, step, loss, samples/s, workers."""
    from elastic_train.render import job_fields

    with _client() as client:
        info = client.job(job_id).info
    if as_json:
        _json(info.model_dump(mode="json"))
        return
    fields = job_fields(info)
    width = max(len(label) for label, _ in fields)
    for label, value in fields:
        click.echo(f"{label:<{width}}  {value}")


@cli.command()
@click.argument("job_id")
@click.option("-f", "--follow", is_flag=True, help="Keep printing until the job ends.")
@click.option("--rank", type=click.IntRange(0), help="Only this worker's lines.")
def logs(job_id: str, follow: bool, rank: int | None) -> None:
    """Print the workers' output, each line tagged with its rank."""
    with _client() as client:
        for line in client.job(job_id).logs(follow=follow, rank=rank):
            click.echo(f"[rank {line.rank}] {line.line}")


@cli.command()
@click.argument("job_id")
@click.option("-f", "--follow", is_flag=True, help="Keep printing until the job ends.")
@click.option("--kind", "kinds", multiple=True, help="Only events of this kind (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
def events(job_id: str, follow: bool, kinds: tuple[str, ...], as_json: bool) -> None:
    """Print the job's event log: states, metrics, checkpoints, resizes, recoveries."""
    import json

    from elastic_train.render import event_line

    show: Callable[[Any], str] = (
        (lambda e: json.dumps(e.model_dump(mode="json"))) if as_json else event_line
    )
    with _client() as client:
        for event in client.job(job_id).events(follow=follow, kinds=kinds or None):
            click.echo(show(event))


@cli.command()
@click.argument("job_id")
def cancel(job_id: str) -> None:
    """Cancel a job; its workers end within seconds."""
    with _client() as client:
        job = client.job(job_id).cancel()
    click.echo(f"{job.id} {job.state.value}")


class ListByDefault(click.Group):
    """``etrain checkpoints JOB_ID`` lists (as it did before it had subcommands);
    ``etrain checkpoints download JOB_ID`` downloads."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if not args or (args[0] not in self.commands and args[0] not in ctx.help_option_names):
            args = ["list", *args]
        return super().parse_args(ctx, args)


@cli.group(cls=ListByDefault)
def checkpoints() -> None:
    """A job's checkpoints: list them (`etrain checkpoints JOB_ID`), or download one."""


@checkpoints.command("list")
@click.argument("job_id")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def list_checkpoints(job_id: str, as_json: bool) -> None:
    """List a job's retained checkpoints, oldest first."""
    from elastic_train.render import clock, size

    with _client() as client:
        found = client.job(job_id).checkpoints()
    if as_json:
        _json([c.model_dump(mode="json") for c in found])
        return
    from rich.table import Table

    table = Table(box=None, pad_edge=False)
    for column in ("STEP", "SIZE", "SAVED", "PATH"):
        table.add_column(column, no_wrap=column != "PATH", overflow="fold")
    for c in found:
        table.add_row(*_cells(str(c.step), size(c.size_bytes), clock(c.created_at), c.path))
    _console().print(table)


@checkpoints.command()
@click.argument("job_id")
@click.option("--step", type=click.IntRange(min=0), help="The checkpoint's step (default: newest).")
@click.option(
    "-o",
    "--output",
    "into",
    type=click.Path(file_okay=False),
    default=".",
    show_default=True,
    help="Where to put the <job id>-step-<step> directory.",
)
def download(job_id: str, step: int | None, into: str) -> None:
    """Download a checkpoint (its manifest.json and parts, each checked against the
    manifest's SHA-256) and print the directory it is in."""
    with _client() as client:
        where = client.job(job_id).download_checkpoint(step, into)
    click.echo(str(where))


@cli.group()
def files() -> None:
    """What a job's code wrote in its own directory (ETRAIN_CHECKPOINT_DIR)."""


@files.command("download")
@click.argument("job_id")
@click.option(
    "-o",
    "--output",
    "into",
    type=click.Path(file_okay=False),
    default=".",
    show_default=True,
    help="Where to put the <job id> directory.",
)
def download_files(job_id: str, into: str) -> None:
    """Download the files a job wrote in its own directory and print the directory they
    are in. Links that leave it are left out."""
    with _client() as client:
        where = client.job(job_id).download_files(into)
    click.echo(str(where))


def main(argv: list[str] | None = None) -> int:
    """The console script. ``serve`` goes to the service's own CLI untouched."""
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["serve"]:
        return _serve(args[1:])
    try:
        cli.main(args=args, prog_name="etrain")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
