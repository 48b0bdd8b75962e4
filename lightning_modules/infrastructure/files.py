"""Files that appear whole or not at all, and their hashes: shared infrastructure below every layer
that writes outputs (cohorts and their metadata, splits, run folders, inference, synthesis).

A write goes to a temporary file beside its target, is flushed to disk and renamed over the target
with ``os.replace`` (atomic on one file system), so an interrupted run leaves the old file or the new
one, never half of one; the new file gets the permissions a plainly created one would have.

Example::

    atomic_write_csv(table, out / "predictions.csv")
    digest = file_sha256("splits/phantom.csv")
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def umask() -> int:
    """The process' file-creation mask (read without changing it)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def publish_mode(path: Path | str, directory: bool = False) -> None:
    """Give a temp file/folder the permissions a plainly created one would have (mkstemp uses 0600/0700)."""
    os.chmod(path, (0o777 if directory else 0o666) & ~umask())


@contextmanager
def atomic_target(path: Path | str, suffix: str = ".tmp") -> Iterator[str]:
    """Yield a temporary path beside ``path``; on success it replaces ``path`` (with normal
    permissions), on any error it is removed, so readers never see a partial file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    os.close(fd)
    try:
        yield tmp
        publish_mode(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: Path | str, data: bytes) -> None:
    """Write ``data`` to ``path`` whole or not at all."""
    with atomic_target(path) as tmp:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())


def atomic_write_csv(table, path: Path | str) -> None:
    """Write a pandas table as CSV (no index) whole or not at all."""
    atomic_write_bytes(Path(path), table.to_csv(index=False).encode())


def file_sha256(path: Path | str) -> str:
    """The file's SHA-256, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
