"""A job's own files (``GET /v1/jobs/{id}/files``), downloaded and unpacked safely.

The archive holds what the job's code wrote, so it is unpacked as untrusted: tarfile's
``data`` filter refuses absolute names, ``..``, devices and set-id bits. A symbolic link
the job made is kept only while it stays inside the job's directory: one that leaves it
(an absolute target, or one that climbs out) is left out and named in a warning, so that
the rest of the files still arrive. The archive is written and unpacked in a hidden
directory beside the destination (one rename at the end) that is removed whatever happens.
"""

from __future__ import annotations

import logging
import os
import tarfile
from collections.abc import Iterator
from pathlib import Path

from elastic_train import protocol
from elastic_train.errors import ElasticTrainError

log = logging.getLogger(__name__)

ARCHIVE = "files.tar"


def files_path(job_id: str) -> str:
    return protocol.job_path(job_id, "files")


def destination(into: str | os.PathLike[str], job_id: str) -> Path:
    """``into/<job_id>``; an existing one is never overwritten."""
    dest = Path(into) / job_id
    if dest.exists() or dest.is_symlink():
        raise ElasticTrainError(f"{dest} already exists; remove it or download into another -o")
    return dest


class _Filter:
    """tarfile's ``data`` filter, leaving out (and remembering) the links it refuses."""

    def __init__(self) -> None:
        self.left_out: list[str] = []

    def __call__(self, member: tarfile.TarInfo, path: str) -> tarfile.TarInfo | None:
        try:
            return tarfile.data_filter(member, path)
        except (tarfile.AbsoluteLinkError, tarfile.LinkOutsideDestinationError):
            if not member.issym():
                raise
            self.left_out.append(member.name)
            return None


def _links_leaving(top: Path) -> Iterator[Path]:
    """Links under ``top`` that resolve outside it. The filter checked each link against
    the unpacking directory, which holds ``top``: a link to ``..`` of ``top`` passed it,
    and after the rename would point beside the destination."""
    inside = top.resolve()
    for root, dirs, files in os.walk(top):
        for name in [*dirs, *files]:
            path = Path(root) / name
            if path.is_symlink() and not path.resolve().is_relative_to(inside):
                yield path


def unpack(archive: Path, stage: Path, dest: Path, top: str) -> Path:
    """Unpack ``archive`` (in ``stage``) safely and move its ``top`` directory to ``dest``."""
    out = stage / "unpacked"
    keep = _Filter()
    try:
        with tarfile.open(archive, "r:") as tar:
            tar.extractall(out, filter=keep)
    except tarfile.FilterError as e:
        raise ElasticTrainError(f"the job's files were refused: {e}; nothing was kept") from None
    except (tarfile.TarError, EOFError) as e:
        raise ElasticTrainError(f"the job's files are unreadable ({e}); nothing was kept") from None
    if not out.is_dir() or [p.name for p in out.iterdir()] != [top] or not (out / top).is_dir():
        raise ElasticTrainError(
            f"the archive does not hold job {top}'s directory; nothing was kept"
        )
    for link in list(_links_leaving(out / top)):
        keep.left_out.append(str(link.relative_to(out)))
        link.unlink()
    if keep.left_out:
        log.warning(
            "links that leave the job's directory were left out: %s", ", ".join(keep.left_out)
        )
    os.rename(out / top, dest)
    return dest
