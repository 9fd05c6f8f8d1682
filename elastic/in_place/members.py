"""Which replicas a quorum holds.

torchft's ``Manager`` keeps only the quorum's size; a lost replica replaced in the same
quorum change leaves the size as it was, and only the members tell. The manager's client
is wrapped to keep the last quorum's replica ids."""

from __future__ import annotations

from typing import Any


def replica_id(supervisor: str, index: int) -> str:
    """The id replica ``index`` of a job gives torchft (and the lighthouse shows)."""
    return f"{supervisor}-r{index}"


def index_of(rid: str) -> int:
    """The replica index in an id torchft reports (it appends ``:<uuid>``)."""
    return int(rid.split(":")[0].rsplit("-r", 1)[1])


class QuorumMembers:
    """Forwards to torchft's manager client; keeps the replica ids of the last quorum."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.replica_ids: list[str] = []

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        result = self._client._quorum(*args, **kwargs)
        self.replica_ids = list(result.replica_ids)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def quorum_members(manager: Any) -> frozenset[int] | None:
    """The replica indices of the manager's last quorum; None when they are not known."""
    client = getattr(manager, "_client", None)
    if not isinstance(client, QuorumMembers) or not client.replica_ids:
        return None
    return frozenset(index_of(rid) for rid in client.replica_ids)
