"""vramkit.cupy: vramkit as CuPy's allocator, without a GPU.

CuPy is replaced by a stand-in module with the parts of its documented API the glue uses
(``cuda.set_allocator``/``get_allocator``, ``Device().id``, ``get_current_stream().ptr``,
``UnownedMemory(ptr, size, owner, device_id)`` keeping ``owner`` alive, ``MemoryPointer``),
and the requests are routed to a simulated device with ``install(device="sim:N")``. With CuPy
installed and a GPU present, tests/unit/test_cuda.py runs the real thing."""

from __future__ import annotations

import gc
import sys
import types

import pytest

import vramkit
import vramkit.cupy as vcupy

MiB = 1 << 20


class UnownedMemory:
    def __init__(self, ptr, size, owner, device_id=None):
        self.ptr, self.size, self.owner, self.device_id = ptr, size, owner, device_id


class MemoryPointer:
    def __init__(self, mem, offset):
        self.mem, self.ptr = mem, mem.ptr + offset


@pytest.fixture
def fake_cupy(monkeypatch):
    cuda = types.SimpleNamespace(allocator="cupy's pool", stream=types.SimpleNamespace(ptr=0))
    cuda.set_allocator = lambda fn: setattr(cuda, "allocator", fn)
    cuda.get_allocator = lambda: cuda.allocator
    cuda.Device = lambda: types.SimpleNamespace(id=0)
    cuda.get_current_stream = lambda: cuda.stream
    cuda.UnownedMemory, cuda.MemoryPointer = UnownedMemory, MemoryPointer
    module = types.ModuleType("cupy")
    module.cuda = cuda
    monkeypatch.setitem(sys.modules, "cupy", module)
    yield cuda
    vcupy.uninstall()


def test_arrays_memory_comes_from_vramkit_and_returns_when_cupy_drops_it(fake_cupy, sim):
    vcupy.install(device=sim)
    assert vcupy.is_installed() and fake_cupy.allocator is not None
    fake_cupy.stream.ptr = 7
    p = fake_cupy.allocator(3 * MiB)
    assert vramkit.memory_allocated(sim) == 3 * MiB
    assert vramkit._C.block_info(p.ptr)["stream"] == 7  # CuPy's current stream
    assert p.mem.size == 3 * MiB and p.mem.device_id == 0
    q = fake_cupy.allocator(1000)
    del p
    gc.collect()
    assert vramkit.memory_allocated(sim) == 1024  # the first block went back with its last reference
    del q
    gc.collect()
    assert vramkit.memory_allocated(sim) == 0
    vramkit.pool_check(sim)


def test_install_twice_is_a_no_op_and_uninstall_restores(fake_cupy, sim):
    vcupy.install(device=sim)
    ours = fake_cupy.allocator
    vcupy.install(device=sim)
    assert fake_cupy.allocator is ours
    with pytest.raises(ValueError, match="already installed for sim"):
        vcupy.install(device=vramkit.sim.create(MiB))
    vcupy.uninstall()
    assert fake_cupy.allocator == "cupy's pool" and not vcupy.is_installed()
    vcupy.uninstall()  # not installed: nothing to do
    with pytest.raises(ValueError, match="routes CuPy's requests to a simulated device"):
        vcupy.install(device="cpu")
    assert not vcupy.is_installed()


def test_out_of_memory_raises_and_leaks_nothing(fake_cupy):
    small = vramkit.sim.create(64 * MiB)
    vcupy.install(device=small)
    with pytest.raises(vramkit.OutOfMemoryError) as info:
        fake_cupy.allocator(100 * MiB)
    assert isinstance(info.value, MemoryError)  # as CuPy's own OutOfMemoryError is
    assert vramkit.memory_allocated(small) == 0
    zero = fake_cupy.allocator(0)  # CuPy asks for 0 bytes for empty arrays
    assert zero.ptr == 0
    vramkit.pool_check(small)
