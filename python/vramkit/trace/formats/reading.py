"""``load``: a trace from a file, whichever of the two formats it holds (``.vktrace`` or a
PyTorch memory snapshot pickle), told apart by its first bytes."""

from __future__ import annotations

import os

from .file_format import MAGIC, Trace, TraceFormatError
from .snapshot_import import from_torch_snapshot

__all__ = ["load"]


def load(path: str | os.PathLike[str]) -> Trace:
    """Read a ``.vktrace`` file or a PyTorch memory snapshot pickle (``_dump_snapshot``), told
    apart by their first bytes, never by their name.

    Nothing in the file runs: a snapshot pickle is read as plain data, and one that names any
    class or function (the way a pickle runs code) is refused; a file named ``*.vktrace`` is
    read only as a ``.vktrace``, so a pickle renamed to look like one is refused too. Every
    malformed file is a ``TraceFormatError`` saying what is wrong and where; a path that cannot
    be read raises the OSError Python gives (FileNotFoundError, IsADirectoryError, ...)."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        head = f.read(8)
    if head == MAGIC:
        return Trace.load(path)
    if path.lower().endswith(".vktrace"):
        kind = "a pickle" if head[:1] == b"\x80" else f"no .vktrace (it starts with {head!r})"
        raise TraceFormatError(f"{path}: named .vktrace but holds {kind}; vramkit reads a .vktrace only as one "
                               "(a snapshot pickle must not be named .vktrace)")
    if head[:1] == b"\x80":  # a pickle, protocol 2 or later, as torch and vramkit write snapshots
        return from_torch_snapshot(path)
    raise TraceFormatError(f"{path}: neither a .vktrace file nor a snapshot pickle (it starts with {head!r})")
