"""Writing report files so that a failure never leaves a partial one behind.

Each file is written to a temporary name in the target's directory and renamed over the target
only once complete (a rename within one filesystem is atomic): a full disk, a permission error
or an exception while writing leaves the old file, if any, and no temporary.
"""

from __future__ import annotations

import os
import tempfile

__all__ = ["write_atomically"]


def write_atomically(path: str | os.PathLike[str], data: bytes) -> str:
    """Write `data` to `path` through a temporary file and a rename; returns the path. Raises
    the OSError of the failing step (the directory is missing or read-only, the disk is full)."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)[:40]}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp makes it private (0600); a report is an ordinary file
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path
