"""vramkit.Buffer: shapes and dtypes, zero-copy NumPy and DLPack views, memory returning to
the cache when the last view dies, and clear refusals for memory that is not host memory."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import vramkit


def test_bytes_by_default_and_typed_shapes():
    b = vramkit.empty(1000)
    assert (b.nbytes, b.shape, b.typestr, b.dtype, b.device) == (1000, (1000,), "|u1", np.dtype(np.uint8), "cpu")
    t = vramkit.empty((3, 5), dtype=np.float32, device="cpu")
    assert (t.nbytes, t.shape, t.dtype) == (60, (3, 5), np.dtype("float32"))
    assert t.ptr % 512 == 0
    assert "vramkit.Buffer(ptr=0x" in repr(t) and "shape=(3, 5)" in repr(t) and "'<f4'" in repr(t)
    assert vramkit.empty(7, dtype="int16").shape == (7,)


def test_numpy_view_is_zero_copy_and_writable():
    t = vramkit.empty((4, 6), dtype=np.float64)
    a = np.asarray(t)
    assert a.shape == (4, 6) and a.dtype == np.float64
    assert a.__array_interface__["data"][0] == t.ptr
    a[:] = np.arange(24).reshape(4, 6)
    again = np.asarray(t)
    np.testing.assert_array_equal(again, np.arange(24).reshape(4, 6))
    mv = memoryview(t)
    assert mv.format == "d" and mv.shape == (4, 6) and not mv.readonly
    assert np.array(t).sum() == sum(range(24))  # __array__ path


def test_memory_returns_when_the_last_view_dies():
    before = vramkit.memory_allocated("cpu")
    t = vramkit.empty(1 << 20, dtype=np.uint8)
    view = np.asarray(t)
    del t
    gc.collect()
    assert vramkit.memory_allocated("cpu") == before + (1 << 20)  # the NumPy view keeps it alive
    del view
    gc.collect()
    assert vramkit.memory_allocated("cpu") == before


def test_dlpack_into_numpy_and_torch():
    t = vramkit.empty(16, dtype=np.int32)
    assert t.__dlpack_device__() == (1, 0)
    a = np.from_dlpack(t)
    a[:] = np.arange(16)
    assert a.__array_interface__["data"][0] == t.ptr
    before = vramkit.memory_allocated("cpu")
    del t
    gc.collect()
    assert vramkit.memory_allocated("cpu") == before  # the capsule's owner reference keeps it alive
    np.testing.assert_array_equal(a, np.arange(16))
    del a
    gc.collect()
    assert vramkit.memory_allocated("cpu") == before - 512

    torch = pytest.importorskip("torch")
    f = vramkit.empty((2, 3), dtype=np.float32)
    x = torch.from_dlpack(f)
    assert x.shape == (2, 3) and x.dtype == torch.float32 and x.data_ptr() == f.ptr
    x.fill_(2.5)
    assert np.asarray(f).sum() == 15.0
    u = torch.from_dlpack(vramkit.empty(8))  # uint8 bytes
    assert u.dtype == torch.uint8 and u.numel() == 8


def test_versioned_and_legacy_capsules():
    t = vramkit.empty(4, dtype=np.float16)
    legacy = t.__dlpack__()
    versioned = t.__dlpack__(max_version=(1, 0))
    assert "dltensor" in repr(legacy) and "dltensor_versioned" in repr(versioned)
    del legacy, versioned  # unconsumed capsules release their reference
    gc.collect()
    with pytest.raises(BufferError, match="copy=True is not supported"):
        t.__dlpack__(copy=True)
    with pytest.raises(BufferError, match="its own device"):
        t.__dlpack__(dl_device=(2, 0))


def test_sim_buffers_refuse_data_access(sim):
    b = vramkit.empty(4096, device=sim)
    assert b.device == sim and b.ptr != 0
    with pytest.raises(TypeError, match="simulated device has addresses but no memory"):
        memoryview(b)
    with pytest.raises(TypeError, match="simulated device"):
        np.asarray(b)
    with pytest.raises(TypeError, match="simulated device"):
        b.__dlpack__()
    with pytest.raises(TypeError, match="simulated device"):
        b.__dlpack_device__()
    assert not hasattr(b, "__cuda_array_interface__")
    assert vramkit.memory_allocated(sim) == 4096
    del b
    assert vramkit.memory_allocated(sim) == 0
    vramkit.pool_check(sim)


def test_host_buffers_have_no_cuda_interface():
    b = vramkit.empty(8)
    assert not hasattr(b, "__cuda_array_interface__")
    with pytest.raises(AttributeError, match="only for CUDA buffers"):
        b.__cuda_array_interface__


def test_bad_shapes_and_dtypes(sim):
    before = vramkit.memory_stats(sim)
    with pytest.raises(ValueError, match="non-negative"):
        vramkit.empty((2, -1), device=sim)
    with pytest.raises(TypeError, match="int or a sequence of ints"):
        vramkit.empty(2.0, device=sim)
    with pytest.raises(TypeError, match="shape entries must be ints"):
        vramkit.empty((2, 1.5), device=sim)
    with pytest.raises(TypeError, match="dtype must be a boolean, integer, floating or complex"):
        vramkit.empty(3, dtype=object, device=sim)
    with pytest.raises(ValueError, match="absurd"):
        vramkit.empty((1 << 40, 1 << 30), dtype=np.float64, device=sim)
    assert vramkit.memory_stats(sim) == before


def test_dropping_a_capsule_keeps_an_exception_in_flight():
    b = vramkit.empty(8)

    def consume(*args):
        return args

    with pytest.raises(ZeroDivisionError):
        consume(b.__dlpack__(), 1 / 0)  # the capsule dies while the ZeroDivisionError propagates
