"""Turn gradient arrays of any family into what the C kernels take.

Accepted: NumPy arrays (float16/32/64, and bfloat16 from ml_dtypes), torch tensors (CPU and
CUDA), CuPy arrays and other objects with ``__cuda_array_interface__``, vramkit Buffers, and
any object with ``__dlpack__``. Each becomes a ``Ref``: data pointer, element count, dtype
code, device and family; a tensor that is not dense (``x[:, ::2]``) also carries its shape and
strides, and goes to the strided kernels, which update it in place (no copy). Everything is checked before any kernel runs, so a bad list
changes nothing; errors name the offending tensor's index.
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple, Sequence

from .. import _C

FLOAT32, FLOAT16, BFLOAT16, FLOAT64 = 0, 1, 2, 3
DTYPE_NAMES = {FLOAT32: "float32", FLOAT16: "float16", BFLOAT16: "bfloat16", FLOAT64: "float64"}
_CODE_BY_NAME = {name: code for code, name in DTYPE_NAMES.items()}
_ITEMSIZE = {FLOAT32: 4, FLOAT16: 2, BFLOAT16: 2, FLOAT64: 8}
_TYPESTR = {"<f4": FLOAT32, "<f2": FLOAT16, "<f8": FLOAT64, "=f4": FLOAT32, "=f2": FLOAT16, "=f8": FLOAT64}
_ALLOWED = "float16, bfloat16, float32 or float64"
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13
_NPY_C_CONTIGUOUS, _NPY_F_CONTIGUOUS, _NPY_WRITEABLE = 0x1, 0x2, 0x400  # NumPy's NPY_ARRAY_* flag bits


class Ref(NamedTuple):
    ptr: int
    numel: int
    dtype: int
    device: str  # "cpu" or "cuda:N"
    family: str  # "numpy", "torch", "cupy", "vramkit", "dlpack", "cuda_array_interface"
    stream: int | None  # a CUDA stream the data is ordered on, when the producer says so
    # Only for tensors that are not dense: shape and strides in elements (None: dense, ptr..numel).
    shape: tuple[int, ...] | None = None
    strides: tuple[int, ...] | None = None


def _is_dense(shape: Sequence[int], strides: Sequence[int] | None) -> bool:
    """True if the elements fill one contiguous range (any dimension order), strides in elements."""
    if strides is None:
        return True
    dims = sorted((abs(st), n) for n, st in zip(shape, strides) if n != 1)
    expected = 1
    for st, n in dims:
        if n == 0:
            return True
        if st != expected:
            return False
        expected *= n
    return True


def _prod(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _torch_ref(t: Any, i: int) -> Ref:
    torch = sys.modules["torch"]
    code = _TORCH_CODES(torch).get(t.dtype)
    if code is None:
        raise TypeError(f"tensor {i}: dtype {t.dtype} cannot be unscaled (allowed: {_ALLOWED})")
    if t.layout != torch.strided:
        raise TypeError(f"tensor {i}: {t.layout} tensors are not supported here (allowed: strided tensors); "
                        "GradScaler unscales sparse COO gradients through their _values(), or pass t._values()")
    dev = t.device
    if dev.type == "cpu":
        device = "cpu"
    elif dev.type == "cuda":
        device = f"cuda:{dev.index if dev.index is not None else torch.cuda.current_device()}"
    else:
        raise ValueError(f"tensor {i}: device {dev} is not supported (allowed: cpu, cuda)")
    strides = t.stride()
    if not _is_dense(t.shape, strides):
        return Ref(t.data_ptr(), t.numel(), code, device, "torch", None, tuple(t.shape), tuple(strides))
    return Ref(t.data_ptr(), t.numel(), code, device, "torch", None)


_torch_codes_cache: dict[Any, int] = {}  # torch.dtype -> code


def _TORCH_CODES(torch: Any) -> dict[Any, int]:
    if not _torch_codes_cache:
        _torch_codes_cache.update({torch.float32: FLOAT32, torch.float16: FLOAT16, torch.bfloat16: BFLOAT16,
                                   torch.float64: FLOAT64})
    return _torch_codes_cache


_numpy_codes: dict[Any, int] = {}  # numpy.dtype -> code; a dict lookup is ~50x cheaper than dtype.name


def _numpy_code(dtype: Any) -> int | None:
    code = _numpy_codes.get(dtype)
    if code is None:
        code = _CODE_BY_NAME.get(dtype.name) if dtype.kind in "fV" and dtype.isnative else None
        if code is not None:
            _numpy_codes[dtype] = code
    return code


def _numpy_ref(a: Any, i: int) -> Ref:
    code = _numpy_code(a.dtype)
    if code is None:
        if not a.dtype.isnative and _CODE_BY_NAME.get(a.dtype.name) is not None:
            raise ValueError(f"tensor {i}: byte order {a.dtype.byteorder!r} is not native")
        raise TypeError(f"tensor {i}: dtype {a.dtype} cannot be unscaled (allowed: {_ALLOWED})")
    ptr, size, flags = _C.ndarray_info(a)
    if not flags & _NPY_WRITEABLE:
        raise ValueError(f"tensor {i}: the array is read-only")
    if not flags & (_NPY_C_CONTIGUOUS | _NPY_F_CONTIGUOUS):
        strides = _element_strides(a.strides, _ITEMSIZE[code], i)
        if not _is_dense(a.shape, strides):
            return Ref(ptr, size, code, "cpu", "numpy", None, tuple(a.shape), strides)
    return Ref(ptr, size, code, "cpu", "numpy", None)


def _element_strides(byte_strides: Sequence[int], itemsize: int, i: int) -> tuple[int, ...]:
    if any(s % itemsize for s in byte_strides):
        raise ValueError(f"tensor {i}: strides {tuple(byte_strides)} bytes are not multiples of the {itemsize}-byte "
                         "element size, so its elements are misaligned (allowed: element-aligned strides)")
    return tuple(s // itemsize for s in byte_strides)


def _buffer_ref(b: Any, i: int) -> Ref:
    code = _TYPESTR.get(b.typestr)
    if code is None:
        raise TypeError(f"tensor {i}: a vramkit.Buffer of typestr {b.typestr!r} cannot be unscaled "
                        f"(allowed: {_ALLOWED}; make it with vramkit.empty(shape, dtype))")
    device = b.device.partition("/")[0]  # a private pool's Buffer ("cpu/mempool:1") lives on its device
    if not (device == "cpu" or device.startswith("cuda")):
        raise ValueError(f"tensor {i}: a Buffer on {device} has no memory behind it (allowed: cpu, cuda)")
    return Ref(b.ptr, _prod(b.shape), code, device, "vramkit", None)


def _cai_ref(obj: Any, i: int) -> Ref:
    cai = obj.__cuda_array_interface__
    code = _TYPESTR.get(cai["typestr"])
    if code is None:
        raise TypeError(f"tensor {i}: typestr {cai['typestr']!r} cannot be unscaled (allowed: {_ALLOWED})")
    ptr, readonly = cai["data"]
    if readonly:
        raise ValueError(f"tensor {i}: the array is read-only")
    shape = tuple(cai["shape"])
    strides = cai.get("strides")
    if strides is not None:
        strides = _element_strides(strides, _ITEMSIZE[code], i)
        if _is_dense(shape, strides):
            strides = None
    dev = getattr(obj, "device", None)
    index = getattr(dev, "id", None)
    if not isinstance(index, int):
        index = 0  # the interface carries no device; CuPy and vramkit both say, others are assumed on device 0
    stream = cai.get("stream")
    family = "cupy" if type(obj).__module__.startswith("cupy") else "cuda_array_interface"
    return Ref(ptr, _prod(shape), code, f"cuda:{index}", family, stream if isinstance(stream, int) else None,
               shape if strides is not None else None, strides)


def _dlpack_ref(obj: Any, i: int, keep: list[Any]) -> Ref:
    try:
        capsule = obj.__dlpack__(max_version=(1, 0))
    except TypeError:
        capsule = obj.__dlpack__()
    keep.append(capsule)
    ptr, shape, strides, code, bits, lanes, dev_type, dev_id, readonly = _C.dlpack_describe(capsule)
    dtype = {(2, 32): FLOAT32, (2, 16): FLOAT16, (4, 16): BFLOAT16, (2, 64): FLOAT64}.get((code, bits))
    if dtype is None or lanes != 1:
        raise TypeError(f"tensor {i}: DLPack dtype (code {code}, {bits} bits, {lanes} lanes) cannot be unscaled "
                        f"(allowed: {_ALLOWED})")
    if readonly:
        raise ValueError(f"tensor {i}: the array is read-only")
    if dev_type in (_DL_CPU, _DL_CUDA_HOST):
        device = "cpu"
    elif dev_type in (_DL_CUDA, _DL_CUDA_MANAGED):
        device = f"cuda:{dev_id}"
    else:
        raise ValueError(f"tensor {i}: DLPack device type {dev_type} is not supported (allowed: cpu, cuda)")
    if strides is not None and not _is_dense(shape, strides):  # (None strides: dense)
        return Ref(ptr, _prod(shape), dtype, device, "dlpack", None, tuple(shape), tuple(strides))
    return Ref(ptr, _prod(shape), dtype, device, "dlpack", None)


def describe(obj: Any, i: int, keep: list[Any]) -> Ref:
    """One array's Ref. ``keep`` collects objects (DLPack capsules) that must outlive the call."""
    module = type(obj).__module__
    if module.startswith("torch") and "torch" in sys.modules and isinstance(obj, sys.modules["torch"].Tensor):
        return _torch_ref(obj, i)
    np = sys.modules.get("numpy")
    if np is not None and isinstance(obj, np.ndarray):
        return _numpy_ref(obj, i)
    if isinstance(obj, _C.Buffer):
        return _buffer_ref(obj, i)
    if hasattr(obj, "__cuda_array_interface__"):
        return _cai_ref(obj, i)
    if hasattr(obj, "__dlpack__"):
        return _dlpack_ref(obj, i, keep)
    if np is not None and isinstance(obj, np.generic):
        raise TypeError(f"tensor {i}: a NumPy scalar cannot be updated in place; pass an array")
    raise TypeError(f"tensor {i}: {type(obj).__module__}.{type(obj).__qualname__} is not an array vramkit can "
                    "read (NumPy arrays, torch tensors, CuPy arrays, vramkit Buffers, or objects with __dlpack__ "
                    "or __cuda_array_interface__)")


