"""The service's check of a code package, on real tar.gz archives built with tarfile."""

from __future__ import annotations

import gzip
import hashlib
import io
import tarfile

import pytest

from jobs.code_package import CodePackage, PackageLimits, PackageRefused, check

LIMITS = PackageLimits(max_files=100, max_unpacked_bytes=1_000_000)


Entry = tuple[str, bytes, bytes, str]


def entry(name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"", link: str = "") -> Entry:
    return name, kind, data, link


def archive(*entries: Entry, compress: bool = True) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, kind, data, link in entries:
            info = tarfile.TarInfo(name)
            info.type = kind
            info.linkname = link
            if kind == tarfile.REGTYPE:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.addfile(info)
    raw = buffer.getvalue()
    return gzip.compress(raw, mtime=0) if compress else raw


def refusal(data: bytes, limits: PackageLimits = LIMITS) -> PackageRefused:
    with pytest.raises(PackageRefused) as refused:
        check(data, limits)
    return refused.value


def test_a_good_package_gives_its_sha256_and_sizes() -> None:
    data = archive(
        entry("src", tarfile.DIRTYPE),
        entry("src/train.py", data=b"print('hi')\n"),
        entry("src/util.py", data=b"x = 1\n"),
        entry("train.py", tarfile.SYMTYPE, link="src/train.py"),
        entry("copy.py", tarfile.LNKTYPE, link="src/util.py"),
        entry("src/up", tarfile.SYMTYPE, link="../src"),
    )
    assert check(data, LIMITS) == CodePackage(
        id=hashlib.sha256(data).hexdigest(),
        size_bytes=len(data),
        files=5,
        unpacked_bytes=18,
    )


def test_an_archive_made_with_tar_c_dir_dot_is_accepted() -> None:
    # `tar czf code.tar.gz -C project .` names the root "./" and every entry "./...".
    data = archive(
        entry("./", tarfile.DIRTYPE),
        entry("./pkg", tarfile.DIRTYPE),
        entry("./pkg/model.py", data=b"m = 1\n"),
        entry("./model.py", tarfile.SYMTYPE, link="pkg/model.py"),
    )
    assert check(data, LIMITS) == CodePackage(hashlib.sha256(data).hexdigest(), len(data), 2, 6)


@pytest.mark.parametrize(
    ("entries", "name", "message"),
    [
        ([entry("/etc/cron.d/x", data=b"x")], "/etc/cron.d/x", "an absolute path"),
        ([entry("src/../../x.py", data=b"x")], "src/../../x.py", "a '..' component in its path"),
        ([entry("..", tarfile.DIRTYPE)], "..", "a '..' component in its path"),
        (
            [entry("up", tarfile.SYMTYPE, link="../outside")],
            "up",
            "a link to '../outside', outside the package",
        ),
        (
            [entry("a", tarfile.DIRTYPE), entry("a/up", tarfile.SYMTYPE, link="../../x")],
            "a/up",
            "a link to '../../x', outside the package",
        ),
        (
            [entry("etc", tarfile.SYMTYPE, link="/etc")],
            "etc",
            "a link to the absolute path '/etc'",
        ),
        (
            [entry("passwd", tarfile.LNKTYPE, link="/etc/passwd")],
            "passwd",
            "a link to the absolute path '/etc/passwd'",
        ),
        (
            [entry("passwd", tarfile.LNKTYPE, link="../etc/passwd")],
            "passwd",
            "a link to '../etc/passwd', outside the package",
        ),
        (
            [entry("sda", tarfile.BLKTYPE)],
            "sda",
            "a block device: only regular files, directories and links are allowed",
        ),
        (
            [entry("tty", tarfile.CHRTYPE)],
            "tty",
            "a character device: only regular files, directories and links are allowed",
        ),
        (
            [entry("pipe", tarfile.FIFOTYPE)],
            "pipe",
            "a FIFO: only regular files, directories and links are allowed",
        ),
        (
            # Each link stays inside on its own; followed together they leave.
            [
                entry("here", tarfile.SYMTYPE, link="."),
                entry("out", tarfile.SYMTYPE, link="here/.."),
            ],
            "out",
            "a link to 'here/..', outside the package",
        ),
        (
            # A file written through a link lands wherever the link points.
            [entry("d", tarfile.SYMTYPE, link="src"), entry("d/x.py", data=b"x")],
            "d/x.py",
            "its path passes through the link 'd'",
        ),
    ],
)
def test_an_unsafe_entry_is_refused_by_name(entries: list[Entry], name: str, message: str) -> None:
    refused = refusal(archive(*entries))
    assert (refused.entry, refused.message) == (name, message)
    assert str(refused) == f"{name}: {message}"


