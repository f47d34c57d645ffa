"""vsim.fileio: atomic writes leave the old file or the new one, never a half-written one or a
temporary file, and give an ordinary file mode."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import pytest

from vsim.fileio import default_file_mode, replace_atomically, write_atomic


def test_text_bytes_and_gzip(tmp_path: Path) -> None:
    write_atomic(tmp_path / "a.txt", "héllo\n")
    assert (tmp_path / "a.txt").read_bytes() == "héllo\n".encode()
    write_atomic(tmp_path / "b.bin", b"\x00\x01")
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    write_atomic(tmp_path / "c.gz", "x" * 100, gzip_level=9)
    first = (tmp_path / "c.gz").read_bytes()
    write_atomic(tmp_path / "c.gz", "x" * 100, gzip_level=9)
    assert (tmp_path / "c.gz").read_bytes() == first  # mtime 0: the same bytes again
    assert gzip.decompress(first) == b"x" * 100
    assert (tmp_path / "a.txt").stat().st_mode & 0o777 == default_file_mode()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.bin", "c.gz"]


def test_a_failed_check_or_writer_keeps_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "out.yaml"
    target.write_text("old\n")

    def reject(path: Path) -> None:
        assert path.read_text() == "new\n" and path != target
        raise ValueError("does not load")

    with pytest.raises(ValueError):
        write_atomic(target, "new\n", check=reject)

    def broken(tmp: str) -> None:
        Path(tmp).write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        replace_atomically(target, broken, suffix=".png")
    assert target.read_text() == "old\n"
    assert os.listdir(tmp_path) == ["out.yaml"]
