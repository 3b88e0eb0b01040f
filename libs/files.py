"""Files the mesh keeps on disk for itself, private to the user that runs it (docs/operations.md#files):
the data directory 0700, the SQLite database (hashed API keys and every message), the mesh secret and
the development API key 0600, from the moment each exists (never created readable, then narrowed)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

DIR_MODE = 0o700
FILE_MODE = 0o600


def private_dir(path: Path) -> Path:
    """`path` (and missing parents), the last one 0700: created so, or narrowed when it exists and is
    ours (a directory of someone else's is left as it is)."""
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        if path.stat().st_uid == os.getuid() and path.stat().st_mode & 0o777 != DIR_MODE:
            path.chmod(DIR_MODE)
    return path


def private_file(path: Path) -> Path:
    """`path`, 0600: an empty file created so when missing, narrowed when it exists."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, FILE_MODE)
    os.close(fd)
    if path.stat().st_mode & 0o777 != FILE_MODE:
        path.chmod(FILE_MODE)
    return path


def write_private(path: Path, text: str) -> None:
    """`text` as the whole of `path`, a file that is 0600 before any byte is in it."""
    private_file(path)
    path.write_text(text)
