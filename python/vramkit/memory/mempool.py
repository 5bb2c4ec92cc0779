"""Private pools: ``vramkit.MemPool`` and ``vramkit.use_mem_pool``, torch.cuda's names and signatures.

A ``MemPool`` is a pool of its own on a device: inside ``with vramkit.use_mem_pool(pool):`` the
current thread's allocations on that device (``raw_alloc``, ``vramkit.empty``, NumPy arrays on
``cpu``, torch tensors when vramkit is torch's CUDA allocator) come from it, and their memory
goes back to it when freed, wherever that happens. Its cache, counters, history and
``empty_cache`` are its own, so an inference cache, a KV cache or a dataset's pinned buffers can
be kept, measured and emptied apart from the training step's memory::

    kv = vramkit.MemPool(device="cuda:0")
    with vramkit.use_mem_pool(kv):
        cache = vramkit.empty((layers, 2, tokens, dim), "float16", "cuda:0")
    kv.memory_allocated(), kv.memory_reserved()      # the cache's own figures
    del cache; kv.empty_cache()                      # give back its memory; training's cache stays

A pool is named like a device, ``"cuda:0/mempool:1"`` (``pool.device``): every counter, summary,
snapshot and ``empty_cache`` function takes that name. The device's own figures
(``vramkit.memory_allocated("cuda:0")``) describe the device's pool, without its private pools;
``mem_get_info`` sees all of them, as the device does. A simulated device's private pools draw
on its capacity. Pools live as long as the process (memory from them may be freed at exit).

Differences from torch: ``allocator`` must be None (the pool is vramkit's), and ``use_on_oom``
and ``no_split`` are not supported yet (True raises ValueError).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from .. import _C
from .._core.devices import DeviceLike
from .api import memory_counters, memory_stats

__all__ = ["MemPool", "use_mem_pool"]


class MemPool:
    """A private pool on a device (torch.cuda.MemPool); see the module documentation."""

    def __init__(self, allocator: Any = None, use_on_oom: bool = False, no_split: bool = False, *,
                 device: DeviceLike = None) -> None:
        if allocator is not None:
            raise ValueError("vramkit.MemPool takes no allocator: its memory comes from vramkit's pool for the "
                             "device (allocator must be None)")
        if use_on_oom:
            raise ValueError("vramkit.MemPool(use_on_oom=True) is not supported yet: use_on_oom must be False")
        if no_split:
            raise ValueError("vramkit.MemPool(no_split=True) is not supported yet: no_split must be False")
        self._name: str = _C.mempool_create(device)

    @property
    def device(self) -> str:
        """The pool's name, which every device argument accepts: '<device>/mempool:N'."""
        return self._name

    @property
    def id(self) -> tuple[int, int]:
        """(0, N) for pool N: a tuple, as torch's MemPool.id is."""
        return (0, int(self._name.rpartition(":")[2]))

    @property
    def allocator(self) -> None:
        """None: the pool's memory is vramkit's (torch's MemPool.allocator is its custom allocator)."""
        return None

    def use_count(self) -> int:
        """1 for the pool itself plus one per use_mem_pool context now active on any thread, as torch counts."""
        return 1 + _C.mempool_use_count(self._name)

    def snapshot(self) -> dict[str, Any]:
        """The pool's own snapshot, in memory_snapshot()'s format."""
        return _C.memory_snapshot(self._name)

    def memory_stats(self) -> Any:
        return memory_stats(self._name)

    def memory_allocated(self) -> int:
        return memory_counters(self._name).allocated

    def max_memory_allocated(self) -> int:
        return memory_counters(self._name).peak_allocated

    def memory_reserved(self) -> int:
        return memory_counters(self._name).reserved

    def max_memory_reserved(self) -> int:
        return memory_counters(self._name).peak_reserved

    def memory_summary(self, abbreviated: bool = False) -> str:
        return _C.memory_summary(self._name, abbreviated)

    def empty_cache(self) -> int:
        """Give the pool's wholly free cached memory back to the device; returns the bytes released.
        The device's pool and other private pools keep theirs."""
        return _C.empty_cache(self._name)

    def __repr__(self) -> str:
        return (f"MemPool({self._name!r}, allocated={self.memory_allocated():,} B, "
                f"reserved={self.memory_reserved():,} B)")


def _base_device(name: str) -> str:
    return name.partition("/")[0]


@contextlib.contextmanager
def use_mem_pool(pool: MemPool, device: DeviceLike = None) -> Iterator[None]:
    """Route this thread's allocations on the pool's device to `pool` for the duration (torch's
    use_mem_pool). `device`, if given, must be the pool's device. Nested uses stack; memory
    allocated inside may be freed anywhere, and goes back to the pool."""
    if not isinstance(pool, MemPool):
        raise TypeError(f"use_mem_pool: pool must be a vramkit.MemPool, got {type(pool).__name__}")
    if device is not None:
        named = _C.canonical_device(device)
        if named != _base_device(pool.device):
            raise ValueError(f"use_mem_pool: the pool is on {_base_device(pool.device)}, not on {named}")
    _C.mempool_use(pool.device)
    try:
        yield
    finally:
        _C.mempool_unuse(pool.device)
