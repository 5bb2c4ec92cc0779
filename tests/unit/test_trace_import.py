"""vramkit.trace.formats.snapshot_import.from_torch_snapshot: PyTorch memory snapshots to Traces.

Every snapshot here is written by hand (tests/unit/torch_snapshots.py lays out the format) the
way PyTorch's CUDACachingAllocator.cpp would have recorded it: alloc/free entries carry the
requested bytes, segment entries the cudaMalloc size, blocks their 512-rounded size and
requested_size. Small requests (<= 1 MiB) go to 2 MiB segments, 1-10 MiB requests to 20 MiB
segments, larger ones to segments rounded up to 2 MiB; a large-pool block is split only if more
than 1 MiB would remain. Every expected figure is worked out in a comment.
"""

from __future__ import annotations

import pathlib
import pickle

import numpy as np
import pytest

from vramkit import _C
from vramkit.trace.formats.file_format import ALLOC, CATEGORIES, FREE, Trace, TraceFormatError
from vramkit.trace.formats.snapshot_import import from_torch_snapshot

from torch_snapshots import (MiB, alloc, frame, free, free_completed, free_requested, live, oom, pending, segment,
                             segment_alloc, segment_free, snapshot, snapshot_entry, write_pickle, block)

A = 0x7F3A_0000_0000  # a small-pool segment (2 MiB)
B = 0x7F3A_0040_0000  # large-pool segments
C = 0x7F3A_0200_0000
S1 = 0x55D0_C3A1_B2C0  # a side stream's cudaStream_t value
S2 = 0x55D0_C3A1_F000

USER = frame("/home/u/proj/train.py", 42, "step")
USER2 = frame("/home/u/proj/model.py", 10, "build")
TORCH = frame("/usr/lib/python3.11/site-packages/torch/nn/modules/linear.py", 125, "forward")


def columns(t: Trace) -> tuple[list[int], list[int], list[int], list[int]]:
    return t.kind.tolist(), t.id.tolist(), t.size.tolist(), t.stream.tolist()


# ---------------------------------------------------------------------------------- conversion


def test_simple_alloc_free_sequence():
    snap = snapshot(
        [[segment_alloc(A, 2 * MiB),        # 100 B -> small pool, a new 2 MiB segment
          alloc(A, 100, frames=[TORCH, USER]),
          alloc(A + 512, 1000, frames=[USER2]),  # 1000 -> a 1024 block after the first 512
          {"action": "user_defined", "name": "step 1", "stream": 0, "time_us": 1},  # an annotation
          free_requested(A, 100),
          free_completed(A, 100),
          alloc(A, 200, frames=[USER]),     # 200 -> 512: the freed 512 block fits exactly
          snapshot_entry(1536)]],
        [segment(A, [live(512, 200, [USER]), live(1024, 1000, [USER2]), block(2 * MiB - 1536)])])
    t = from_torch_snapshot(snap)
    kind, ids, size, stream = columns(t)
    assert kind == [ALLOC, ALLOC, FREE, ALLOC]
    assert ids == [0, 1, 0, 2]
    assert size == [100, 1000, 100, 200]  # requested bytes, also on the FREE
    assert stream == [0, 0, 0, 0]
    assert t.modules == ["/home/u/proj/train.py:42", "/home/u/proj/model.py:10"]
    assert t.ops == ["step", "build"]
    assert t.alloc_module.tolist() == [0, 1, 0] and t.alloc_op.tolist() == [0, 1, 0]
    assert t.alloc_category.tolist() == [CATEGORIES.index("unknown")] * 3
    assert t.alloc_dtype.tolist() == [-1, -1, -1]
    m = t.meta
    assert m["source"] == "torch-snapshot" and m["device"] == 0 and m["num_trace_entries"] == 8
    assert m["initial_allocations"] == 0 and m["unfinished_frees"] == 0 and m["recorded_ooms"] == []
    assert m["trace_sizes"] == "requested"
    assert m["recorded_reserved"] == 2 * MiB
    assert m["recorded_allocated"] == 512 + 1024 == 1536
    assert m["recorded_requested"] == 200 + 1000 == 1200
    # reserved: 0 before the segment_alloc, 2 MiB after
    assert m["recorded_peak_reserved"] == 2 * MiB
    # allocated: 512 (id 0: 100 rounded up), 1536 (+1024), 1024 (id 0 freed), 1536 (+512)
    assert m["recorded_peak_allocated"] == 1536
    assert m["allocated_size_estimates"] == 1  # id 0's 512 is PyTorch's rounding, not read from a block
    assert "512" in m["recorded_peak_allocated_note"]


