"""Users, tokens, Idempotency-Keys and schema migrations in the store, on SQLite and (with
ETRAIN_TEST_DATABASE_URL) PostgreSQL."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect, text

from service.store import Base, SchemaTooNew, Store, hash_secret
from tests.conftest import database_url, small_job


def test_a_token_is_shown_once_and_kept_only_as_a_hash(store: Store) -> None:
    assert store.create_user("ada", "user") is not None
    assert store.create_user("ada", "admin") is None  # the name is taken
    row, secret = store.create_token("ada", "laptop")
    assert secret.startswith("et_") and len(secret) > 40
    assert row.secret_hash == hash_secret(secret) and secret not in row.secret_hash
    with store.engine.connect() as conn:
        stored = [r[0] for r in conn.execute(text("SELECT secret_hash FROM api_tokens"))]
    assert stored == [hash_secret(secret)]
    found = store.authenticate(secret)
    assert found is not None and (found[0].name, found[0].role, found[1].id) == (
        "ada",
        "user",
        row.id,
    )
    assert store.authenticate(secret + "x") is None


def test_a_revoked_token_no_longer_authenticates(store: Store) -> None:
    store.create_user("bob", "user")
    keep, keep_secret = store.create_token("bob", "ci")
    gone, gone_secret = store.create_token("bob", "old")
    revoked = store.revoke_token(gone.id)
    assert revoked is not None and revoked.revoked_at is not None
    assert store.authenticate(gone_secret) is None
    assert store.authenticate(keep_secret) is not None
    assert [(t.id, t.revoked_at is None) for t in store.tokens("bob")] == [
        (keep.id, True),
        (gone.id, False),
    ]
    assert store.revoke_token("tok-nope") is None


def test_jobs_are_listed_per_owner(store: Store) -> None:
    mine = store.create_job("a", "ada", "image-classification", small_job())
    time.sleep(0.002)
    theirs = store.create_job("b", "bob", "image-classification", small_job())
    assert [j.id for j in store.list_jobs(None, 10, None, owner="ada").items] == [mine.id]
    assert [j.id for j in store.list_jobs(None, 10, None).items] == [theirs.id, mine.id]


def test_an_idempotency_key_is_claimed_once_and_records_its_job(store: Store) -> None:
    assert store.claim_idempotency_key("ada", "k1", "f1", 120) is None
    held = store.claim_idempotency_key("ada", "k1", "f1", 120)
    assert held is not None and held.job_id is None  # still being processed
    job = store.create_job("a", "ada", "image-classification", small_job(), "k1")
    held = store.claim_idempotency_key("ada", "k1", "f2", 120)
    assert held is not None and (held.job_id, held.fingerprint) == (job.id, "f1")
    # Keys are per user: another user's same key is theirs.
    assert store.claim_idempotency_key("bob", "k1", "f1", 120) is None
    # A refused submission frees its key; a key with a job is never freed.
    store.release_idempotency_key("bob", "k1")
    assert store.claim_idempotency_key("bob", "k1", "f9", 120) is None
    store.release_idempotency_key("ada", "k1")
    held = store.claim_idempotency_key("ada", "k1", "f1", 120)
    assert held is not None and held.job_id == job.id


def test_a_reservation_abandoned_by_a_dead_process_is_taken_over(store: Store) -> None:
    assert store.claim_idempotency_key("ada", "k", "f1", 120) is None
    time.sleep(0.05)
    assert store.claim_idempotency_key("ada", "k", "f2", 0.01) is None
    held = store.claim_idempotency_key("ada", "k", "f3", 120)
    assert held is not None and held.fingerprint == "f2"


def test_a_database_newer_than_the_service_is_refused(store_backend: str, tmp_path: Path) -> None:
    with database_url(store_backend, tmp_path) as url:
        Store(url).close()
        engine = create_engine(url)
        with engine.begin() as conn:
            conn.execute(text("UPDATE alembic_version SET version_num = '9999_from_the_future'"))
        engine.dispose()
        with pytest.raises(
            SchemaTooNew,
            match=r"schema revision '9999_from_the_future', "
            r"newer than this elastic-train knows \(its newest is '0005'\)",
        ):
            Store(url)


def test_a_walking_skeleton_database_is_migrated_in_place(
    store_backend: str, tmp_path: Path
) -> None:
    with database_url(store_backend, tmp_path) as url:
        engine = create_engine(url)
        old_tables = [
            Base.metadata.tables[t] for t in ("jobs", "job_events", "metrics", "checkpoints")
        ]
        Base.metadata.create_all(engine, tables=old_tables)  # what create_all made before
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO jobs (id, name, owner, workload, spec, state, world_size, step, "
                    "restarts, last_seq, created_at, updated_at) VALUES ('job-old', 'old', "
                    "'admin', 'image-classification', '{}', 'queued', 0, 0, 0, 1, "
                    "CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"
                )
            )
        store = Store(url)
        try:
            assert {"users", "api_tokens", "idempotency_keys", "alembic_version"} <= set(
                inspect(engine).get_table_names()
            )
            with engine.connect() as conn:
                assert (
                    conn.execute(text("SELECT version_num FROM alembic_version")).scalar() == "0005"
                )
            old = store.get_job("job-old")
            assert old is not None and old.name == "old"
        finally:
            store.close()
            engine.dispose()
