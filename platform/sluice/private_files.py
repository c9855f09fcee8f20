"""Files that hold tenants' data, readable by the service's own user only.

Directories are 0700 and files 0600 whatever the process umask (a umask can only take
bits away; an existing file or directory made wider by an older version is narrowed).
Used for everything under the state dir that holds personal data: uploaded and
produced batch files, their partial files, audit exports, the SQLite database.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import IO, Any

DIR_MODE = 0o700
FILE_MODE = 0o600


def private_dirs(base: Path, *parts: str) -> Path:
    """base/parts..., each level below `base` created (or narrowed) to 0700."""
    path = base
    for part in parts:
        path = path / part
        path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        path.chmod(DIR_MODE)
    return path


def open_private(path: Path, mode: str = "w", *, encoding: str | None = None,
                 newline: str | None = None) -> IO[Any]:
    """`open(path, mode)` for writing ("w", "a", "wb", "ab"), the file 0600."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    flags |= os.O_APPEND if mode.startswith("a") else os.O_TRUNC
    fd = os.open(path, flags, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)  # an existing file keeps its mode otherwise
        return os.fdopen(fd, mode, encoding=encoding, newline=newline)
    except BaseException:
        os.close(fd)
        raise


def write_private(path: Path, data: bytes) -> None:
    with open_private(path, "wb") as out:
        out.write(data)


def narrow(path: Path) -> None:
    """Make an existing file 0600 (or a directory 0700); a missing path is left alone."""
    with contextlib.suppress(FileNotFoundError):
        path.chmod(DIR_MODE if path.is_dir() else FILE_MODE)
