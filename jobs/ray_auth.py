"""Ray's token authentication, checked before joining a cluster: a token the cluster refuses
must stop the service with a sentence that says so. (``ray.init`` retries for 20 s and then
reports only that it could not connect; the refusal is in a C++ log line.)"""

from __future__ import annotations


class RayAuthRefused(RuntimeError):
    pass


def check_token(address: str, token_configured: bool) -> None:
    """Ask the cluster's GCS one question with the token in the environment; raise
    :class:`RayAuthRefused` if it refuses it. A Ray client address (``ray://``) is checked
    by ``ray.init`` itself, and an unreachable address is left for ``ray.init`` to report."""
    if address.startswith("ray://") or address == "auto":
        return
    from ray._raylet import Config, GcsClient  # type: ignore[attr-defined]
    from ray.exceptions import AuthenticationError

    # Ray's C++ config read RAY_AUTH_MODE when ray was imported, before the token was put in
    # the environment; ray.init re-reads it, and so must this earlier check.
    Config.initialize("{}")
    try:
        GcsClient(address=address).internal_kv_get(b"etrain-auth-check", None, timeout=10)
    except AuthenticationError as e:
        if token_configured:
            raise RayAuthRefused(
                f"the Ray cluster at {address} refused the Ray auth token "
                f"(ETRAIN_RAY_AUTH_TOKEN or ETRAIN_RAY_AUTH_TOKEN_PATH): {e}"
            ) from e
        raise RayAuthRefused(
            f"the Ray cluster at {address} requires token authentication: set "
            f"ETRAIN_RAY_AUTH_TOKEN (or ETRAIN_RAY_AUTH_TOKEN_PATH) to its token ({e})"
        ) from e
    except Exception:
        return  # not an auth answer (unreachable, a timeout): ray.init says what it is
