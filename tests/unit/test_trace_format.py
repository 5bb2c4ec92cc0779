"""The .vktrace file format and the Trace columns' checks."""

from __future__ import annotations

import os

import numpy as np
import pytest

from vramkit import trace as vt
from vramkit.trace.formats.file_format import FORMAT_VERSION, MAGIC


def small_trace() -> vt.Trace:
    # alloc a(100), alloc b(3 MiB), free a, phase backward, alloc c(0), free b; c never freed.
    return vt.Trace.from_columns(
        kind=[vt.PHASE, vt.ALLOC, vt.ALLOC, vt.FREE, vt.PHASE, vt.ALLOC, vt.FREE],
        id=[1, 0, 1, 0, 2, 2, 1], size=[0, 100, 3 << 20, 100, 0, 0, 3 << 20],
        alloc_dtype=[0, 1, -1], alloc_category=[3, 0, 9], alloc_module=[0, 1, -1], alloc_op=[0, 0, 1],
        dtypes=["float32", "bfloat16"], modules=["layers.0", "head"], ops=["aten::mm", "aten::empty"],
        meta={"source": "test", "batch_size": 4})


def test_round_trip(tmp_path):
    t = small_trace()
    path = t.save(tmp_path / "a.vktrace")
    u = vt.load(path)
    for col in ("kind", "id", "size", "stream", "alloc_dtype", "alloc_category", "alloc_module", "alloc_op"):
        np.testing.assert_array_equal(getattr(t, col), getattr(u, col))
        assert getattr(u, col).dtype == getattr(t, col).dtype
    assert (u.dtypes, u.modules, u.ops, u.meta) == (t.dtypes, t.modules, t.ops, t.meta)
    with open(path, "rb") as f:
        head = f.read(16)
    assert head[:8] == MAGIC and int.from_bytes(head[8:12], "little") == FORMAT_VERSION


def test_derived_views():
    t = small_trace()
    assert (t.num_events, t.num_allocations) == (7, 3)
    assert list(t.alloc_index) == [1, 2, 5] and list(t.free_index) == [3, 6, -1]
    assert list(t.live_after(2)) == [0, 1] and list(t.live_after(3)) == [1]
    assert [vt.PHASES[p] for p in t.phase_at()] == ["forward"] * 4 + ["backward"] * 3
    # Peak of live requested bytes: 100 + 3 MiB after event 2; rounded: 512 + 3 MiB.
    assert vt.peak_live_bytes(t) == 100 + (3 << 20)
    assert vt.peak_live_bytes(t, rounded=True) == 512 + (3 << 20)


def corrupt(path, offset, byte):
    data = bytearray(open(path, "rb").read())
    data[offset] ^= byte
    open(path, "wb").write(bytes(data))


def test_bad_files_are_refused_with_the_reason(tmp_path):
    path = small_trace().save(tmp_path / "t.vktrace")
    data = open(path, "rb").read()
    (tmp_path / "short").write_bytes(data[:-3])
    with pytest.raises(vt.TraceFormatError, match="truncated: the header says"):
        vt.load(tmp_path / "short")
    (tmp_path / "tiny").write_bytes(data[:10])
    with pytest.raises(vt.TraceFormatError, match="too short"):
        vt.Trace.load(tmp_path / "tiny")
    (tmp_path / "long").write_bytes(data + b"x")
    with pytest.raises(vt.TraceFormatError, match="trailing bytes"):
        vt.load(tmp_path / "long")
    (tmp_path / "v2").write_bytes(data[:8] + (FORMAT_VERSION + 1).to_bytes(4, "little") + data[12:])
    with pytest.raises(vt.TraceFormatError, match=f"version {FORMAT_VERSION + 1} \\(file offset 8\\); this vramkit reads version"):
        vt.load(tmp_path / "v2")
    (tmp_path / "flip").write_bytes(data)
    corrupt(tmp_path / "flip", len(data) - 1, 0x40)
    with pytest.raises(vt.TraceFormatError, match="CRC-32"):
        vt.load(tmp_path / "flip")
    (tmp_path / "text").write_bytes(b"hello world, not a trace")
    with pytest.raises(vt.TraceFormatError, match="neither a .vktrace file nor a snapshot pickle"):
        vt.load(tmp_path / "text")
    with pytest.raises(vt.TraceFormatError, match="not a .vktrace file"):
        vt.Trace.load(tmp_path / "text")
    with pytest.raises(FileNotFoundError):
        vt.load(tmp_path / "missing.vktrace")


def test_a_failed_save_leaves_the_old_file_and_no_temporary(tmp_path):
    path = small_trace().save(tmp_path / "t.vktrace")
    before = open(path, "rb").read()
    bad = small_trace()
    bad.meta["not json"] = object()
    with pytest.raises(TypeError):
        bad.save(path)
    assert open(path, "rb").read() == before
    assert os.listdir(tmp_path) == ["t.vktrace"]


@pytest.mark.parametrize("columns, message", [
    (dict(kind=[0, 1, 1], id=[0, 0, 0], size=[8, 8, 8]), "event 2: second free of id 0"),
    (dict(kind=[0, 0], id=[0, 0], size=[8, 8]), "event 1: second alloc of id 0"),
    (dict(kind=[1, 0], id=[0, 0], size=[8, 8]), "event 0: free of id 0 before its alloc at event 1"),
    (dict(kind=[0, 1], id=[0, 3], size=[8, 8]), "event 1: free of id 3, which is never allocated"),
    (dict(kind=[0, 9], id=[0, 0], size=[8, 0]), "event 1: unknown kind 9"),
    (dict(kind=[0], id=[-1], size=[8]), "event 0: negative allocation id -1"),
    (dict(kind=[0, 0], id=[0, 2], size=[8, 8]), "ids must be dense from 0"),
    (dict(kind=[0], id=[0], size=[1 << 62]), "event 0: size 4611686018427387904 is not below 2\\*\\*62"),
    (dict(kind=[0], id=[0], size=[8], alloc_module=[5], modules=["a"]), "'alloc_module' indexes past"),
    (dict(kind=[0, 1], id=[0, 0], size=[8]), "column 'size' has 1 entries; the trace has 2 events"),
])
def test_inconsistent_columns_name_the_first_bad_event(columns, message):
    with pytest.raises(vt.TraceFormatError, match=message):
        vt.Trace.from_columns(**columns)
