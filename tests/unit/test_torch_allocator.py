"""vramkit as PyTorch's CUDA allocator (issue 11, part 1), without a GPU.

The hooks torch's CUDAPluggableAllocator calls are loaded with ctypes, as torch loads them,
and routed to a simulated device with the documented test switch (vram_torch_route). The
Python glue (use_as_cuda_allocator) runs against this CPU build of torch with its CUDA entry
points replaced by fakes that do what torch's do with the library: load it with ctypes and
look the two names up. What only a GPU can show (a torch training loop on vramkit's memory)
is in tests/unit/test_cuda.py."""

from __future__ import annotations

import ctypes

import pytest

import vramkit
from vramkit.torch import allocator as ta

MiB = 1 << 20


def vtorch():
    pytest.importorskip("torch")
    import vramkit.torch

    return vramkit.torch


@pytest.fixture
def lib():
    hooks = ta.hooks()
    yield hooks
    assert hooks.vram_torch_route(b"cuda") == 0


@pytest.fixture
def routed(lib):
    device = vramkit.sim.create(256 * MiB)
    assert lib.vram_torch_route(device.encode()) == 0
    return device


def test_hooks_allocate_from_the_routed_pool(lib, routed):
    p = lib.vramkit_torch_malloc(1000, 0, None)
    q = lib.vramkit_torch_malloc(3 * MiB, 0, ctypes.c_void_p(5))  # another stream
    assert vramkit.memory_allocated(routed) == 1024 + 3 * MiB
    info = vramkit._C.block_info(q)
    assert info["stream"] == 5 and info["requested_size"] == 3 * MiB
    assert lib.vramkit_torch_malloc(0, 0, None) is None  # torch's own allocator gives NULL for 0 bytes too
    lib.vramkit_torch_free(p, 1000, 0, None)
    lib.vramkit_torch_free(q, 3 * MiB, 0, ctypes.c_void_p(5))
    assert vramkit.memory_allocated(routed) == 0
    vramkit.pool_check(routed)


def test_history_names_the_python_line_that_asked_torch_for_memory(lib, routed):
    """torch calls the hooks with the GIL released (ctypes does too); the history still records
    the caller's Python stack, as torch's own history does (seen missing on an H200: every
    allocation of `vramkit run --allocator vramkit` was "allocated before the recorded history")."""
    import threading

    def weights():
        return lib.vramkit_torch_malloc(2 * MiB, 0, None)

    vramkit.record_memory_history(True, device=routed)
    try:
        p = weights()
        box = []
        worker = threading.Thread(target=lambda: box.append(weights()))  # another Python thread
        worker.start()
        worker.join()
        snap = vramkit.memory_snapshot(routed)
    finally:
        vramkit.record_memory_history(False, device=routed)
    allocs = [e for e in snap["device_traces"][-1] if e["action"] == "alloc"]
    assert len(allocs) == 2
    for e in allocs:
        assert e["frames"] and e["frames"][0]["name"] == "weights", e["frames"]
        assert e["frames"][0]["filename"] == __file__
    lib.vramkit_torch_free(p, 2 * MiB, 0, None)
    lib.vramkit_torch_free(box[0], 2 * MiB, 0, None)
    vramkit.pool_check(routed)


def test_torch_own_out_of_memory_error_is_not_vramkit_s():
    """torch's caching allocator raises torch.OutOfMemoryError with a message that reads like
    vramkit's; only vramkit's pool's (a plain RuntimeError through the pluggable allocator) counts."""
    torch = pytest.importorskip("torch")
    message = "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79.10 GiB"
    assert ta.is_vramkit_out_of_memory(RuntimeError(message))
    assert not ta.is_vramkit_out_of_memory(torch.OutOfMemoryError(message))
    assert not ta.is_vramkit_out_of_memory(MemoryError(message))


def test_out_of_memory_is_a_status_not_a_null(lib, routed):
    out = ctypes.c_void_p()
    before = vramkit.memory_stats(routed)
    assert lib.vram_torch_malloc(300 * MiB, 0, None, ctypes.byref(out)) == 2  # VRAM_ERR_OOM
    assert out.value is None
    message = lib.vram_last_error().decode()
    assert message.startswith(f"{routed} out of memory. Tried to allocate 300.00 MiB.")
    assert ta.is_vramkit_out_of_memory(RuntimeError(message))
    assert not ta.is_vramkit_out_of_memory(RuntimeError("shape mismatch"))
    after = vramkit.memory_stats(routed)
    assert after["num_ooms"] == before["num_ooms"] + 1 and after["allocated_bytes.all.current"] == 0
    assert lib.vram_torch_malloc(-1, 0, None, ctypes.byref(out)) == 1  # VRAM_ERR_INVALID_ARG
    assert "sizes must be >= 0" in lib.vram_last_error().decode()


def test_foreign_pointers_are_ignored_and_counted(lib, routed):
    before = lib.vram_torch_stray_frees()
    lib.vramkit_torch_free(0x1234, 16, 0, None)
    lib.vramkit_torch_free(None, 0, 0, None)  # NULL: nothing at all
    assert lib.vram_torch_stray_frees() == before + 1
    p = lib.vramkit_torch_malloc(4096, 0, None)
    lib.vramkit_torch_free(p, 4096, 0, None)
    lib.vramkit_torch_free(p, 4096, 0, None)  # a double free from torch's side: ignored too
    assert lib.vram_torch_stray_frees() == before + 2
    vramkit.pool_check(routed)


