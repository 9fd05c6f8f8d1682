"""Pure pieces of access control: the per-token rate limiter, who may see a job, and the
environment that makes Ray present its token."""

from __future__ import annotations

import time

from jobs.launcher import ray_auth_env
from service.auth import Caller, RateLimiter


def test_a_token_may_burst_then_waits_at_its_rate() -> None:
    limiter = RateLimiter(rate=2.0, burst=3)
    assert [limiter.wait_needed("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    wait = limiter.wait_needed("a")
    assert 0.4 < wait <= 0.5  # one request refills in 1/rate seconds
    assert limiter.wait_needed("b") == 0.0  # each token has its own bucket
    time.sleep(wait + 0.02)
    assert limiter.wait_needed("a") == 0.0
    assert limiter.wait_needed("a") > 0


def test_no_rate_means_no_limit() -> None:
    limiter = RateLimiter(rate=0, burst=1)
    assert all(limiter.wait_needed("a") == 0.0 for _ in range(1000))


def test_a_user_sees_only_their_own_jobs_and_an_admin_all() -> None:
    alice = Caller("alice", "user", "tok-1")
    root = Caller("root", "admin", "tok-2")
    assert alice.may_see("alice") and not alice.may_see("bob")
    assert root.may_see("alice") and root.may_see("bob") and root.is_admin


def test_ray_is_given_its_token_only_when_one_is_configured() -> None:
    assert ray_auth_env("s3cret", None) == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "s3cret"}
    assert ray_auth_env(None, "/var/run/ray/token") == {
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": "/var/run/ray/token",
    }
    assert ray_auth_env("s3cret", "/ignored") == {
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": "s3cret",
    }
    assert ray_auth_env(None, None) == {}
