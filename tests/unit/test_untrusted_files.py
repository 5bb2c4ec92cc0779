"""Files from anyone: reading a snapshot pickle or a .vktrace never runs code from it, and every
malformed file is a TraceFormatError that says what is wrong and where.

Each case here was found escaping (code run, or a TypeError/KeyError/OverflowError/1 TiB
allocation instead of a TraceFormatError) before the checks were added; the seeded fuzzer in
tests/stress/test_fuzz_files.py covers the rest of the space.
"""

from __future__ import annotations

import copyreg
import json
import os
import pickle
import zlib

import numpy as np
import pytest

from vramkit import trace as vt
from vramkit.trace.formats.file_format import MAGIC
from vramkit.trace.formats.snapshot_import import from_torch_snapshot

from torch_snapshots import MiB, alloc, frame, free, live, segment, snapshot, write_pickle, block

A = 0x7F3A_0000_0000
USER = frame("/home/u/train.py", 12, "step")


class RunsACommand:
    """What a malicious snapshot holds: unpickling it with pickle.loads runs the command."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def plain_snapshot() -> dict:
    return snapshot([[alloc(A, 512, frames=[USER]), *free(A, 512), alloc(A + 512, 1000, frames=[USER])]],
                    [segment(A, [block(512), live(1024, 1000, [USER]), block(2 * MiB - 1536)])])


def evil_pickle(tmp_path, name: str) -> tuple[str, str]:
    marker = str(tmp_path / "pwned")
    snap = plain_snapshot()
    snap["device_traces"][0][0]["frames"] = [RunsACommand(marker)]
    path = tmp_path / name
    path.write_bytes(pickle.dumps(snap))
    return str(path), marker


# ---------------------------------------------------------------------------------- no code runs


@pytest.mark.parametrize("name", ["snap.pickle", "snap.bin"])
def test_a_pickle_that_would_run_a_command_is_refused(tmp_path, name):
    path, marker = evil_pickle(tmp_path, name)
    with pytest.raises(vt.TraceFormatError, match=r"class reference \((posix|os)\.system\); vramkit reads only plain "
                                                  r"data .*refusing"):
        vt.load(path)
    with pytest.raises(vt.TraceFormatError, match="class reference"):
        from_torch_snapshot(path)
    assert not os.path.exists(marker)


def test_a_pickle_renamed_vktrace_is_never_unpickled(tmp_path):
    path, marker = evil_pickle(tmp_path, "step.vktrace")
    with pytest.raises(vt.TraceFormatError, match=r"named \.vktrace but holds a pickle"):
        vt.load(path)
    with pytest.raises(vt.TraceFormatError, match="not a .vktrace file.*it is a pickle"):
        vt.Trace.load(path)
    # A harmless pickle under that name is refused too: the name promises a .vktrace.
    write_pickle(plain_snapshot(), tmp_path / "plain.vktrace")
    with pytest.raises(vt.TraceFormatError, match=r"named \.vktrace but holds a pickle"):
        vt.load(tmp_path / "plain.vktrace")
    assert not os.path.exists(marker)


def test_a_vktrace_handed_as_a_snapshot_is_refused(tmp_path):
    t = vt.Trace.from_columns(kind=[vt.ALLOC], id=[0], size=[8])
    path = t.save(tmp_path / "t.vktrace")
    with pytest.raises(vt.TraceFormatError, match=r"is a \.vktrace file, not a snapshot pickle"):
        from_torch_snapshot(path)


def test_an_extension_registry_reference_is_refused(tmp_path):
    # EXT opcodes name a class through copyreg's registry, not GLOBAL: find_class is still asked.
    copyreg.add_extension("os", "system", 0x7A)
    try:
        data = pickle.dumps({"segments": [], "device_traces": [[os.system]]}, protocol=2)
    finally:
        copyreg.remove_extension("os", "system", 0x7A)
    (tmp_path / "ext.pickle").write_bytes(data)
    copyreg.add_extension("os", "system", 0x7A)  # a reader with the registry filled must refuse it as well
    try:
        with pytest.raises(vt.TraceFormatError, match="class reference"):
            vt.load(tmp_path / "ext.pickle")
    finally:
        copyreg.remove_extension("os", "system", 0x7A)


@pytest.mark.parametrize("protocol", [2, 3, 4, 5, None])
def test_plain_snapshots_still_load_under_every_protocol(tmp_path, protocol):
    snap = plain_snapshot()
    want = from_torch_snapshot(snap)
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(snap) if protocol is None else pickle.dumps(snap, protocol=protocol))
    got = vt.load(path)
    for col in ("kind", "id", "size", "stream", "alloc_module", "alloc_op"):
        np.testing.assert_array_equal(getattr(got, col), getattr(want, col))
    assert got.modules == ["/home/u/train.py:12"] and got.meta == want.meta


def test_torchs_own_dump_snapshot_file_loads(tmp_path, monkeypatch):
    """torch.cuda.memory._dump_snapshot() itself writes the file (its _snapshot() needs a GPU, so
    it is handed the documented dict), and vramkit reads it."""
    memory = pytest.importorskip("torch.cuda.memory")
    snap = plain_snapshot()
    monkeypatch.setattr(memory, "_snapshot", lambda *a, **k: snap)
    path = str(tmp_path / "dump_snapshot.pickle")
    memory._dump_snapshot(path)
    got = vt.load(path)
    np.testing.assert_array_equal(got.size, from_torch_snapshot(snap).size)


def test_vramkits_own_snapshot_file_loads(tmp_path):
    import vramkit

    dev = vramkit.sim.create(1 << 30)
    vramkit.record_memory_history(True, device=dev)
    try:
        p = vramkit.raw_alloc(3 << 20, dev)
        path = vramkit.dump_snapshot(str(tmp_path / "v.pickle"), device=dev)
        vramkit.raw_free(p)
    finally:
        vramkit.record_memory_history(False, device=dev)
    t = vt.load(path)
    assert t.meta["recorded_on"] == dev and t.size.tolist() == [3 << 20]


# ---------------------------------------------------------------------------------- malformed snapshots


def test_shared_references_cannot_multiply_the_work(tmp_path):
    """A few kilobytes of pickle that reference one segment a thousand times, each listing one
    block a thousand times, would be a million blocks to walk: refused by the file's size."""
    blk = {"size": 512, "requested_size": 512, "state": "active_allocated", "address": A}
    seg = {"device": 0, "address": A, "total_size": 512, "stream": 0, "blocks": [blk] * 1000}
    path = tmp_path / "bomb.pickle"
    path.write_bytes(pickle.dumps({"segments": [seg] * 1000, "device_traces": [[]]}))
    assert path.stat().st_size < 20_000
    with pytest.raises(vt.TraceFormatError, match="more blocks than a file of"):
        vt.load(path)


