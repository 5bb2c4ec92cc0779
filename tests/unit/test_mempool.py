"""vramkit.MemPool and vramkit.use_mem_pool (issue 13): private pools on a device.

Every figure is worked out by hand from PyTorch's rounding (512 B blocks, 2 MiB small and
20 MiB large segments, large requests above 10 MiB in their own 2 MiB-rounded segments), and
every pool is checked by the pool checker afterwards.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest

import vramkit

MiB = 1 << 20


@pytest.fixture
def dev():
    device = vramkit.sim.create(100 * MiB)
    yield device
    vramkit.pool_check(device)


def check(*pools):
    for p in pools:
        vramkit.pool_check(p.device)


def test_allocations_inside_go_to_the_pool_and_come_back_to_it(dev):
    pool = vramkit.MemPool(device=dev)
    assert pool.device.startswith(f"{dev}/mempool:") and pool.id == (0, int(pool.device.rpartition(":")[2]))
    outside = vramkit.raw_alloc(3 * MiB, dev)
    with vramkit.use_mem_pool(pool):
        inside = vramkit.raw_alloc(5 * MiB, dev)
        buf = vramkit.empty(1000, device=dev)  # a Buffer: 1024 B in a 2 MiB small segment
    assert pool.memory_allocated() == 5 * MiB + 1024 and pool.memory_reserved() == 20 * MiB + 2 * MiB
    assert vramkit.memory_allocated(dev) == 3 * MiB and vramkit.memory_reserved(dev) == 20 * MiB
    assert vramkit.memory_allocated(pool.device) == pool.memory_allocated()  # the name works as a device
    free, total = vramkit.mem_get_info(dev)  # the device sees both pools
    assert (free, total) == (100 * MiB - 42 * MiB, 100 * MiB)
    vramkit.raw_free(inside)  # outside the context: back to the pool all the same
    del buf
    assert pool.memory_allocated() == 0 and pool.memory_reserved() == 22 * MiB
    vramkit.raw_free(outside)
    check(pool)


def test_the_pool_shares_the_device_capacity(dev):
    pool = vramkit.MemPool(device=dev)
    with vramkit.use_mem_pool(pool):
        held = vramkit.raw_alloc(60 * MiB, dev)
    before = vramkit.memory_stats(dev)
    with pytest.raises(vramkit.OutOfMemoryError) as info:
        vramkit.raw_alloc(50 * MiB, dev)
    assert "Tried to allocate 50.00 MiB" in str(info.value) and "of which 40.00 MiB is free" in str(info.value)
    assert vramkit.memory_stats(dev)["allocated_bytes.all.current"] == before["allocated_bytes.all.current"]
    vramkit.raw_free(held)
    pool.empty_cache()
    p = vramkit.raw_alloc(50 * MiB, dev)  # fits once the pool gave its memory back
    vramkit.raw_free(p)
    vramkit.empty_cache(dev)
    check(pool)


def test_empty_cache_of_one_pool_leaves_the_others(dev):
    pool = vramkit.MemPool(device=dev)
    p = vramkit.raw_alloc(30 * MiB, dev)
    with vramkit.use_mem_pool(pool):
        q = vramkit.raw_alloc(12 * MiB, dev)
    vramkit.raw_free(p)
    vramkit.raw_free(q)
    assert pool.empty_cache() == 12 * MiB and pool.memory_reserved() == 0
    assert vramkit.memory_reserved(dev) == 30 * MiB  # the device's cache is untouched
    assert vramkit.empty_cache(dev) == 30 * MiB
    check(pool)


def test_nested_uses_and_their_order(dev):
    a, b = vramkit.MemPool(device=dev), vramkit.MemPool(device=dev)
    other = vramkit.sim.create(100 * MiB)
    c = vramkit.MemPool(device=other)
    with vramkit.use_mem_pool(a):
        assert a.use_count() == 2 and b.use_count() == 1
        with vramkit.use_mem_pool(b), vramkit.use_mem_pool(c):
            x = vramkit.raw_alloc(1000, dev)    # the innermost use on dev: b
            y = vramkit.raw_alloc(1000, other)  # c, on its own device
        z = vramkit.raw_alloc(1000, dev)        # a again
    assert (a.memory_allocated(), b.memory_allocated(), c.memory_allocated()) == (1024, 1024, 1024)
    assert a.use_count() == b.use_count() == 1
    vramkit._C.mempool_use(a.device)
    vramkit._C.mempool_use(b.device)
    with pytest.raises(ValueError, match="not the innermost one in use on this thread"):
        vramkit._C.mempool_unuse(a.device)
    vramkit._C.mempool_unuse(b.device)  # nothing changed by the refused call: the order still holds
    vramkit._C.mempool_unuse(a.device)
    for p in (x, y, z):
        vramkit.raw_free(p)
    check(a, b, c)


def test_a_use_is_per_thread(dev):
    pool = vramkit.MemPool(device=dev)
    started, done = threading.Event(), threading.Event()
    seen = {}

    def other_thread():
        started.wait()
        seen["ptr"] = vramkit.raw_alloc(4096, dev)  # not inside this thread's use: the device's pool
        done.set()

    t = threading.Thread(target=other_thread)
    t.start()
    with vramkit.use_mem_pool(pool):
        started.set()
        done.wait()
        mine = vramkit.raw_alloc(4096, dev)
    t.join()
    assert vramkit.memory_allocated(dev) == 4096 and pool.memory_allocated() == 4096
    vramkit.raw_free(seen["ptr"])
    vramkit.raw_free(mine)
    check(pool)


def test_numpy_arrays_in_a_cpu_pool():
    import vramkit.numpy as vnp

    pool = vramkit.MemPool(device="cpu")
    was = vnp.is_installed()
    vnp.install()
    try:
        with vramkit.use_mem_pool(pool):
            a = np.arange(1 << 20, dtype=np.float64)  # 8 MiB
        assert pool.memory_allocated() == 8 * MiB
        b = np.arange(10, dtype=np.int64)
        b.resize(1 << 20, refcheck=False)  # realloc outside: moves within the cpu pool
        a.resize(2 << 20, refcheck=False)  # realloc of the pool's array outside: its old block goes back
        assert pool.memory_allocated() == 0
        assert a[: 1 << 20].sum() == (1 << 20) * ((1 << 20) - 1) // 2 and b[:10].sum() == 45
        del a, b
        assert pool.memory_allocated() == 0
    finally:
        if not was:
            vnp.uninstall()
    check(pool)


def test_history_and_snapshot_are_the_pools(dev):
    from vramkit.report.sites import allocation_sites

    pool = vramkit.MemPool(device=dev)
    vramkit.record_memory_history(True, device=pool.device)
    try:
        with vramkit.use_mem_pool(pool):
            p = vramkit.raw_alloc(3 * MiB, dev)
        snap = pool.snapshot()
        assert snap["vramkit_device"] == pool.device
        assert [s["total_size"] for s in snap["segments"]] == [20 * MiB]
        sites = allocation_sites(snap)
        assert sites and sites[0].live_at_peak == 3 * MiB and sites[0].label.startswith("test_mempool.py:")
        assert "vramkit memory summary, device " + pool.device in pool.memory_summary()
        vramkit.raw_free(p)
    finally:
        vramkit.record_memory_history(False, device=pool.device)
    check(pool)


def test_torch_hooks_allocate_from_the_pool_in_use():
    """vramkit as torch's allocator (hooks routed to a simulated device): tensors made inside
    use_mem_pool come from the pool, and torch's frees find it."""
    from vramkit.torch import allocator as ta

    lib = ta.hooks()
    dev = vramkit.sim.create(256 * MiB)
    assert lib.vram_torch_route(dev.encode()) == 0
    try:
        pool = vramkit.MemPool(device=dev)
        with vramkit.use_mem_pool(pool):
            p = lib.vramkit_torch_malloc(6 * MiB, 0, None)
        q = lib.vramkit_torch_malloc(MiB, 0, None)
        assert pool.memory_allocated() == 6 * MiB and vramkit.memory_allocated(dev) == MiB
        lib.vramkit_torch_free(p, 6 * MiB, 0, None)
        lib.vramkit_torch_free(q, MiB, 0, None)
        assert pool.memory_allocated() == 0 and vramkit.memory_allocated(dev) == 0
    finally:
        assert lib.vram_torch_route(b"cuda") == 0
    check(pool)


