"""Which files a job may read: only under the data roots an admin configured for its owner,
never the service's own files. Checked at submission on the real path (symbolic links and
``..`` resolved); the job then carries the canonical path, which the worker checks again
(``safe_files.checked_path``), so a link changed afterwards is refused there."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

USER_PLACEHOLDER = "{user}"
MAX_PATH = 4096


class PathRefused(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


def within(path: str, root: str) -> bool:
    """Whether ``path`` is ``root`` or below it (both already resolved)."""
    root = root.rstrip(os.sep) or os.sep
    return path == root or path.startswith(root if root == os.sep else root + os.sep)


@dataclass(frozen=True)
class DataAccess:
    """``roots``: directories users may read, ``{user}`` standing for the owner's name;
    ``private``: the service's own directories, never readable however the roots are set."""

    roots: Sequence[str]
    private: Sequence[str]

    def roots_of(self, user: str) -> list[str]:
        return [os.path.realpath(r.replace(USER_PLACEHOLDER, user)) for r in self.roots]

    def authorize(self, field: str, path: str, user: str) -> str:
        """The canonical path ``user`` may read as ``field``, or PathRefused."""
        if not self.roots:
            raise PathRefused(
                field,
                "this service has no data roots configured (ETRAIN_DATA_ROOTS), so jobs "
                "can read no files; use the synthetic dataset, or ask an admin",
            )
        if "\x00" in path or len(path) > MAX_PATH or not os.path.isabs(path):
            raise PathRefused(field, "must be an absolute path")
        real = os.path.realpath(path)
        mine = self.roots_of(user)
        if not any(within(real, root) for root in mine):
            raise PathRefused(
                field,
                f"{path} is not under a data root you may read ({', '.join(mine)})",
            )
        for own in (os.path.realpath(p) for p in self.private):
            if within(real, own) or within(own, real):
                raise PathRefused(field, f"{path} overlaps the service's own files")
        return real

    def readable_trees(self, user: str) -> list[str]:
        """The roots ``user``'s own code may read whole (a command job's): those that hold
        none of the service's files, which a rule over a whole tree could not leave out."""
        private = [os.path.realpath(p) for p in self.private]
        return [r for r in self.roots_of(user) if not any(within(p, r) for p in private)]

    def authorize_all(self, paths: Iterable[tuple[str, str]], user: str) -> dict[str, str]:
        """field -> canonical path for each (field, path); the first refusal raises."""
        return {field: self.authorize(field, path, user) for field, path in paths}
