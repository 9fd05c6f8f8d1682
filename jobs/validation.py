"""Validation errors that name the field they are about, wherever they are raised."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError


def field_error(title: str, field: str, message: str, value: Any = None) -> ValidationError:
    """A pydantic ValidationError for ``field`` (dotted path), raisable from any validator."""
    return ValidationError.from_exception_data(
        title,
        [
            InitErrorDetails(
                type=PydanticCustomError("invalid_value", message),
                loc=tuple(field.split(".")),
                input=value,
            )
        ],
    )


def prefixed(title: str, prefix: str, error: ValidationError) -> ValidationError:
    """Re-root the errors of a nested model's validation under ``prefix``."""
    details: list[InitErrorDetails] = []
    for err in error.errors():
        detail = InitErrorDetails(
            type=PydanticCustomError(err["type"], err["msg"]),
            loc=(prefix, *err["loc"]),
            input=err.get("input"),
        )
        details.append(detail)
    return ValidationError.from_exception_data(title, details)


def describe(errors: Iterable[Mapping[str, Any]]) -> list[dict[str, str]]:
    """``[{"field": "scaling.min_workers", "message": "..."}]`` from pydantic's errors."""
    out = []
    for err in errors:
        if err.get("type") == "json_invalid":
            # FastAPI puts the character offset where a field would go: it names no field.
            offset = err.get("loc", ("body", "?"))[-1]
            reason = (err.get("ctx") or {}).get("error", "")
            message = f"not valid JSON (at character {offset}{': ' + reason if reason else ''})"
            out.append({"field": "(body)", "message": message})
            continue
        loc = [str(p) for p in err.get("loc", ()) if p not in ("body",)]
        out.append({"field": ".".join(loc) or "(body)", "message": err["msg"]})
    return out