def test_address_reuse_gives_fresh_ids():
    X = B
    snap = snapshot(
        [[segment_alloc(X, 20 * MiB),      # 3 MiB -> a 20 MiB segment, split
          alloc(X, 3 * MiB), free(X, 3 * MiB),
          alloc(X, 2 * MiB), free(X, 2 * MiB),
          alloc(X, 5 * MiB)]],
        [segment(X, [live(5 * MiB, 5 * MiB), block(15 * MiB)])])
    t = from_torch_snapshot(snap)
    kind, ids, size, _ = columns(t)
    assert kind == [ALLOC, FREE, ALLOC, FREE, ALLOC]
    assert ids == [0, 0, 1, 1, 2]
    assert size == [3 * MiB, 3 * MiB, 2 * MiB, 2 * MiB, 5 * MiB]
    assert t.free_index.tolist() == [1, 3, -1]


def test_blocks_alive_before_the_trace():
    L = C  # a 20 MiB large segment
    snap = snapshot(
        [[free_requested(A + 2048, 4096, frames=[USER]),  # allocated before the trace
          free_completed(A + 2048, 4096, frames=[USER]),  # merges with the free rest of the segment
          alloc(A + 2048, 3000, frames=[USER])]],        # 3072 split from it: a new block, same address
        [segment(A, [live(2048, 2000, [USER2]),           # alive throughout: no entry names it
                     live(3072, 3000, [USER]),            # the alloc in the trace
                     block(2 * MiB - 5120)]),
         # alive throughout: 1572000 rounds up to 1572352, a large request: a 20 MiB segment, split
         segment(L, [live(1572352, 1572000, []), block(20 * MiB - 1572352)])])
    t = from_torch_snapshot(snap)
    kind, ids, size, _ = columns(t)
    # initial ALLOCs first, in address order: A (2000), A+2048 (4096), L (1572000)
    assert kind == [ALLOC, ALLOC, ALLOC, FREE, ALLOC]
    assert ids == [0, 1, 2, 1, 3]
    assert size == [2000, 4096, 1572000, 4096, 3000]  # requested bytes, like PyTorch's alloc entries
    # A's block has its allocation stack; a free entry's stack is not where it was allocated
    assert [t.name_of("modules", i) for i in t.alloc_module] == ["/home/u/proj/model.py:10", "?", "?",
                                                                  "/home/u/proj/train.py:42"]
    assert t.alloc_module.tolist()[1:3] == [-1, -1]
    m = t.meta
    assert m["initial_allocations"] == 3 and m["unfinished_frees"] == 0
    assert m["recorded_reserved"] == 2 * MiB + 20 * MiB == 23068672
    assert m["recorded_peak_reserved"] == 23068672  # no segment entries: reserved never changed
    assert m["recorded_allocated"] == 2048 + 3072 + 1572352 == 1577472
    assert m["recorded_requested"] == 2000 + 3000 + 1572000 == 1577000
    # allocated: start 2048 + 4096 + 1572352 = 1578496; free 4096 -> 1574400; +3072 -> 1577472
    assert m["recorded_peak_allocated"] == 1578496
    assert m["allocated_size_estimates"] == 1  # the 4096 freed in the trace


def test_no_trace_entries_the_live_blocks_are_the_trace():
    snap = snapshot([[]], [segment(A, [live(512, 8, [USER]), pending(1024, 1000), block(2 * MiB - 1536)])])
    t = from_torch_snapshot(snap)
    assert columns(t) == ([ALLOC, ALLOC], [0, 1], [8, 1000], [0, 0])
    assert t.meta["initial_allocations"] == 2 and t.meta["num_trace_entries"] == 0
    assert t.meta["recorded_allocated"] == 1536 and t.meta["recorded_memory_allocated"] == 512
    assert t.meta["recorded_peak_allocated"] == 1536 and t.meta["recorded_peak_reserved"] == 2 * MiB


