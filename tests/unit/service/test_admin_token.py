"""The bootstrap admin token: generated once into a file only its owner reads, and its
secret printed on that first start only."""

from __future__ import annotations

import stat
from pathlib import Path

from service.auth import TOKEN_FILE, resolve_admin_token
from service.cli import admin_token_notice
from service.settings import Settings


def test_the_generated_token_is_kept_mode_0600_and_printed_once(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "data", api_token=None)
    token, generated = resolve_admin_token(settings)
    path = tmp_path / "data" / TOKEN_FILE
    assert generated and len(token) >= 40
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text() == token + "\n"
    first = admin_token_notice(settings, token, generated)
    assert first == f"admin token (generated, stored in {path}, shown this once): {token}"

    again, generated = resolve_admin_token(settings)  # the next start
    assert (again, generated) == (token, False)
    later = admin_token_notice(settings, again, generated)
    assert later == f"admin token: in {path}" and token not in later
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_configured_token_is_never_printed(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, api_token="configured-secret-0123456789")
    token, generated = resolve_admin_token(settings)
    assert (token, generated) == ("configured-secret-0123456789", False)
    assert admin_token_notice(settings, token, generated) == (
        "admin token: the one in ETRAIN_API_TOKEN"
    )
    assert not (tmp_path / TOKEN_FILE).exists()
