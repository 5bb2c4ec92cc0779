"""Read a pickle that may come from anyone, without running code from it.

Memory snapshots (``torch.cuda.memory._dump_snapshot()``, ``vramkit.dump_snapshot()``) are
pickles of plain data: dicts, lists, tuples, strings, bytes, numbers, ``None`` and booleans.
Every one of those has its own pickle opcode from protocol 2 on. Running code from a pickle
needs a callable on the unpickler's stack, and the only way to put one there is a class or
function reference (the GLOBAL / STACK_GLOBAL / EXT opcodes), which the unpickler resolves
through ``find_class``. This unpickler refuses every such reference, so nothing in the file can
be called; persistent ids and out-of-band buffers are refused by the standard unpickler already
(no ``persistent_load``, no ``buffers``).

The file is read whole (its size is the caller's to bound) and unpickled from memory, where
CPython checks each opcode's length against the bytes that are left before it allocates, so
a few bytes cannot ask for gigabytes.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

__all__ = ["UnsafePickleError", "loads_plain"]


class UnsafePickleError(pickle.UnpicklingError):
    """The pickle names a class or function: vramkit reads only plain data from files."""


class _PlainDataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise UnsafePickleError(f"this snapshot pickle contains a class reference ({module}.{name}); vramkit reads "
                                "only plain data (dicts, lists, strings, numbers) from a file: refusing")


def loads_plain(data: bytes) -> Any:
    """Unpickle `data`, refusing any class or function reference (``UnsafePickleError``)."""
    return _PlainDataUnpickler(io.BytesIO(data)).load()
