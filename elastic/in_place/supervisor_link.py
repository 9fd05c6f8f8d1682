"""A replica's line to its job's supervisor, which may die and be re-created (under the
same name) while the replica trains on.

Calls look like an actor handle's (``link.record.remote(...)``) and go to the supervisor of
the moment. A thread watches their results: when one says the supervisor died, it finds the
new supervisor by name and sends it again what it must know. That is the calls that say who
the replica is (the last of each :data:`STICKY` kind), and the numbered news of the last
:data:`RETAIN_S`, which the dead one may have held unread by the service. The new supervisor
drops the news the service had already stored (elastic/supervisor/loop.py), so nothing is told
twice or lost.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from typing import Any

import ray

log = logging.getLogger(__name__)

# The calls that describe the replica to its supervisor: the new one is told them again.
STICKY = frozenset({"register_worker", "replica_trained"})
# How long numbered news is kept for a new supervisor. The service reads a supervisor's news
# every poll (well under a second), so the dead one held at most that much unread.
RETAIN_S = 30.0
WATCH_S = 0.1
FIND_EVERY_S = 0.2
# A replica placed by a supervisor that died before the replica started finds its successor.
FIRST_FIND_S = 60.0


class _Method:
    def __init__(self, link: SupervisorLink, name: str) -> None:
        self.link, self.name = link, name

    def remote(self, *args: Any) -> Any:
        return self.link.call(self.name, args)


class SupervisorLink:
    def __init__(self, name: str, namespace: str | None) -> None:
        self.name, self.namespace = name, namespace
        self.closed = threading.Event()
        handle = self._find(None, FIRST_FIND_S)
        if handle is None:
            raise RuntimeError(f"the job's supervisor {name!r} is not running")
        self.handle = handle
        self.lock = threading.Lock()
        self.sticky: dict[str, tuple[Any, ...]] = {}
        # (sent at, method, args) of each call whose result is not known yet
        self.pending: dict[Any, tuple[float, str, tuple[Any, ...]]] = {}
        # (sent at, args) of the numbered news of the last RETAIN_S
        self.retained: collections.deque[tuple[float, tuple[Any, ...]]] = collections.deque()
        threading.Thread(target=self._watch, name="supervisor-link", daemon=True).start()

    def __getattr__(self, method: str) -> _Method:
        if method.startswith("_"):
            raise AttributeError(method)
        return _Method(self, method)

    def call(self, method: str, args: tuple[Any, ...]) -> Any:
        with self.lock:
            ref = getattr(self.handle, method).remote(*args)
            now = time.monotonic()
            self.pending[ref] = (now, method, args)
            if method in STICKY:
                self.sticky[method] = args
            if method == "record" and len(args) >= 4:
                self.retained.append((now, args))
        return ref

    def flush(self, timeout_s: float) -> None:
        """Wait until every call so far has reached a supervisor (a new one, if it died), or
        ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                if not self.pending:
                    return
            time.sleep(WATCH_S / 2)

    def close(self) -> None:
        self.closed.set()

    def _watch(self) -> None:
        while not self.closed.wait(WATCH_S):
            with self.lock:
                refs = list(self.pending)
                cutoff = time.monotonic() - RETAIN_S
                while self.retained and self.retained[0][0] < cutoff:
                    self.retained.popleft()
            if not refs:
                continue
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
            died = None
            unsure = []
            for ref in ready:
                try:
                    ray.get(ref, timeout=0)
                except ray.exceptions.ActorUnavailableError:
                    unsure.append(ref)  # not dead: unreachable a moment (checked first: a
                    continue  # subclass of RayActorError)
                except ray.exceptions.RayActorError as e:
                    died = e
                    continue
                except Exception:  # the call failed in the supervisor: told, not retried
                    pass
                with self.lock:
                    self.pending.pop(ref, None)
            if died is not None:
                self._switch(died)
            elif unsure:
                self._again(unsure)

    def _again(self, refs: list[Any]) -> None:
        """Calls that may or may not have reached a supervisor that is still alive: sent
        again to it. Its news is numbered, and a number it already has is dropped as a
        repeat (elastic/arrivals.py); the other calls say who the replica is, which is the
        same said twice. Should it have died meanwhile, the repeat says so."""
        with self.lock:
            calls = [self.pending.pop(ref) for ref in refs if ref in self.pending]
        for _, method, args in sorted(calls, key=lambda c: c[0]):
            if method == "record":  # numbered news: not kept a second time for a successor
                with self.lock:
                    ref = getattr(self.handle, method).remote(*args)
                    self.pending[ref] = (time.monotonic(), method, args)
            else:
                self.call(method, args)

    def _find(self, dead: Any, timeout_s: float | None) -> Any:
        """The job's supervisor, other than the actor ``dead``; None when ``timeout_s``
        passes (or the link is closed) first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.closed.is_set():
            with contextlib.suppress(ValueError):
                handle = ray.get_actor(self.name, namespace=self.namespace)
                if handle._actor_id != dead:
                    return handle
            if deadline is not None and time.monotonic() > deadline:
                return None
            time.sleep(FIND_EVERY_S)
        return None

    def _switch(self, why: BaseException) -> None:
        """The supervisor died: wait for its successor, then tell it again what it must know
        (each failed call goes again within that)."""
        log.warning("the job's supervisor is gone (%s); waiting for a new one", type(why).__name__)
        handle = self._find(self.handle._actor_id, None)
        if handle is None:
            return
        with self.lock:
            self.handle = handle
            failed = self.pending
            self.pending = {}
            sticky, retained = dict(self.sticky), list(self.retained)
            self.retained.clear()
        for method, args in sticky.items():
            self.call(method, args)
        resent = {(args[2], args[3]) for _, args in retained}
        for _, args in retained:
            self.call("record", args)
        # What failed and is not news kept above (numbered or not): sent again, in order.
        for _, method, args in sorted(failed.values(), key=lambda v: v[0]):
            if method in STICKY or (method == "record" and args[2:4] in resent):
                continue
            self.call(method, args)
        log.warning("the job's new supervisor has the replica's news again")
