"""Who is calling: bearer tokens of users with a role, and what each role may do.

Tokens are random, shown once, and stored as a SHA-256 hash (service.store.TokenRow). The
bootstrap admin token comes from settings (or is generated on first start); it belongs to
the user ``admin``. Every authenticated request also spends from its token's rate budget.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from service.settings import Settings

TOKEN_FILE = "admin-token"
BOOTSTRAP_ADMIN = "admin"
BOOTSTRAP_TOKEN_ID = "bootstrap"
Role = Literal["admin", "user"]


@dataclass(frozen=True)
class Caller:
    """The authenticated user behind a request."""

    user: str
    role: Role
    token_id: str

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"

    def may_see(self, owner: str) -> bool:
        return self.is_admin or owner == self.user


def resolve_admin_token(settings: Settings) -> tuple[str, bool]:
    """The configured token, else the one stored under data_dir (made on first start).
    Returns (token, whether it was just generated)."""
    if settings.api_token is not None and settings.api_token.get_secret_value():
        return settings.api_token.get_secret_value(), False
    path = Path(settings.data_dir) / TOKEN_FILE
    if path.is_file():
        return path.read_text().strip(), False
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token, True


class RateLimiter:
    """A token bucket per API token: ``rate`` requests a second, bursts up to ``burst``."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, burst
        self._buckets: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def wait_needed(self, key: str) -> float:
        """0 when the request may go now (and it is counted), else seconds to wait."""
        if self.rate <= 0:
            return 0.0
        now = time.monotonic()
        with self._lock:
            level, last = self._buckets.get(key, (float(self.burst), now))
            level = min(float(self.burst), level + (now - last) * self.rate)
            if level >= 1.0:
                self._buckets[key] = (level - 1.0, now)
                return 0.0
            self._buckets[key] = (level, now)
            return (1.0 - level) / self.rate