@pytest.mark.parametrize("field, value, message", [
    pytest.param("size", 2 ** 20_000, r"'size' is an integer of 20001 bits; expected an integer from 0",
                 id="size-huge-int"),
    ("size", float("inf"), r"'size' is inf; expected an integer"),
    ("size", -5, r"'size' is -5"),
    ("addr", "0x10", r"'addr' is '0x10'"),
    ("stream", [1], r"'stream' is a list of 1 entries"),
    ("frames", [{"filename": ["x"] * 10, "line": 1, "name": "f"}], r"'filename' is a list of 10 entries"),
    ("action", None, r"'action' is None"),
])
def test_malformed_entry_fields_are_named(tmp_path, field, value, message):
    snap = plain_snapshot()
    snap["device_traces"][0][0][field] = value
    path = write_pickle(snap, tmp_path / "s.pickle")
    with pytest.raises(vt.TraceFormatError, match=rf"device_traces\[0\]\[0\]: .*{message}"):
        vt.load(path)


@pytest.mark.parametrize("where, value, message", [
    (("total_size",), 1e300, r"segment 0: 'total_size' is 1e\+300"),
    (("blocks",), 7, r"segment 0: 'blocks' is 7; expected a list"),
    (("blocks", 0), "x", r"segment 0, block 0: the block is 'x'; expected a dict"),
    (("blocks", 1, "state"), 3, r"segment 0, block 1: 'state' is 3"),
    (("device",), -1, r"segment 0: 'device' is -1"),
])
def test_malformed_segments_are_named(tmp_path, where, value, message):
    snap = plain_snapshot()
    node = snap["segments"][0]
    for k in where[:-1]:
        node = node[k]
    node[where[-1]] = value
    with pytest.raises(vt.TraceFormatError, match=message):
        vt.load(write_pickle(snap, tmp_path / "s.pickle"))


# ---------------------------------------------------------------------------------- malformed .vktrace


def saved(tmp_path) -> bytes:
    t = vt.Trace.from_columns(kind=[vt.STEP, vt.PHASE, vt.ALLOC, vt.ALLOC, vt.FREE], id=[0, 1, 0, 1, 0],
                              size=[0, 0, 100, 4096, 100], dtypes=["float32"], modules=["m"], ops=["aten::mm"],
                              alloc_dtype=[0, 0], alloc_module=[0, -1], alloc_op=[0, 0], meta={"source": "test"})
    return open(t.save(tmp_path / "t.vktrace"), "rb").read()


