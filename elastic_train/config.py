"""Where the client finds the service and its token.

In order: what the caller passes, then ``ETRAIN_URL`` / ``ETRAIN_TOKEN``, then what
``etrain login`` saved in the user's config directory (``$XDG_CONFIG_HOME/etrain/`` on
Linux, the platform's own place elsewhere). A saved token is sent only to the URL it was
saved for, so pointing ``ETRAIN_URL`` at another server never hands it the token.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from elastic_train.errors import ConfigError

DEFAULT_URL = "http://127.0.0.1:8000"
# The service reads ETRAIN_* too (service/settings.py); these two name no setting of it.
URL_ENV = "ETRAIN_URL"
TOKEN_ENV = "ETRAIN_TOKEN"
CONFIG_FILE = "config.json"


@dataclass(frozen=True)
class Credentials:
    url: str
    token: str | None


def config_path() -> Path:
    from platformdirs import user_config_path

    return user_config_path("etrain", appauthor=False) / CONFIG_FILE


def normalize_url(url: str) -> str:
    """``localhost:8000/`` -> ``http://localhost:8000``: the base every API path is joined to."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    return url


def load_saved(path: Path | None = None) -> Credentials | None:
    path = path or config_path()
    try:
        saved = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: unreadable ({e}); run `etrain login` again") from e
    if not isinstance(saved, dict) or not isinstance(saved.get("url"), str):
        raise ConfigError(f"{path}: no url in it; run `etrain login` again")
    token = saved.get("token")
    return Credentials(normalize_url(saved["url"]), token if isinstance(token, str) else None)


def resolve(url: str | None = None, token: str | None = None) -> Credentials:
    if url and token:  # e.g. `etrain login`, which replaces whatever the file holds
        return Credentials(normalize_url(url), token)
    saved = load_saved()
    chosen = normalize_url(url or os.environ.get(URL_ENV) or (saved.url if saved else DEFAULT_URL))
    if token is None:
        token = os.environ.get(TOKEN_ENV) or None
    if token is None and saved is not None and saved.url == chosen:
        token = saved.token
    return Credentials(chosen, token)


def save(credentials: Credentials, path: Path | None = None) -> Path:
    """Write the URL and token readable by the user only (0600, in a 0700 directory),
    replacing the file in one step so that no reader ever sees half of it."""
    path = path or config_path()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    # mkstemp creates the file 0600 from the start: the token is never readable by others.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".config-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"url": credentials.url, "token": credentials.token}, f, indent=2)
            f.write("\n")
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