def test_free_requested_without_free_completed_stays_live():
    # X and W are used on another stream (record_stream), so their free waits for its events.
    X, W, V, Z = A, A + 8192, A + 12288, A + 12800
    snap = snapshot(
        [[free_requested(Z, 1500, stream=S1),   # allocated before the trace, free never completed
          alloc(X, 8192, stream=S1),
          alloc(W, 4096, stream=S1),
          free_requested(W, 4096, stream=S1),
          alloc(V, 500, stream=S1),           # W's memory is not reusable yet
          free_completed(W, 4096, stream=S1),  # now it is
          free_requested(X, 8192, stream=S1)]],  # never completed
        [segment(A, [pending(8192, 8192),                          # X
                     block(4096),                                  # W, freed
                     live(512, 500),                               # V
                     pending(1536, 1500, "active_awaiting_free"),  # Z, the docstring's spelling
                     block(2 * MiB - 14336)], stream=S1)])
    t = from_torch_snapshot(snap)
    kind, ids, size, stream = columns(t)
    # Z first (alive before), then X, W, V; W's FREE where its free completed; none for X and Z
    assert kind == [ALLOC, ALLOC, ALLOC, ALLOC, FREE]
    assert ids == [0, 1, 2, 3, 2]
    assert size == [1500, 8192, 4096, 500, 4096]
    assert stream == [S1] * 5
    m = t.meta
    assert m["unfinished_frees"] == 2 and m["initial_allocations"] == 1
    assert t.free_index.tolist() == [-1, -1, 4, -1]
    assert m["recorded_allocated"] == 8192 + 512 + 1536 == 10240  # active blocks, awaiting free included
    assert m["recorded_memory_allocated"] == 512  # what torch.cuda.memory_allocated() counts
    assert m["recorded_requested"] == 8192 + 500 + 1500 == 10192
    # allocated: 1536 (Z, block known), +8192 = 9728, +4096 = 13824 (W: 4096 is already a multiple of 512),
    # +512 = 14336, -4096 = 10240
    assert m["recorded_peak_allocated"] == 14336


def test_several_streams():
    snap = snapshot(
        [[segment_alloc(A, 2 * MiB, stream=0), alloc(A, 4096, stream=0),
          segment_alloc(B, 2 * MiB, stream=S1), alloc(B, 4096, stream=S1),
          free(A, 4096, stream=0)]],
        [segment(A, [block(2 * MiB)], stream=0),
         segment(B, [live(4096, 4096), block(2 * MiB - 4096)], stream=S1),
         # alive throughout, on S2: 2097052 B rounds to 2 MiB, a large request: a 20 MiB segment, split
         segment(C, [live(2 * MiB, 2097052), block(18 * MiB)], stream=S2)])
    t = from_torch_snapshot(snap)
    kind, ids, size, stream = columns(t)
    assert kind == [ALLOC, ALLOC, ALLOC, FREE]
    assert ids == [0, 1, 2, 1]
    assert size == [2097052, 4096, 4096, 4096]
    assert stream == [S2, 0, S1, 0]  # the initial block takes its segment's stream
    assert t.stream.dtype == np.uint64
    assert t.meta["recorded_reserved"] == 2 * MiB + 2 * MiB + 20 * MiB
    # reserved: 24 MiB at the end, less the two 2 MiB segment_allocs = 20 MiB at the start; peak 24 MiB
    assert t.meta["recorded_peak_reserved"] == 24 * MiB


def test_oom_entry(tmp_path):
    snap = snapshot(
        [[segment_alloc(B, 20 * MiB),
          alloc(B, 6 * MiB),
          # a 30000000-byte request fails; the entry records it rounded: 58594 * 512 = 30000128
          oom(30000128, device_free=5 * MiB),
          free(B, 6 * MiB)]],
        [segment(B, [block(20 * MiB)])])
    t = from_torch_snapshot(snap)
    assert columns(t)[0] == [ALLOC, FREE]
    # the OOM came after event 0: the first event after it is index 1
    assert t.meta["recorded_ooms"] == [{"event": 1, "size": 30000128, "device_free": 5 * MiB}]
    assert t.meta["recorded_allocated"] == 0 and t.meta["recorded_reserved"] == 20 * MiB
    assert t.meta["recorded_peak_allocated"] == 6 * MiB
    assert Trace.load(t.save(tmp_path / "t.vktrace")).meta == t.meta  # meta is JSON as it is