_torch_consts: tuple[Any, ...] | None = None  # (torch.Tensor and its four dtypes), for the C walk


def _walk_consts(arrays: Any) -> tuple[Any, ...] | None:
    """The C walk's constants, when torch is imported and `arrays` is a list or tuple."""
    global _torch_consts
    if _torch_consts is None:
        torch = sys.modules.get("torch")
        if torch is None:
            return None
        _torch_consts = (torch.Tensor, torch.float32, torch.float16, torch.bfloat16, torch.float64)
    return _torch_consts if isinstance(arrays, (list, tuple)) else None


def torch_spans(arrays: Any) -> tuple[Any, str, int] | None:
    """The common case walked in C (``_C.amp_torch_spans``, csrc/python/amp_torch.c): a list or
    tuple of plain, dense torch tensors of the kernels' dtypes, all on one device, none
    overlapping. Returns (spans, device, dtype bits), where the kernel bindings take ``spans``
    in place of ``triples``; or None for anything else, which ``describe_all`` then walks (and
    whose errors it raises)."""
    consts = _walk_consts(arrays)
    walked = None if consts is None else _C.amp_torch_spans(arrays, consts)
    if walked is None:
        return None
    spans, index, dtype_bits = walked
    return spans, "cpu" if index < 0 else f"cuda:{index}", dtype_bits


