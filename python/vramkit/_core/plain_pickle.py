"""Read a pickle that may come from anyone, without running code from it.

Memory snapshots (``torch.cuda.memory._dump_snapshot()``, ``vramkit.dump_snapshot()``) are
pickles of plain data: dicts, lists, tuples, strings, bytes, numbers, ``None`` and booleans.
Every one of those has its own pickle opcode from protocol 2 on. Python's unpickler trusts its
input twice over, so two checks run before and during the unpickling:

* ``vram_plain_pickle_check`` (C, csrc/util/plain_pickle.c) walks every opcode first. It refuses
  any opcode that names, calls or builds an object (the way a pickle runs code) and any length
  or memo index the data cannot back: CPython allocates a ``bytes`` of the length BINBYTES8
  declares before reading it, and zero-fills a memo table twice as long as the largest PUT
  index, so ten bytes could otherwise ask for an exabyte or write 32 GiB.
* The unpickler below refuses every class or function reference in ``find_class``, the one
  door through which a callable reaches the unpickler's stack: the second line, should the
  first ever miss an opcode.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

from .. import _C

__all__ = ["UnsafePickleError", "loads_plain"]


class UnsafePickleError(pickle.UnpicklingError):
    """The pickle names a class or function: vramkit reads only plain data from files."""


class _PlainDataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise UnsafePickleError(f"this snapshot pickle contains a class reference ({module}.{name}); vramkit reads "
                                "only plain data (dicts, lists, strings, numbers) from a file: refusing")


def loads_plain(data: bytes) -> Any:
    """Unpickle `data`: ``UnsafePickleError`` if it names any class or function,
    ``pickle.UnpicklingError`` if it is malformed (with the opcode and byte offset)."""
    problem = _C.plain_pickle_problem(data)
    if problem is not None:
        names_code, message = problem
        raise (UnsafePickleError if names_code else pickle.UnpicklingError)(message)
    return _PlainDataUnpickler(io.BytesIO(data)).load()