def rewrite(data: bytes, edit, payload_edit=None) -> bytes:
    """The file with its JSON header changed by `edit(header)` (and its payload by
    `payload_edit(header, payload)`), lengths and CRC kept consistent so only the edit is wrong."""
    hlen = int.from_bytes(data[12:16], "little")
    header, payload = json.loads(data[16:16 + hlen]), bytearray(data[16 + hlen:])
    if payload_edit is not None:
        payload_edit(header, payload)
        header["payload_crc32"] = zlib.crc32(payload)
    header = edit(header) or header
    raw = json.dumps(header).encode()
    return data[:12] + len(raw).to_bytes(4, "little") + raw + bytes(payload)


def column(header: dict, name: str) -> dict:
    return next(c for c in header["columns"] if c["name"] == name)


def set_step_id(header: dict, payload: bytearray) -> None:
    spec = column(header, "id")
    ids = np.frombuffer(payload, "<i8", count=spec["length"], offset=spec["offset"]).copy()
    ids[0] = 2 ** 40  # event 0 is the STEP marker
    payload[spec["offset"]:spec["offset"] + ids.nbytes] = ids.tobytes()


@pytest.mark.parametrize("edit, payload_edit, message", [
    (lambda h: h.update(strings=None), None, r"'strings' is None; expected a JSON object"),
    (lambda h: h.update(meta=[1]), None, r"'meta' is a list of 1 entries; expected a JSON object"),
    (lambda h: h["meta"].update(source=7), None, r"meta\['source'\] is 7; expected str"),
    (lambda h: h["strings"].update(ops=[1]), None, r"strings\['ops'\]\[0\] is 1; expected a string"),
    (lambda h: column(h, "size").update(dtype="bogus"), None, r"column 'size' \(columns\[2\]\) dtype is 'bogus'; "
                                                               r"expected '<u8'"),
    (lambda h: column(h, "size").update(dtype="<f8"), None, r"dtype is '<f8'; expected '<u8'"),
    (lambda h: column(h, "id").update(offset=float("inf")), None, r"Infinity is not a JSON number"),
    (lambda h: column(h, "id").update(length=-1), None, r"column 'id' \(columns\[1\]\) length is -1"),
    (lambda h: column(h, "id").update(length=10 ** 6), None, r"length is 1000000; expected an integer from 0 to"),
    (lambda h: column(h, "id").update(offset=4), None, r"offset 4 is not a multiple of 8"),
    (lambda h: h["columns"].append(dict(column(h, "id"))), None, r"column 'id' \(columns\[8\]\) appears twice"),
    (lambda h: h["columns"].pop(0) and None, None, r"missing columns \['kind'\]"),
    (lambda h: h.update(payload_bytes="12"), None, r"'payload_bytes' is '12'"),
    (lambda h: h.pop("columns") and None, None, r"missing field 'columns'"),
    (lambda h: [1, 2], None, r"the header is a list of 2 entries; expected a JSON object"),
    (lambda h: None, set_step_id, r"event 0: step marker 1099511627776 is not a step number"),
])
def test_malformed_headers_and_columns_are_trace_format_errors(tmp_path, edit, payload_edit, message):
    path = tmp_path / "bad.vktrace"
    path.write_bytes(rewrite(saved(tmp_path), edit, payload_edit))
    with pytest.raises(vt.TraceFormatError, match=message):
        vt.load(path)


def test_header_json_errors_give_the_file_offset(tmp_path):
    data = saved(tmp_path)
    hlen = int.from_bytes(data[12:16], "little")
    bad = bytearray(data)
    bad[16 + 1] = ord("}")  # the header's first key loses its opening quote
    (tmp_path / "a.vktrace").write_bytes(bytes(bad))
    with pytest.raises(vt.TraceFormatError, match=r"header \(file offset 16, \d+ bytes\): not JSON: .* at file "
                                                  r"offset \d+"):
        vt.load(tmp_path / "a.vktrace")
    raw = b"[" * 100_000 + b"]" * 100_000  # nesting deeper than the JSON parser's recursion
    (tmp_path / "b.vktrace").write_bytes(MAGIC + (1).to_bytes(4, "little") + len(raw).to_bytes(4, "little") + raw)
    with pytest.raises(vt.TraceFormatError, match="unreadable JSON"):
        vt.load(tmp_path / "b.vktrace")
    nan = data[16:16 + hlen].replace(b'"payload_bytes":', b'"payload_bytes":NaN,"x":')
    (tmp_path / "c.vktrace").write_bytes(data[:12] + len(nan).to_bytes(4, "little") + nan + data[16 + hlen:])
    with pytest.raises(vt.TraceFormatError, match="NaN is not a JSON number"):
        vt.load(tmp_path / "c.vktrace")


def test_a_small_file_cannot_ask_for_a_huge_array():
    with pytest.raises(vt.TraceFormatError, match="dense from 0"):
        vt.Trace.from_columns(kind=[vt.ALLOC], id=[2 ** 40], size=[8])