def torch_unscale_cpu(arrays: Any, inv_scale: float, want_sumsq: bool) -> tuple[bool, float | None, int] | None:
    """``amp_unscale_check`` of a list of plain CPU torch tensors, walk and kernel in one C call
    (``_C.amp_torch_unscale_check``): (found_inf, sumsq or None, dtype bits); None, with nothing
    written, for any list ``torch_spans`` would not take or whose tensors are not on the CPU."""
    consts = _walk_consts(arrays)
    return None if consts is None else _C.amp_torch_unscale_check(arrays, consts, inv_scale, want_sumsq)


def torch_unscale_found(arrays: Any, found_inf: Any, inv_scale: Any) -> bool:
    """``non_finite_check_and_unscale_`` in one C call (``_C.amp_torch_unscale_found``) when the
    gradients are plain CPU torch tensors and ``found_inf``/``inv_scale`` one-element float32
    CPU tensors: True when done; False, with nothing written, for anything else."""
    consts = _walk_consts(arrays)
    return consts is not None and _C.amp_torch_unscale_found(arrays, consts, found_inf, inv_scale) is not None


def cpu_unscale_fast(arrays: Any, inv_scale: float, want_sumsq: bool) -> tuple[bool, float | None] | None:
    """``amp_unscale_check`` in one C call when ``arrays`` is a list or tuple of plain CPU torch
    tensors (``torch_unscale_cpu``) or of NumPy arrays (``_C.amp_numpy_unscale_check``,
    csrc/python/amp_numpy.c): (found_inf, sumsq or None); None, with nothing written, for any
    other list, which ``describe_all`` then walks (and whose errors it raises)."""
    if not isinstance(arrays, (list, tuple)):
        return None
    if "numpy" in sys.modules:
        done = _C.amp_numpy_unscale_check(arrays, inv_scale, want_sumsq)
        if done is not None:
            return done
    walked = torch_unscale_cpu(arrays, inv_scale, want_sumsq)
    return None if walked is None else (walked[0], walked[1])


def cpu_spans(arrays: Any) -> Any:
    """The spans of a list or tuple of NumPy arrays or plain CPU torch tensors, walked in C, for
    the kernel bindings; None for any other list."""
    if not isinstance(arrays, (list, tuple)):
        return None
    spans = _C.amp_numpy_spans(arrays) if "numpy" in sys.modules else None
    if spans is None:
        walked = torch_spans(arrays)
        spans = walked[0] if walked is not None and walked[1] == "cpu" else None
    return spans


