"""Route NumPy array memory through vramkit's cpu pool (NumPy's NEP 49 handler API).

    import vramkit.numpy
    vramkit.numpy.install()          # arrays created from now on use the cpu pool
    a = np.empty(10_000_000)         # vramkit.memory_allocated("cpu") grows by 80 MB
    del a                            # ...and shrinks again; the pages stay cached

    with vramkit.numpy.caching():    # or only inside a block
        ...

NumPy keeps the handler per context (per thread, per asyncio task): install() affects the
calling thread and contexts created from it afterwards, not threads already running. Each
array keeps the handler it was made with, so arrays made while installed return to the pool
even after uninstall(), and freeing them at interpreter exit is safe.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from . import _C

HANDLER_NAME = "vramkit_cpu_pool"
_previous: list[Any] = []  # handlers replaced by install(), most recent last


def _handler_name(array: Any = None) -> str | None:
    import numpy as np

    try:
        from numpy._core.multiarray import get_handler_name
    except ImportError:  # NumPy < 2
        from numpy.core.multiarray import get_handler_name  # type: ignore[no-redef]  # same function, old home
    return get_handler_name(array) if array is not None else get_handler_name()


def is_installed() -> bool:
    """Whether new arrays in this context are allocated by vramkit."""
    return _handler_name() == HANDLER_NAME


def uses_vramkit(array: Any) -> bool:
    """Whether an array's memory came from vramkit's pool (False for views of other memory)."""
    import numpy as np

    base = array
    while isinstance(base, np.ndarray) and base.base is not None and not base.flags.owndata:
        base = base.base
    return isinstance(base, np.ndarray) and _handler_name(base) == HANDLER_NAME


def install() -> None:
    """Make vramkit's cpu pool NumPy's data allocator in this context (idempotent)."""
    if is_installed():
        return
    _previous.append(_C.numpy_set_handler(None))


def uninstall() -> None:
    """Restore the allocator that install() replaced (NumPy's default if none)."""
    if not is_installed():
        return
    previous = _previous.pop() if _previous else _C.numpy_get_handler()
    _C.numpy_set_handler(previous)


@contextlib.contextmanager
def caching() -> Iterator[None]:
    """Use vramkit's cpu pool for NumPy arrays created inside the block."""
    previous = _C.numpy_set_handler(None)
    try:
        yield
    finally:
        _C.numpy_set_handler(previous)
