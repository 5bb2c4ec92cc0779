"""Snapshots in torch.cuda.memory._snapshot()'s schema, loadable by pytorch.org/memory_viz,
and the allocation history behind them."""

from __future__ import annotations

import pickle
import pickletools

import pytest

import vramkit

MiB = 1 << 20

# The opcodes MemoryViz.js's unpickler understands (anything else throws "UNKNOWN OPCODE").
VIEWER_OPCODES = {
    "PROTO", "FRAME", "MEMOIZE", "BINPUT", "LONG_BINPUT", "BINGET", "LONG_BINGET", "MARK", "STOP", "EMPTY_DICT",
    "DICT", "SETITEM", "SETITEMS", "EMPTY_LIST", "LIST", "APPEND", "APPENDS", "EMPTY_TUPLE", "TUPLE", "TUPLE1",
    "TUPLE2", "TUPLE3", "NONE", "NEWTRUE", "NEWFALSE", "BININT", "BININT1", "BININT2", "LONG1", "BINFLOAT",
    "SHORT_BINUNICODE", "BINUNICODE",
}


def allocate_activations(device):
    ptrs = []  # a loop, not a comprehension: Python 3.11 gives comprehensions their own frame
    for n in (1000, 3000, 2 * MiB, 12 * MiB):
        ptrs.append(vramkit.raw_alloc(n, device))
    return ptrs


def release(ptrs):
    for p in ptrs:
        vramkit.raw_free(p)


def test_segments_and_blocks_describe_the_pool(sim):
    ptrs = allocate_activations(sim)
    vramkit.raw_free(ptrs[1])
    snap = vramkit.memory_snapshot(sim)
    index = int(sim.split(":")[1])
    assert snap["vramkit_device"] == sim
    assert len(snap["device_traces"]) == index + 1  # the viewer offers device i when this list reaches i
    segments = snap["segments"]
    assert sum(s["total_size"] for s in segments) == vramkit.memory_reserved(sim)
    live = set()
    for seg in segments:
        assert seg["device"] == index and seg["segment_type"] in ("small", "large")
        addr = seg["address"]
        for blk in seg["blocks"]:  # the viewer walks blocks in order to place them
            assert blk["address"] == addr
            addr += blk["size"]
            assert blk["state"] in ("active_allocated", "active_pending_free", "inactive")
            if blk["state"] == "active_allocated":
                live.add(blk["address"])
                assert blk["requested_size"] <= blk["size"]
        assert addr == seg["address"] + seg["total_size"]
        assert seg["allocated_size"] == sum(b["size"] for b in seg["blocks"] if b["state"] == "active_allocated")
    assert live == {ptrs[0], ptrs[2], ptrs[3]}
    release([ptrs[0], ptrs[2], ptrs[3]])


def test_history_records_user_frames_and_actions(sim):
    vramkit.record_memory_history(True, device=sim)

    def build_model():
        return allocate_activations(sim)

    ptrs = build_model()
    release(ptrs)
    vramkit.empty_cache(sim)
    trace = vramkit.memory_snapshot(sim)["device_traces"][-1]
    actions = [e["action"] for e in trace]
    assert actions.count("alloc") == 4 and actions.count("free_requested") == 4
    assert actions.count("free_completed") == 4
    # 2 MiB small segment; the 12 MiB block fits in the 20 MiB large segment's free tail
    assert actions.count("segment_alloc") == actions.count("segment_free") == 2
    assert actions.index("segment_alloc") < actions.index("alloc")
    first_alloc = next(e for e in trace if e["action"] == "alloc")
    assert first_alloc["addr"] == ptrs[0] and first_alloc["size"] == 1024
    # innermost frame first, starting at user code (vramkit's own frames are dropped)
    names = [f["name"] for f in first_alloc["frames"]]
    assert names[:3] == ["allocate_activations", "build_model", "test_history_records_user_frames_and_actions"]
    assert first_alloc["frames"][0]["filename"] == __file__
    times = [e["time_us"] for e in trace]
    assert times == sorted(times) and times[0] > 1.6e15  # microseconds since 1970
    vramkit.record_memory_history(False, device=sim)
    assert vramkit.memory_snapshot(sim)["device_traces"][-1] == []


def test_ring_buffer_keeps_the_newest_entries(sim):
    vramkit.record_memory_history(True, max_entries=10, device=sim)
    for _ in range(20):
        vramkit.raw_free(vramkit.raw_alloc(4096, sim))
    trace = vramkit.memory_snapshot(sim)["device_traces"][-1]
    assert len(trace) == 10
    assert [e["action"] for e in trace[-3:]] == ["alloc", "free_requested", "free_completed"]
    with pytest.raises(ValueError, match="max_entries must be a positive integer"):
        vramkit.record_memory_history(True, max_entries=0, device=sim)
    with pytest.raises(ValueError, match="enabled must be True"):
        vramkit.record_memory_history("sometimes", device=sim)


