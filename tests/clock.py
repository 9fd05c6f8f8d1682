"""A clock the test moves by hand, for the code that takes a ``clock`` callable."""

from __future__ import annotations


class Clock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
