"""What the sync and async clients share to upload a code package: packing, the size
check made before any byte is sent, and the reading of the service's 413. No I/O here
beyond reading the directory."""

from __future__ import annotations

import os
from typing import TypeAlias

from elastic_train.code_archive import Packed, pack
from elastic_train.errors import CodeTooLarge, PayloadTooLarge

CODE_PATH = "/v1/code"
# The service's default max_code_bytes (Ray's own limit on a working directory); a service
# set otherwise says so in its 413, which the client then reports.
DEFAULT_MAX_CODE_BYTES = 100 * 1024 * 1024
HEADERS = {"Content-Type": "application/gzip"}

# A directory to pack, or an archive packed already (to show what it holds before sending).
CodeSource: TypeAlias = "str | os.PathLike[str] | Packed"


def packed_within(code: CodeSource, max_bytes: int = DEFAULT_MAX_CODE_BYTES) -> Packed:
    """``code`` packed; :class:`CodeTooLarge` naming its biggest files when it is over
    ``max_bytes``, so that nothing is uploaded in vain."""
    archive = code if isinstance(code, Packed) else pack(code)
    if archive.size_bytes > max_bytes:
        raise CodeTooLarge(
            f"the code packs to {archive.size_bytes} bytes, over the limit of {max_bytes} bytes",
            archive.biggest,
        )
    return archive


def too_large(error: PayloadTooLarge, archive: Packed) -> CodeTooLarge:
    """The service's 413 (its own limit, another than the client's) with the biggest files."""
    reason = error.detail or error.title
    return CodeTooLarge(f"the service refused the code: {reason}", archive.biggest)


def summary(archive: Packed) -> str:
    """``12 files, 3.4 KiB packed (id 1a2b3c4d5e6f)``"""
    from elastic_train.render import size

    noun = "file" if archive.files == 1 else "files"
    return (
        f"{archive.files} {noun}, {size(archive.size_bytes)} packed (id {archive.content_id[:12]})"
    )