def two_device_snapshot() -> dict:
    return snapshot(
        [[segment_alloc(A, 2 * MiB), alloc(A, 100)],
         [segment_alloc(B, 20 * MiB), alloc(B, 3 * MiB), alloc(B + 3 * MiB, 2 * MiB), free(B, 3 * MiB)]],
        [segment(A, [live(512, 100), block(2 * MiB - 512)], device=0),
         segment(B, [block(3 * MiB), live(2 * MiB, 2 * MiB), block(15 * MiB)], device=1)])


def test_two_devices_need_device():
    with pytest.raises(TraceFormatError, match=r"devices \[0, 1\].*device="):
        from_torch_snapshot(two_device_snapshot())
    t = from_torch_snapshot(two_device_snapshot(), device=1)
    assert columns(t)[:3] == ([ALLOC, ALLOC, FREE], [0, 1, 0], [3 * MiB, 2 * MiB, 3 * MiB])
    m = t.meta
    assert m["device"] == 1 and m["num_trace_entries"] == 5
    assert m["recorded_reserved"] == 20 * MiB and m["recorded_allocated"] == 2 * MiB  # device 1's segment only
    assert m["recorded_peak_allocated"] == 3 * MiB + 2 * MiB
    t0 = from_torch_snapshot(two_device_snapshot(), device=0)
    assert columns(t0)[:3] == ([ALLOC], [0], [100]) and t0.meta["recorded_reserved"] == 2 * MiB


def test_device_none_picks_the_only_device_with_entries():
    snap = two_device_snapshot()
    snap["device_traces"][0] = []
    t = from_torch_snapshot(snap)
    assert t.meta["device"] == 1 and t.num_events == 3


def test_vramkit_snapshot_sizes_are_block_sizes():
    # vramkit's dump_snapshot records block sizes in its entries and names its device
    snap = snapshot([[segment_alloc(A, 2 * MiB), alloc(A + 1024, 512), free(A + 1024, 512)]],
                    [segment(A, [live(1024, 1000), block(2 * MiB - 1024)])], vramkit_device="sim:0")
    t = from_torch_snapshot(snap)
    assert columns(t)[:3] == ([ALLOC, ALLOC, FREE], [0, 1, 1], [1024, 512, 512])  # the initial block: size 1024
    m = t.meta
    assert m["trace_sizes"] == "block" and m["allocated_size_estimates"] == 0 and m["recorded_on"] == "sim:0"
    assert m["recorded_peak_allocated"] == 1024 + 512


def test_recorded_figures_with_segment_entries():
    snap = snapshot(
        [[segment_alloc(C, 12 * MiB),   # 12 MiB -> a segment of exactly 12 MiB
          alloc(C, 12 * MiB),
          segment_alloc(B, 20 * MiB),   # 3 MiB -> a 20 MiB segment (C is full)
          alloc(B, 3 * MiB),
          free(C, 12 * MiB),
          segment_free(C, 12 * MiB),    # empty_cache()
          alloc(B + 3 * MiB, 4194000)]],  # rounds to 8192 * 512 = 4 MiB; 13 MiB remain, split
        [segment(A, [live(512, 100, [USER]), block(2 * MiB - 512)]),  # from before the trace
         segment(B, [live(3 * MiB, 3 * MiB), live(4 * MiB, 4194000), block(13 * MiB)])])
    m = from_torch_snapshot(snap).meta
    assert m["recorded_reserved"] == 2 * MiB + 20 * MiB == 23068672
    # start = 23068672 - (12 MiB + 20 MiB - 12 MiB) = 2097152; then 14680064, 35651584, 23068672
    assert m["recorded_peak_reserved"] == 35651584
    assert m["recorded_allocated"] == 512 + 3 * MiB + 4 * MiB == 7340544
    assert m["recorded_memory_allocated"] == 7340544
    assert m["recorded_requested"] == 100 + 3145728 + 4194000 == 7339828
    # allocated: 512, +12582912 = 12583424, +3145728 = 15729152, -12582912 = 3146240, +4194304 = 7340544
    assert m["recorded_peak_allocated"] == 15729152
    assert m["initial_allocations"] == 1 and m["allocated_size_estimates"] == 1


