"""clear_cache(): gc.collect() + empty_cache() on entry and exit, with a report."""

from __future__ import annotations

import pytest

import vramkit

MiB = 1 << 20


class Model:
    """Holds device memory until garbage collected, like a model's parameters."""

    def __init__(self, device, sizes):
        self.buffers = [vramkit.empty(n, device=device) for n in sizes]
        self.cycle = self  # only the cyclic garbage collector can free it


def test_reports_what_was_freed(sim):
    model = Model(sim, [30 * MiB, 12 * MiB, 4000])
    allocated, reserved = vramkit.memory_allocated(sim), vramkit.memory_reserved(sim)
    with vramkit.clear_cache(sim) as r:
        del model  # a reference cycle: nothing is freed until gc runs on exit
    assert (r.allocated_before, r.reserved_before) == (allocated, reserved)
    assert r.allocated_after == 0 and r.reserved_after == 0
    assert r.freed_bytes == reserved  # every segment went back to the device
    assert r.collected_objects >= 1 and r.device == sim
    assert "clear_cache(" in str(r) and "freed" in str(r)


def test_entry_releases_cache_left_by_earlier_work(sim):
    vramkit.raw_free(vramkit.raw_alloc(40 * MiB, sim))
    with vramkit.clear_cache(sim) as r:
        assert vramkit.memory_reserved(sim) == 0  # released on entry already
    assert r.freed_bytes == 40 * MiB and r.reserved_before == 40 * MiB


def test_cleanup_runs_when_the_block_raises(sim):
    model = Model(sim, [8 * MiB])
    with pytest.raises(KeyError):
        with vramkit.clear_cache(sim) as r:
            del model
            raise KeyError("boom")
    assert r.allocated_after == 0 and r.freed_bytes == 20 * MiB


def test_works_as_a_decorator(sim):
    @vramkit.clear_cache(sim)
    def step():
        Model(sim, [3 * MiB])

    step()
    assert vramkit.memory_reserved(sim) == 0