def test_bad_input(dev):
    with pytest.raises(ValueError, match="allocator must be None"):
        vramkit.MemPool(object(), device=dev)
    with pytest.raises(ValueError, match="use_on_oom must be False"):
        vramkit.MemPool(use_on_oom=True, device=dev)
    with pytest.raises(ValueError, match="no_split must be False"):
        vramkit.MemPool(no_split=True, device=dev)
    with pytest.raises(TypeError, match="pool must be a vramkit.MemPool"):
        with vramkit.use_mem_pool(dev):
            pass
    pool = vramkit.MemPool(device=dev)
    other = vramkit.sim.create(MiB)
    with pytest.raises(ValueError, match=f"the pool is on {dev}, not on {other}"):
        with vramkit.use_mem_pool(pool, device=other):
            pass
    assert pool.use_count() == 1
    with pytest.raises(ValueError, match="private pool 999 does not exist"):
        vramkit.memory_allocated(f"{dev}/mempool:999")
    with pytest.raises(ValueError, match="on another device"):
        vramkit.memory_allocated(f"{other}/mempool:{pool.id[1]}")
    with pytest.raises(ValueError, match="not on another private pool"):
        vramkit._C.mempool_create(pool.device)
    with pytest.raises(ValueError, match="unknown device"):
        vramkit.memory_allocated(f"{dev}/mempool:x")
    check(pool)


