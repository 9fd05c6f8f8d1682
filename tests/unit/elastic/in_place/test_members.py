"""The quorum's members as the replicas see them (elastic/in_place/members.py)."""

from __future__ import annotations

from dataclasses import dataclass

from elastic.in_place.members import QuorumMembers, index_of, quorum_members, replica_id


@dataclass
class Result:
    replica_ids: list[str]
    quorum_id: int = 7


class Client:
    """Answers as torchft's ManagerClient does: ids with a ``:<uuid>`` appended."""

    def __init__(self) -> None:
        self.calls: list[dict[str, object]] = []

    def _quorum(self, **kwargs: object) -> Result:
        self.calls.append(kwargs)
        return Result(["job-ab12-r0:5f1c", "job-ab12-r3:77aa"])

    def should_commit(self, *args: object) -> bool:
        return True


class Manager:
    def __init__(self, client: object) -> None:
        self._client = client


def test_the_last_quorum_s_members_are_kept_and_everything_else_passes_through() -> None:
    inner = Client()
    manager = Manager(QuorumMembers(inner))
    assert quorum_members(manager) is None  # no quorum yet
    result = manager._client._quorum(group_rank=0, step=4)
    assert result.quorum_id == 7 and inner.calls == [{"group_rank": 0, "step": 4}]
    assert quorum_members(manager) == frozenset({0, 3})
    assert manager._client.should_commit(0, 4) is True
    assert quorum_members(Manager(inner)) is None  # not wrapped: not known


def test_ids_round_trip_with_a_dash_in_the_supervisor_name() -> None:
    rid = replica_id("etrain-job-9f-r2x", 12)
    assert index_of(rid) == 12 and index_of(f"{rid}:uuid-r3") == 12