def test_a_pickle_declaring_a_huge_object_is_refused(tmp_path):
    # BINBYTES8 with a length of 2**62: CPython's unpickler allocates before it reads (under
    # ASan that aborts the process; elsewhere a MemoryError). Refused before it is unpickled.
    (tmp_path / "huge.pickle").write_bytes(b"\x80\x04\x8e" + (2 ** 62).to_bytes(8, "little") + b"abc.")
    with pytest.raises(vt.TraceFormatError, match=r"BINBYTES8 at byte 2 declares a length past the end of the data"):
        vt.load(tmp_path / "huge.pickle")


@pytest.mark.parametrize("data, message", [
    # LONG_BINPUT 2**31: the unpickler would grow its memo to 2**32 entries and zero 32 GiB.
    (b"\x80\x02N r\x00\x00\x00\x80.".replace(b" ", b""), r"LONG_BINPUT at byte 3 stores memo entry far past"),
    (b"(lp4000000000\n.", r"PUT at byte 2 stores memo entry far past"),
    (b"\x80\x04]\x94h\x05.", r"BINGET at byte 4 reads a memo entry never stored"),
    (b"\x80\x04\x95" + (1 << 40).to_bytes(8, "little") + b"N.", r"FRAME at byte 2 is longer than the data left"),
    (b"\x80\x09N.", r"PROTO at byte 0 names a protocol above 5"),
    (b"\x80\x04\xffN.", r"opcode 0xff at byte 2 is not a pickle opcode"),
    (b"\x80\x04]\x94", r"ends at byte 4 without a STOP opcode"),
    (b"\x80\x04\x8b\x00\x00\x00\x80.", r"LONG4 at byte 2 has a negative length"),
])
def test_malformed_pickles_are_refused_before_unpickling(tmp_path, data, message):
    (tmp_path / "bad.pickle").write_bytes(data)
    with pytest.raises(vt.TraceFormatError, match=message):
        from_torch_snapshot(tmp_path / "bad.pickle")  # (trace.load reads only protocol 2 and later)


@pytest.mark.parametrize("data, name", [
    (b"\x80\x04\x8c\x05posix\x94\x8c\x06system\x94\x93\x94.", r"posix\.system"),  # protocol 4
    (b"cos\nsystem\n(S'touch x'\ntR.", r"os\.system"),                               # protocol 0
    (b"\x80\x02}R.", r"an object call or construction \(REDUCE at byte 3\)"),            # REDUCE without a global
    (b"\x80\x02\x82\x01.", r"copyreg extension code"),
    (b"\x80\x02Q.", r"a persistent id"),
    (b"\x80\x05\x97.", r"an out-of-band buffer"),
])
def test_every_way_of_naming_an_object_is_refused(tmp_path, data, name):
    (tmp_path / "obj.pickle").write_bytes(data)
    with pytest.raises(vt.TraceFormatError, match=rf"contains .*{name}.*refusing"):
        from_torch_snapshot(tmp_path / "obj.pickle")


@pytest.mark.parametrize("protocol", [0, 1, 2, 3, 4, 5])
def test_the_check_accepts_every_plain_pickle(protocol):
    """Everything a snapshot can hold, written by Python's own pickler under every protocol
    (bytes only from protocol 3 and sets from protocol 4: before that, pickle writes them
    through a global, which is refused)."""
    from vramkit import _C
    from vramkit._core.plain_pickle import loads_plain

    shared = ["frame", 1]
    obj = {"segments": [{"address": 2 ** 47 + 3, "blocks": [], "is_expandable": False, "ratio": -0.25},
                        {"stream": -(2 ** 70), "pool": (0, 0), "name": "é" * 300, "big": "x" * 70_000}],
           "device_traces": [[{"frames": shared}] * 3, []], "none": None, "true": True, "nested": [[[[]]]],
           "empty": ((), {}, []), "float": 1e300}
    if protocol >= 3:
        obj["bytes"] = b"\x00\xff" * 40_000
    if protocol >= 4:
        obj.update(set={1, 2}, frozen=frozenset({3}))
    data = pickle.dumps(obj, protocol=protocol)
    assert _C.plain_pickle_problem(data) is None
    assert loads_plain(data) == obj


def test_find_class_is_the_second_line(monkeypatch):
    """Should the opcode check ever miss a class reference, the unpickler still refuses it."""
    from vramkit import _C
    from vramkit._core import plain_pickle as _plain_pickle

    monkeypatch.setattr(_C, "plain_pickle_problem", lambda data: None)
    with pytest.raises(_plain_pickle.UnsafePickleError, match=r"class reference \((posix|os)\.system\)"):
        _plain_pickle.loads_plain(pickle.dumps(os.system))
