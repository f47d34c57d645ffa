"""Atomic file writing, the one way vsim writes an output: a temporary file in the target's folder
(so that the rename stays on one file system), renamed over the target. A failed or interrupted
write leaves the old file, or none, and no temporary file. No fsync: the point is never to leave
a half-written output, not to survive a power cut. Standard library only (every layer uses it).
"""

from __future__ import annotations

import contextlib
import gzip
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def default_file_mode() -> int:
    """The mode an ordinary new file gets (0666 less the umask); mkstemp's would be 0600."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def replace_atomically(path: str | os.PathLike[str], write: Callable[[str], Any],
                       suffix: str = ".tmp") -> None:
    """Call `write(tmp)` to fill a temporary file next to `path` (named `.NAME.XXXX` + `suffix`;
    a writer that infers the format from the name, such as matplotlib, needs the suffix), then
    give it the ordinary file mode and rename it over `path`."""
    target = Path(path)
    parent = target.parent if str(target.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{target.name}.", suffix=suffix)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, default_file_mode())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_atomic(path: str | os.PathLike[str], data: str | bytes, *,
                 gzip_level: int | None = None,
                 check: Callable[[Path], Any] | None = None) -> None:
    """Write `data` (text as UTF-8) to `path` atomically. `gzip_level`: compress at this level
    with mtime 0 (the same input gives the same bytes). `check(tmp)`: called on the written
    temporary file before the rename (e.g. that it loads); an exception leaves `path` as it
    was."""
    raw = data.encode() if isinstance(data, str) else data
    if gzip_level is not None:
        raw = gzip.compress(raw, compresslevel=gzip_level, mtime=0)

    def write(tmp: str) -> None:
        with open(tmp, "wb") as handle:
            handle.write(raw)
        if check is not None:
            check(Path(tmp))

    replace_atomically(path, write)