def test_torch_signatures():
    torch = pytest.importorskip("torch")
    import inspect

    theirs = inspect.signature(torch.cuda.memory.MemPool.__init__)
    ours = inspect.signature(vramkit.MemPool.__init__)
    assert list(theirs.parameters)[:4] == list(ours.parameters)[:4]
    assert [p.default for p in theirs.parameters.values()][1:] == [p.default for p in ours.parameters.values()][1:4]
    assert list(inspect.signature(torch.cuda.memory.use_mem_pool).parameters) == \
        list(inspect.signature(vramkit.use_mem_pool).parameters)


def test_ctypes_free_of_a_pool_pointer_through_raw_free(dev):
    """raw_free finds a private pool's pointer without being told the pool."""
    pool = vramkit.MemPool(device=dev)
    with vramkit.use_mem_pool(pool):
        p = vramkit.raw_alloc(MiB, dev)
    assert ctypes.c_void_p(p).value == p
    vramkit.raw_free(p)
    assert pool.memory_allocated() == 0
    with pytest.raises(ValueError, match="not a live allocation"):
        vramkit.raw_free(p)
    check(pool)


def test_a_private_pools_buffer_is_usable_as_its_devices():
    """A Buffer from a cpu private pool is host memory like any cpu Buffer: NumPy views it and
    the loss-scaling kernels unscale it (its device names the pool, the kernels see cpu)."""
    pool = vramkit.MemPool(device="cpu")
    with vramkit.use_mem_pool(pool):
        b = vramkit.empty((4,), "float32", "cpu")
    assert b.device == pool.device
    np.asarray(b)[:] = 4.0
    assert vramkit.amp.unscale_([b], 0.5) is False
    assert np.asarray(b).tolist() == [2.0, 2.0, 2.0, 2.0]
    del b
    assert pool.memory_allocated() == 0
    check(pool)