def test_route_refuses_what_is_not_a_gpu_stand_in(lib):
    assert lib.vram_torch_route(b"cpu") == 1
    assert 'takes "cuda" (the real devices) or a simulated device "sim:N"' in lib.vram_last_error().decode()
    assert lib.vram_torch_route(b"sim:100000") == 1


def test_base_alloc_and_fraction_hooks(lib, routed):
    p = lib.vramkit_torch_malloc(5 * MiB, 0, None)
    size = ctypes.c_size_t()
    base = lib.vramkit_torch_base_alloc(p, ctypes.byref(size))
    assert base == p and size.value == 20 * MiB  # the 20 MiB segment it was carved from
    lib.vramkit_torch_set_memory_fraction(0.05, 0)
    out = ctypes.c_void_p()
    assert lib.vram_torch_malloc(20 * MiB, 0, None, ctypes.byref(out)) == 2
    assert "allowed" in lib.vram_last_error().decode()
    lib.vramkit_torch_set_memory_fraction(1.0, 0)
    lib.vramkit_torch_free(p, 5 * MiB, 0, None)


class FakePluggable:
    """What torch's CUDAPluggableAllocator does with the library: ctypes-load it and look up
    the two functions (torch then hands their addresses to C++)."""

    def __init__(self, path, alloc_fn_name, free_fn_name):
        library = ctypes.CDLL(path)
        self.path, self.names = path, (alloc_fn_name, free_fn_name)
        self.addresses = [ctypes.cast(getattr(library, n), ctypes.c_void_p).value for n in self.names]


@pytest.fixture
def fake_cuda_torch(monkeypatch):
    torch = pytest.importorskip("torch")
    swapped = []
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda.memory, "CUDAPluggableAllocator", FakePluggable)
    monkeypatch.setattr(torch.cuda.memory, "change_current_allocator", swapped.append)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)  # torch's own: no-op here
    yield torch, swapped
    ta._restore_python_wrappers()


def test_use_as_cuda_allocator_hands_torch_the_hooks(fake_cuda_torch, lib, routed):
    torch, swapped = fake_cuda_torch
    allocator = vtorch().use_as_cuda_allocator()
    assert swapped == [allocator] and ta.is_installed()
    assert allocator.path == vramkit._C.__file__
    assert allocator.names == ("vramkit_torch_malloc", "vramkit_torch_free") and all(allocator.addresses)
    assert vtorch().use_as_cuda_allocator() is allocator and swapped == [allocator]  # twice: a no-op

    # torch.cuda.empty_cache() now also empties vramkit's pool.
    p = lib.vramkit_torch_malloc(30 * MiB, 0, None)
    lib.vramkit_torch_free(p, 30 * MiB, 0, None)
    assert vramkit.memory_reserved(routed) == 30 * MiB
    torch.cuda.empty_cache()
    assert vramkit.memory_reserved(routed) == 0

    # Tensor.record_stream now also holds vramkit's block until the stream is done.
    class Storage:
        def __init__(self, ptr):
            self.ptr = ptr

        def data_ptr(self):
            return self.ptr

    class FakeCudaTensor:
        is_cuda = True

        def __init__(self, ptr):
            self.storage = Storage(ptr)

        def untyped_storage(self):
            return self.storage

    class Stream:
        cuda_stream = 9

    p = lib.vramkit_torch_malloc(MiB, 0, None)
    torch.Tensor.record_stream(FakeCudaTensor(p), Stream())
    lib.vramkit_torch_free(p, MiB, 0, None)
    q = lib.vramkit_torch_malloc(MiB, 0, None)
    assert q != p  # p waits for stream 9
    vramkit.synchronize(routed, 9)
    lib.vramkit_torch_free(q, MiB, 0, None)
    vramkit.pool_check(routed)


def test_use_as_cuda_allocator_after_cuda_started_names_the_rule(fake_cuda_torch, monkeypatch):
    torch, swapped = fake_cuda_torch
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="must run before torch initializes CUDA"):
        vtorch().use_as_cuda_allocator()
    assert swapped == [] and not ta.is_installed()


def test_use_as_cuda_allocator_needs_cuda_torch():
    torch = pytest.importorskip("torch")
    if torch.backends.cuda.is_built():
        pytest.skip("this torch has CUDA")
    with pytest.raises(RuntimeError, match="needs a CUDA build of PyTorch"):
        vtorch().use_as_cuda_allocator()
    assert not ta.is_installed()


def test_inside_use_mem_pool_the_hooks_allocate_from_the_private_pool(lib, routed):
    """The hooks find the device's pool without a lock (issue 35); a thread inside
    use_mem_pool must still get its private pool, and the device's pool again after."""
    pool = vramkit.MemPool(device=routed)
    strays = lib.vram_torch_stray_frees()
    with vramkit.use_mem_pool(pool):
        p = lib.vramkit_torch_malloc(2 * MiB, 0, None)
    q = lib.vramkit_torch_malloc(2 * MiB, 0, None)
    assert pool.memory_allocated() == 2 * MiB
    assert vramkit.memory_allocated(routed) == 2 * MiB  # q only: p is the private pool's
    lib.vramkit_torch_free(p, 2 * MiB, 0, None)  # freed outside the block: back to the private pool
    lib.vramkit_torch_free(q, 2 * MiB, 0, None)
    assert pool.memory_allocated() == 0 and vramkit.memory_allocated(routed) == 0
    assert lib.vram_torch_stray_frees() == strays
    vramkit.pool_check(routed)
