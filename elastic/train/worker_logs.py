"""Worker output to the job's log: every line a training process writes to stdout or stderr
(``print``, ``logging``'s stream handlers, warnings) is kept where it was going and also
sent, in batches, to the supervisor, tagged with rank, attempt and time."""

from __future__ import annotations

import contextlib
import io
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

FLUSH_S = 0.5
# How long a worker that ends (either mode) waits for its last log lines to reach the supervisor.
LOG_FLUSH_S = 10.0
MAX_LINE = 8192
MAX_PENDING = 5000  # lines; past this the oldest are dropped, and the log says so


class LineBuffer:
    """Collects complete lines per stream; thread-safe, bounded."""

    def __init__(self, max_pending: int = MAX_PENDING) -> None:
        self.max_pending = max_pending
        self._lines: list[list[Any]] = []
        self._partial: dict[str, str] = {}
        self._dropped = 0
        self._lock = threading.Lock()

    def write(self, stream: str, text: str) -> None:
        with self._lock:
            pending = self._partial.get(stream, "") + text
            *complete, rest = pending.split("\n")
            self._partial[stream] = rest[-MAX_LINE:]
            now = time.time()
            for line in complete:
                self._lines.append([now, stream, line[:MAX_LINE]])
            overflow = len(self._lines) - self.max_pending
            if overflow > 0:
                del self._lines[:overflow]
                self._dropped += overflow

    def take(self, final: bool = False) -> list[list[Any]]:
        with self._lock:
            if final:
                for stream, rest in self._partial.items():
                    if rest:
                        self._lines.append([time.time(), stream, rest])
                self._partial.clear()
            lines, self._lines = self._lines, []
            if self._dropped:
                lines.insert(
                    0,
                    [time.time(), "stderr", f"[elastic-train: {self._dropped} log lines dropped]"],
                )
                self._dropped = 0
            return lines


class _Tee(io.TextIOBase):
    def __init__(self, original: Any, stream: str, buffer: LineBuffer) -> None:
        self.original, self.stream, self.buffer = original, stream, buffer

    def write(self, text: str) -> int:
        self.buffer.write(self.stream, text)
        self.original.write(text)  # some streams (Ray's among them) return None here
        return len(text)

    def flush(self) -> None:
        self.original.flush()

    def fileno(self) -> int:
        return int(self.original.fileno())

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return str(getattr(self.original, "encoding", "utf-8"))


@contextlib.contextmanager
def forward_output(send: Callable[[list[list[Any]]], None]) -> Iterator[None]:
    """While inside: tee stdout and stderr into batches handed to ``send``."""
    buffer = LineBuffer()
    stop = threading.Event()

    def pump() -> None:
        while not stop.wait(FLUSH_S):
            lines = buffer.take()
            if lines:
                send(lines)

    original = sys.stdout, sys.stderr
    sys.stdout = _Tee(sys.stdout, "stdout", buffer)
    sys.stderr = _Tee(sys.stderr, "stderr", buffer)
    thread = threading.Thread(target=pump, name="etrain-log-forwarder", daemon=True)
    thread.start()
    try:
        yield
    finally:
        sys.stdout, sys.stderr = original
        stop.set()
        thread.join(timeout=5)
        lines = buffer.take(final=True)
        if lines:
            send(lines)