# ---------------------------------------------------------------------------------- attribution


def test_attribution_skips_torch_vramkit_pseudo_files_and_cpp():
    stack = [frame("aten/src/ATen/native/cuda/Blas.cpp", 300, "at::native::addmm_out_cuda_impl"),
             TORCH,
             frame("/home/u/.venv/lib/python3.11/site-packages/vramkit/torch/meters.py", 88, "malloc"),
             frame("/home/u/src/vramkit/python/vramkit/amp/loss_scaling.py", 12, "scale"),
             frame("<frozen runpy>", 198, "_run_module_as_main"),
             frame("<string>", 1, "<module>"),
             frame("/home/u/proj/model.py", 42, "forward"),  # the first of the user's frames
             frame("/home/u/proj/train.py", 7, "main")]
    examples = [TORCH, frame("/home/u/vramkit/examples/gpt_fit.py", 30, "step")]
    only_torch = [TORCH, frame("<frozen runpy>", 88, "_run_code")]
    snap = snapshot([[segment_alloc(A, 2 * MiB), alloc(A, 512, frames=stack), alloc(A + 512, 512, frames=stack),
                      alloc(A + 1024, 512, frames=examples), alloc(A + 1536, 512, frames=only_torch),
                      alloc(A + 2048, 512)]],
                    [segment(A, [live(512, 512)] * 5 + [block(2 * MiB - 2560)])])
    t = from_torch_snapshot(snap)
    assert t.modules == ["/home/u/proj/model.py:42", "/home/u/vramkit/examples/gpt_fit.py:30"]
    assert t.ops == ["forward", "step"]
    assert t.alloc_module.tolist() == [0, 0, 1, -1, -1]
    assert t.alloc_op.tolist() == [0, 0, 1, -1, -1]


# ---------------------------------------------------------------------------------- files and errors


def test_pickle_path_forms(tmp_path):
    snap = two_device_snapshot()
    path = write_pickle(snap, tmp_path / "snap.pickle")
    want = from_torch_snapshot(snap, device=1)
    for form in (path, pathlib.Path(path)):
        got = from_torch_snapshot(form, device=1)
        for col in ("kind", "id", "size", "stream", "alloc_module", "alloc_op"):
            np.testing.assert_array_equal(getattr(got, col), getattr(want, col))
        assert got.meta == want.meta and got.modules == want.modules