def test_more_entries_than_max_files_are_refused_at_the_first_one_over() -> None:
    data = archive(*(entry(f"f{i}.py", data=b"x") for i in range(4)))
    refused = refusal(data, PackageLimits(max_files=3, max_unpacked_bytes=1000))
    assert (refused.entry, refused.rule) == ("f3.py", "max_files")
    assert refused.message == "more than max_files (3) entries"
    assert check(data, PackageLimits(max_files=4, max_unpacked_bytes=1000)).files == 4


def test_unpacked_bytes_over_the_limit_are_refused() -> None:
    data = archive(entry("a.bin", data=b"a" * 600), entry("b.bin", data=b"b" * 600))
    refused = refusal(data, PackageLimits(max_files=10, max_unpacked_bytes=1000))
    assert (refused.entry, refused.rule) == ("b.bin", "max_unpacked_bytes")
    assert refused.message == "unpacks to more than max_unpacked_bytes (1000 bytes)"
    assert check(data, PackageLimits(max_files=10, max_unpacked_bytes=1200)).unpacked_bytes == 1200


def test_a_zip_bomb_is_refused_without_inflating_it() -> None:
    # 64 MiB of zeros compress to 64 KiB; the check stops at the 1 MiB limit.
    buffer = io.BytesIO()
    with (
        gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0) as gz,
        tarfile.open(fileobj=gz, mode="w") as tar,
    ):
        info = tarfile.TarInfo("zeros.bin")
        info.size = 64 << 20
        tar.addfile(info, _Zeros(info.size))
    refused = refusal(buffer.getvalue(), PackageLimits(max_files=10, max_unpacked_bytes=1 << 20))
    assert (refused.entry, refused.rule) == ("zeros.bin", "max_unpacked_bytes")


def test_a_huge_header_is_cut_off_at_the_cap() -> None:
    # A PAX header is read into memory whole: one of 16 MB stops at the cap.
    header = b"16000000 comment=" + b"x" * 16_000_000
    raw = io.BytesIO()
    pax = tarfile.TarInfo("././@PaxHeader")
    pax.type = tarfile.XHDTYPE
    pax.size = len(header)
    raw.write(pax.tobuf(format=tarfile.USTAR_FORMAT))
    raw.write(header + b"\0" * (-len(header) % 512))
    data = gzip.compress(raw.getvalue(), compresslevel=1, mtime=0)
    refused = refusal(data, PackageLimits(max_files=10, max_unpacked_bytes=1 << 20))
    assert refused.rule == "max_unpacked_bytes"


class _Zeros(io.RawIOBase):
    def __init__(self, size: int) -> None:
        self.left = size

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        n = self.left if size < 0 else min(size, self.left)
        self.left -= n
        return b"\0" * n


_WHOLE = archive(entry("a.py", data=bytes(range(256)) * 40))
TRUNCATED = _WHOLE[: len(_WHOLE) // 2]


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"PK\x03\x04 a zip file",
        archive(entry("a.py", data=b"x"), compress=False),  # a tar, not gzip'd
        gzip.compress(b"just some text, not a tar archive" * 40, mtime=0),
        TRUNCATED,
    ],
    ids=["empty", "zip", "plain-tar", "gzip-not-tar", "truncated"],
)
def test_what_is_not_a_tar_gz_is_refused(data: bytes) -> None:
    refused = refusal(data)
    assert refused.rule == "format"
    assert refused.message.startswith("the body is not a gzip-compressed tar archive")