def describe_all(arrays: Any, what: str = "grads") -> tuple[list[Ref], list[Any]]:
    """Refs for a list of arrays, all on one device and not overlapping."""
    if isinstance(arrays, (str, bytes)) or not hasattr(arrays, "__iter__"):
        raise TypeError(f"{what} must be a list of arrays, got {type(arrays).__name__}")
    keep: list[Any] = []
    refs = [describe(a, i, keep) for i, a in enumerate(arrays)]
    if refs:
        first = refs[0].device
        for i, r in enumerate(refs):
            if r.device != first:
                raise ValueError(f"tensor {i} is on {r.device} but tensor 0 is on {first}; one call takes the "
                                 "tensors of one device (GradScaler groups them by device for you)")
        check_no_overlap(refs)
    return refs, keep


def _span(r: Ref) -> tuple[int, int]:
    """The byte range [start, end) a tensor's elements lie in."""
    size = _ITEMSIZE[r.dtype]
    if r.strides is None:
        return r.ptr, r.ptr + r.numel * size
    assert r.shape is not None  # set together with strides
    low = sum(st * (n - 1) for n, st in zip(r.shape, r.strides) if st < 0)
    high = sum(st * (n - 1) for n, st in zip(r.shape, r.strides) if st > 0)
    return r.ptr + low * size, r.ptr + (high + 1) * size


def check_no_overlap(refs: Sequence[Ref]) -> None:
    """An element listed twice would be unscaled twice: refuse overlapping tensors. A strided
    tensor counts as the whole range it spans (so two interleaved views of one buffer are
    refused too; pass the buffer itself instead)."""
    spans = sorted(_span(r) + (i,) for i, r in enumerate(refs) if r.numel)
    for (s0, e0, i0), (s1, _e1, i1) in zip(spans, spans[1:]):
        if s1 < e0:
            a, b = sorted((i0, i1))
            raise ValueError(f"tensor {b} overlaps tensor {a} in memory; each element would be unscaled twice")


def triples(refs: Sequence[Ref]) -> list[tuple[int, int, int]]:
    """(ptr, numel, dtype) of dense refs, for the dense kernels."""
    out = [(r.ptr, r.numel, r.dtype) for r in refs if r.strides is None]
    if len(out) != len(refs):
        i, r = next((i, r) for i, r in enumerate(refs) if r.strides is not None)
        raise ValueError(f"tensor {i} on {r.device} is not dense (shape {r.shape}, strides {r.strides} elements); "
                         "the CUDA kernels take dense tensors only (strided tensors are supported on the CPU)")
    return out


def split(refs: Sequence[Ref]) -> tuple[list[tuple[int, int, int]],
                                        list[tuple[int, int, tuple[int, ...], tuple[int, ...]]]]:
    """(dense triples, strided (ptr, dtype, shape, strides) quads) for the CPU kernels, one pass."""
    dense: list[tuple[int, int, int]] = []
    strided: list[tuple[int, int, tuple[int, ...], tuple[int, ...]]] = []
    for r in refs:
        if r.strides is None:
            dense.append((r.ptr, r.numel, r.dtype))
        else:
            assert r.shape is not None  # set together with strides
            strided.append((r.ptr, r.dtype, r.shape, r.strides))
    return dense, strided


def _np() -> Any:
    import numpy

    return numpy


def is_array(obj: Any) -> bool:
    """An array of a family vramkit takes (not a list of them)."""
    return (isinstance(obj, (_np().ndarray, _C.Buffer)) or hasattr(obj, "__dlpack__")
            or hasattr(obj, "__cuda_array_interface__"))


def where(obj: Any) -> tuple[str, str, str]:
    """(device, family, dtype name) of an array without requiring it to be writable."""
    if isinstance(obj, _np().ndarray):
        return "cpu", "numpy", obj.dtype.name
    module = type(obj).__module__.split(".")[0]
    if module == "torch":
        dev = obj.device
        return ("cpu" if dev.type == "cpu" else f"cuda:{dev.index if dev.index is not None else 0}", "torch",
                str(obj.dtype).replace("torch.", ""))
    if hasattr(obj, "__cuda_array_interface__"):
        index = getattr(getattr(obj, "device", None), "id", 0)
        return f"cuda:{index if isinstance(index, int) else 0}", module, str(getattr(obj, "dtype", ""))
    ref = describe(obj, 0, [])
    return ref.device, ref.family, DTYPE_NAMES[ref.dtype]


def describe_mixed(grads: list[Any]) -> tuple[list[Ref], list[Any]]:
    keep: list[Any] = []
    return [describe(g, i, keep) for i, g in enumerate(grads)], keep