def test_oom_appears_in_the_trace():
    dev = vramkit.sim.create(64 * MiB)
    vramkit.record_memory_history(True, device=dev)
    with pytest.raises(vramkit.OutOfMemoryError):
        vramkit.raw_alloc(100 * MiB, dev)
    oom = vramkit.memory_snapshot(dev)["device_traces"][-1][-1]
    assert oom["action"] == "oom" and oom["size"] == 100 * MiB and oom["device_free"] == 64 * MiB
    assert "addr" not in oom


def test_pickle_uses_only_opcodes_the_viewer_reads(sim, tmp_path):
    vramkit.record_memory_history(True, device=sim)
    ptrs = allocate_activations(sim)
    path = vramkit.dump_snapshot(str(tmp_path / "snap.pickle"), device=sim)
    release(ptrs)
    data = open(path, "rb").read()
    used = {op.name for op, _, _ in pickletools.genops(data)}
    assert used <= VIEWER_OPCODES, used - VIEWER_OPCODES
    assert data[:2] == b"\x80\x04"  # protocol 4: the viewer rejects 5
    snap = pickle.loads(data)
    assert set(snap) >= {"segments", "device_traces"} and snap["device_traces"][-1]


def test_cpu_snapshot_is_device_zero():
    vramkit.record_memory_history(True, device="cpu")
    p = vramkit.raw_alloc(12345, "cpu")
    snap = vramkit.memory_snapshot("cpu")
    vramkit.raw_free(p)
    assert len(snap["device_traces"]) == 1 and snap["vramkit_device"] == "cpu"
    assert any(e["action"] == "alloc" and e["addr"] == p for e in snap["device_traces"][0])


def test_hidden_frames_spare_the_bundled_examples(sim, tmp_path):
    """Frames inside vramkit are dropped from the innermost end, except its examples/."""
    import importlib.util
    import os

    pkg = tmp_path / "pkg"
    (pkg / "examples").mkdir(parents=True)
    (pkg / "inner.py").write_text("import vramkit\ndef alloc(d):\n    return vramkit.raw_alloc(4096, d)\n")
    (pkg / "examples" / "demo.py").write_text("import inner\ndef run(d):\n    return inner.alloc(d)\n")
    sys_path = [str(pkg), str(pkg / "examples")]
    import sys

    sys.path[:0] = sys_path
    try:
        spec = importlib.util.spec_from_file_location("demo", pkg / "examples" / "demo.py")
        demo = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(demo)
        vramkit._C._set_hidden_prefix(str(pkg) + os.sep, str(pkg / "examples") + os.sep)
        vramkit.record_memory_history(True, device=sim)
        p = demo.run(sim)
        frames = vramkit.memory_snapshot(sim)["device_traces"][-1][-1]["frames"]
        vramkit.raw_free(p)
        assert [f["name"] for f in frames[:2]] == ["run", "test_hidden_frames_spare_the_bundled_examples"]
    finally:
        del sys.path[:2]
        here = os.path.dirname(vramkit.__file__) + os.sep
        vramkit._C._set_hidden_prefix(here, here + "examples" + os.sep)


def test_snapshot_survives_finalizers_that_record_new_stacks(sim):
    """Building a snapshot's frame lists can run the GC; a finalizer that frees vramkit memory
    from never-seen code interns new stacks and may move the stack table meanwhile (this once
    read freed memory: the ASan run in CI catches a regression)."""
    import gc

    vramkit.record_memory_history(True, device=sim)
    namespace = {"vramkit": vramkit, "sim": sim}
    lines = "\n".join("vramkit.raw_free(vramkit.raw_alloc(512, sim))" for _ in range(700))
    exec(compile(lines, "<many-lines>", "exec"), namespace)  # 700 distinct stacks in the trace
    finalized, stop = [0], [False]

    class Dropper:
        def __del__(self):
            finalized[0] += 1
            if stop[0] or finalized[0] > 5000:
                return
            scope = {"b": vramkit.empty(16, device=sim)}
            exec(compile("b = None", f"<drop{finalized[0]}>", "exec"), scope)  # freed from a new stack
            again = Dropper()
            again.cycle = again  # more garbage for the next collection

    first = Dropper()
    first.cycle = first
    del first
    old = gc.get_threshold()
    try:
        gc.set_threshold(1, 1, 1)  # collect at nearly every allocation while the snapshot is built
        snap = vramkit.memory_snapshot(sim)
    finally:
        gc.set_threshold(*old)
        stop[0] = True
    gc.collect()
    allocs = [e for e in snap["device_traces"][-1] if e["action"] == "alloc"]
    assert finalized[0] > 0 and len(allocs) >= 700
    assert all(e["frames"][0]["filename"] == "<many-lines>" for e in allocs[:700])
    assert [e["frames"][0]["line"] for e in allocs[:700]] == list(range(1, 701))
    vramkit.pool_check(sim)
