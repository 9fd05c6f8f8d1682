"""What a worker tells its supervisor, put back in the order it was sent.

Workers tell the supervisor their news (metrics, log lines, checkpoints) with fire-and-forget
calls, and the supervisor is an asyncio actor: Ray runs an async actor's calls in the order
they arrive, which is not always the order one caller sent them (under load, a few calls in a
thousand swap with their neighbour). Stored in arrival order, a job's metrics series and log
came out with points swapped. So each sending process numbers its calls (:class:`Outbox`) and
the supervisor holds a call that arrives ahead of a gap until the gap fills (:class:`InOrder`).

A gap that does not fill within ``hold_s`` (a call lost with its dying process) is given up:
what waited behind it goes on, and the missing call, should it come after all, goes on when
it comes. A number that has already gone on comes again only when its sender could not
tell whether the first call arrived (the supervisor was unavailable a moment): that one is
dropped, as the repeat it is.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

Item = TypeVar("Item")

# Swapped calls arrive milliseconds apart; a second is plenty, and short enough that a gap
# left by a dead process delays the news behind it by no more than the service's next poll.
DEFAULT_HOLD_S = 1.0


@dataclass
class _Sender(Generic[Item]):
    next_n: int = 0
    held: dict[int, tuple[Item, float]] = field(default_factory=dict)
    # The numbers below next_n that were given up on, as [start, end) ranges: the only ones
    # below next_n that may still come.
    gaps: list[tuple[int, int]] = field(default_factory=list)

    def fill(self, n: int) -> bool:
        """Whether ``n`` is in a gap given up on (taken out of it), rather than a repeat."""
        for i, (start, end) in enumerate(self.gaps):
            if start <= n < end:
                self.gaps[i : i + 1] = [r for r in ((start, n), (n + 1, end)) if r[0] < r[1]]
                return True
        return False


class InOrder(Generic[Item]):
    """Each sender's numbered items, released in the order of their numbers (from 0)."""

    def __init__(
        self,
        hold_s: float = DEFAULT_HOLD_S,
        clock: Callable[[], float] = time.monotonic,
        taken: dict[str, int] | None = None,
    ) -> None:
        """``taken``: per sender, the last number already taken elsewhere; its next one is
        awaited, not its first."""
        self.hold_s = hold_s
        self.clock = clock
        self._senders: dict[str, _Sender[Item]] = {
            sender: _Sender(next_n=n + 1) for sender, n in (taken or {}).items()
        }

    def accept(self, sender: str, n: int, item: Item) -> list[Item]:
        """The items this one releases, in order: none while an earlier number is missing."""
        s = self._senders.setdefault(sender, _Sender())
        if n < s.next_n:  # late past a gap given up on: it goes on now; else a repeat
            return [item] if s.fill(n) else []
        s.held[n] = (item, self.clock())
        return self._release_run(s)

    def overdue(self) -> list[Item]:
        """Items held behind a gap for longer than ``hold_s``: the gap is given up on."""
        now = self.clock()
        out: list[Item] = []
        for s in self._senders.values():
            if s.held and now - min(since for _, since in s.held.values()) >= self.hold_s:
                out += self._give_up(s)
        return out

    def release_all(self) -> list[Item]:
        """Everything held, each sender's in order; the senders are then forgotten (the
        attempt they belong to has ended: each attempt's processes send anew)."""
        out: list[Item] = []
        for s in self._senders.values():
            out += self._give_up(s)
        self._senders.clear()
        return out

    def held(self) -> int:
        return sum(len(s.held) for s in self._senders.values())

    @staticmethod
    def _release_run(s: _Sender[Item]) -> list[Item]:
        out = []
        while s.next_n in s.held:
            out.append(s.held.pop(s.next_n)[0])
            s.next_n += 1
        return out

    @classmethod
    def _give_up(cls, s: _Sender[Item]) -> list[Item]:
        if not s.held:
            return []
        first = min(s.held)
        if s.next_n < first:
            s.gaps.append((s.next_n, first))
        s.next_n = first
        out = cls._release_run(s)
        return out + cls._give_up(s)


class Outbox:
    """One process's calls to its supervisor's ``record``, numbered for :class:`InOrder`.
    Safe from several threads (the training loop and the checkpoint writer): each call takes
    its own number, and the supervisor orders them by it."""

    def __init__(self, supervisor: Any) -> None:
        self.supervisor = supervisor
        self.sender = uuid.uuid4().hex
        self._numbers = itertools.count()

    def record(self, kind: str, data: dict[str, Any]) -> Any:
        """Sent with its number and the time it was sent: the time the job's log shows, also
        for news a re-created supervisor is sent again (see elastic/in_place)."""
        return self.supervisor.record.remote(
            kind, data, self.sender, next(self._numbers), time.time()
        )
