"""What the job control refuses, as plain errors: `service.problems` says how each one
reads over HTTP, so the control knows nothing of status codes."""

from __future__ import annotations


class JobNotFound(LookupError):
    def __init__(self, job_id: str) -> None:
        super().__init__(f"no job {job_id!r}")
        self.job_id = job_id


class JobAlreadyEnded(RuntimeError):
    def __init__(self, state: str) -> None:
        super().__init__(f"the job is {state}")
        self.state = state


class IdempotencyKeyReused(ValueError):
    """The Idempotency-Key was used before with another request body."""


class SubmissionInProgress(RuntimeError):
    """A submission with this Idempotency-Key is still being processed."""


class SpecRefused(ValueError):
    """A job spec this service can never run, naming the field at fault. ``detail`` is the
    longer account when the field's own message is terse; ``limit`` names the setting or
    resource that refused it."""

    def __init__(
        self,
        field: str,
        message: str,
        *,
        title: str = "Invalid job spec",
        detail: str | None = None,
        limit: str | None = None,
    ) -> None:
        self.field, self.message, self.title, self.limit = field, message, title, limit
        self.detail = detail or message
        super().__init__(f"{field}: {self.detail}")
