"""Simulated devices: an allocator with any capacity that hands out addresses but no memory,
to study fragmentation or replay a training run's allocations on a laptop."""

from __future__ import annotations

from . import _C


def create(total_bytes: int) -> str:
    """Create a simulated device of `total_bytes` capacity and return its name, 'sim:N'.

    It follows the same allocator policy and counters as a real device; its Buffers refuse
    data access (there is no memory behind the addresses).
    """
    return _C.sim_create(total_bytes)


def count() -> int:
    """How many simulated devices exist."""
    return _C.sim_count()