def test_truncated_pickle(tmp_path):
    path = write_pickle(two_device_snapshot(), tmp_path / "snap.pickle")
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[:len(data) // 2])
    with pytest.raises(TraceFormatError, match=r"snap\.pickle: not a readable pickle.*_dump_snapshot"):
        from_torch_snapshot(path)


def test_pickle_of_a_list(tmp_path):
    path = tmp_path / "list.pickle"
    with open(path, "wb") as f:
        pickle.dump([1, 2, 3], f)
    with pytest.raises(TraceFormatError, match=r"holds a list of 3 entries, expected a dict .*'segments' and 'device_traces'"):
        from_torch_snapshot(path)


def test_missing_keys():
    with pytest.raises(TraceFormatError, match=r"missing 'device_traces'; expected a dict"):
        from_torch_snapshot({"segments": []})
    with pytest.raises(TraceFormatError, match=r"missing 'segments' and 'device_traces'"):
        from_torch_snapshot({"traces": []})


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        from_torch_snapshot(tmp_path / "nope.pickle")


def test_device_out_of_range():
    with pytest.raises(ValueError, match=r"device 2 is out of range.*valid devices are 0\.\.1"):
        from_torch_snapshot(two_device_snapshot(), device=2)
    with pytest.raises(ValueError, match=r"device -1 is out of range"):
        from_torch_snapshot(two_device_snapshot(), device=-1)
    with pytest.raises(ValueError, match="an int"):
        from_torch_snapshot(two_device_snapshot(), device="1")
    assert not issubclass(ValueError, TraceFormatError)  # out of range is the caller's error, not the file's


def test_wrong_argument_type():
    with pytest.raises(TypeError, match="snapshot must be a dict"):
        from_torch_snapshot(42)


@pytest.mark.parametrize("entries, index, message", [
    ([{"action": "alloc", "size": 512}], 0, "malformed entry"),                        # no addr
    ([alloc(A, 512), free(A, 512), free_completed(A, 512)], 3, "no block is allocated"),
    ([alloc(A, 512), alloc(A, 1024)], 1, "not yet freed"),
    ([alloc(A, 512), free(A, 512), free_requested(A, 512)], 3, "no block is allocated"),
    (["alloc"], 0, "malformed entry"),
])
def test_contradicting_or_malformed_entries(entries, index, message):
    snap = snapshot([entries], [segment(A, [block(2 * MiB)])])
    with pytest.raises(TraceFormatError, match=rf"device_traces\[0\]\[{index}\]: .*{message}"):
        from_torch_snapshot(snap)


def test_large_trace_is_linear(hang_guard):
    # About a second here: a step quadratic in the entries would take hours, and the hang guard
    # cuts it off. The speed (and that it stays linear) is benchmarks/snapshot_import.py's.
    n = 100_000
    stack = [TORCH, USER]  # shared, as the pickled frames lists are
    entries = [segment_alloc(A, 2 * MiB)]
    for i in range(n):
        addr = A + (i % 64) * 512
        entries += [alloc(addr, 400, frames=stack), free_requested(addr, 400), free_completed(addr, 400)]
    snap = snapshot([entries], [segment(A, [block(2 * MiB)])])
    t = hang_guard(300, from_torch_snapshot, snap)
    assert t.num_events == 2 * n and t.num_allocations == n
    assert t.modules == ["/home/u/proj/train.py:42"] and t.meta["recorded_peak_allocated"] == 512


# ---------------------------------------------------------------------------------- replay


@pytest.mark.skipif(not hasattr(_C, "trace_replay"), reason="vramkit._C.trace_replay is not built yet")
def test_replay_matches_the_recorded_totals():
    # One stream, PyTorch's policy step by step (allocated = block sizes, reserved = segments):
    snap = snapshot(
        [[segment_alloc(A, 2 * MiB),        # 100 B -> 512 in a new 2 MiB small segment
          alloc(A, 100),                    # allocated 512, reserved 2097152
          alloc(A + 512, 1000),             # 1024 split from the rest: allocated 1536
          segment_alloc(C, 12 * MiB),       # 12 MiB -> a 12 MiB segment, not split
          alloc(C, 12 * MiB),               # allocated 12584448, reserved 14680064
          segment_alloc(B, 20 * MiB),       # 3 MiB -> a 20 MiB segment, 17 MiB remain (split)
          alloc(B, 3 * MiB),                # allocated 15730176, reserved 35651584 (peak)
          free(A, 100),                     # allocated 15729664
          alloc(A, 200),                    # 512: the freed 512 block, exactly; 15730176
          free(B, 3 * MiB),                 # merges back to 20 MiB free; 12584448
          alloc(B, 5 * MiB),                # split, 15 MiB remain: 17827328 (peak)
          free(C, 12 * MiB),                # 5244416
          alloc(C, 12058624),               # 11.5 MiB: best fit is C (12 MiB); 0.5 MiB would remain,
                                            # not > 1 MiB, so unsplit: +12582912 = 17827328
          free(A, 200)]],                   # 17826816
        [segment(A, [block(512), live(1024, 1000), block(2 * MiB - 1536)]),
         segment(B, [live(5 * MiB, 5 * MiB), block(15 * MiB)]),
         segment(C, [live(12 * MiB, 12058624)])])
    t = from_torch_snapshot(snap)
    m = t.meta
    assert m["recorded_allocated"] == 1024 + 5 * MiB + 12 * MiB == 17826816
    assert m["recorded_reserved"] == 2 * MiB + 20 * MiB + 12 * MiB == 35651584
    assert m["recorded_peak_reserved"] == 35651584
    assert m["recorded_peak_allocated"] == 17827328
    r = _C.trace_replay(t.kind, t.id, t.size, t.stream, 1 << 40, None, None, None, None)
    assert r["oom_event"] == -1
    assert r["final_allocated"] == m["recorded_allocated"]
    assert r["final_reserved"] == m["recorded_reserved"]
    assert r["peak_allocated"] == m["recorded_peak_allocated"]
    assert r["peak_reserved"] == m["recorded_peak_reserved"]
