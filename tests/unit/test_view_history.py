"""`vramkit view`'s history: the C snapshot reader against vramkit's Python importer, and every
query against a brute-force recomputation from the events (independent of the C loops)."""

from __future__ import annotations

import os
import pickle
import random

import numpy as np
import pytest

import torch_snapshots as ts
from vramkit.trace.formats.file_format import Trace, TraceFormatError
from vramkit.trace.formats.snapshot_import import from_torch_snapshot
from vramkit.view import history as history_mod
from vramkit.view.loading import cache_path, load_history

FILES = ["/home/u/train.py", "/home/u/model.py", "/usr/lib/python3/site-packages/torch/nn/functional.py",
         "/home/u/data.py"]


def random_snapshot(seed: int, steps: int = 300, shared_frames: bool = True) -> dict:
    """Allocations and frees on two streams, some freed in two steps, blocks alive before the
    trace (first seen freed, or only in the final segments), segment changes and an OOM."""
    rng = random.Random(seed)
    stacks = [[ts.frame(rng.choice(FILES), rng.randrange(1, 400), rng.choice(["fwd", "bwd", "step", "f\u00e9"]))
               for _ in range(rng.randrange(1, 4))] for _ in range(12)]
    live: dict[int, int] = {}
    entries: list = []
    # three blocks alive before the trace, named first by their free
    for k in range(3):
        addr = 0x9000_0000 + k * 0x10000
        entries += ts.free(addr, 1000 + k)
    next_addr = 0x1000_0000
    for _ in range(steps):
        r = rng.random()
        if r < 0.55 or not live:
            size = rng.choice([512, 1024, 3000, 1 << 20, rng.randrange(1, 1 << 22)])
            frames = rng.choice(stacks)
            entries.append(ts.alloc(next_addr, size, rng.choice([0, 7]), frames if shared_frames else list(frames)))
            live[next_addr] = size
            next_addr += 1 << 23
        elif r < 0.95:
            addr = rng.choice(sorted(live))
            size = live.pop(addr)
            entries += ts.free(addr, size)
        elif r < 0.98:
            entries.append(ts.segment_alloc(next_addr, 1 << 21))
            next_addr += 1 << 23
        else:
            entries.append(ts.oom(1 << 30, rng.randrange(1 << 20)))
    # a block live at the end that no entry names
    segs = [ts.segment(0x7000_0000, [ts.live(2048, 2000, stacks[0]), ts.block(4096)])]
    return ts.snapshot([entries], segs)


def brute(trace: Trace) -> tuple[np.ndarray, list[list[int]]]:
    """live bytes after each event, and the ids live after each event (in id order)."""
    total, alive, totals, sets = 0, set(), [], []
    for k, i, s in zip(trace.kind.tolist(), trace.id.tolist(), trace.size.tolist()):
        if k == 0:
            total += s
            alive.add(i)
        else:
            total -= s
            alive.discard(i)
        totals.append(total)
        sets.append(sorted(alive))
    return np.array(totals), sets


@pytest.mark.parametrize("protocol", [0, 1, 2, 3, 4, 5])
@pytest.mark.parametrize("shared", [True, False])
def test_reader_matches_the_python_importer(tmp_path, protocol, shared):
    snap = random_snapshot(protocol * 7 + shared, shared_frames=shared)
    path = tmp_path / "s.pickle"
    with open(path, "wb") as f:
        pickle.dump(snap, f, protocol=protocol)
    h = load_history(path, cache=False)
    t = from_torch_snapshot(os.fspath(path))
    assert h.ev_kind.tolist() == t.kind.tolist()
    assert h.ev_id.tolist() == t.id.tolist()
    sizes = np.zeros(len(h.a_size), np.uint64)
    sizes[t.id] = t.size
    assert h.a_size.tolist() == sizes.tolist()
    streams = np.zeros(len(h.a_size), np.uint64)
    streams[t.id] = t.stream
    assert h.a_stream.tolist() == streams.tolist()
    assert len(h.oom_event) == len(t.meta["recorded_ooms"])
    assert h.oom_event.tolist() == [o["event"] for o in t.meta["recorded_ooms"]]
    # each allocation's stack is its entry's frames, exactly
    allocs = [e for e in snap["device_traces"][0] if e["action"] == "alloc"]
    first_traced = t.meta["initial_allocations"]
    for k, e in enumerate(allocs):
        assert h.stack(int(h.a_stack[first_traced + k])) == e["frames"]
    # the site grouping names the innermost frame outside torch/
    site = h.groupings["site"]
    for k, e in enumerate(allocs):
        user = [f for f in e["frames"] if "/torch/" not in f["filename"]]
        g = int(site.group[first_traced + k])
        if g < len(site.labels):
            f = user[0]
            assert site.labels[g] == f"{f['filename']}:{f['line']} {f['name']}"


def test_shared_frames_are_one_stack(tmp_path):
    snap = random_snapshot(3, shared_frames=True)
    path = ts.write_pickle(snap, tmp_path / "s.pickle")
    h = load_history(path, cache=False)
    distinct = {tuple(tuple(sorted(f.items())) for f in e["frames"])
                for e in snap["device_traces"][0] if e["action"] == "alloc" and e["frames"]}
    distinct.add(tuple(tuple(sorted(f.items())) for f in snap["segments"][0]["blocks"][0]["frames"]))
    assert len(h.stack_start) - 1 == len(distinct)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path = ts.write_pickle(random_snapshot(11, steps=3000), tmp_path_factory.mktemp("v") / "s.pickle")
    old = history_mod.EVERY
    h = load_history(path, cache=False)
    t = from_torch_snapshot(path)
    totals, sets = brute(t)
    return h, t, totals, sets, old


def test_timeline_against_brute_force(loaded):
    h, t, totals, sets, _ = loaded
    g = h.groupings["site"]
    rng = random.Random(5)
    for _ in range(40):
        a = rng.randrange(0, h.events - 1)
        b = rng.randrange(a + 1, h.events + 1)
        w = rng.choice([1, 3, 50, 700])
        out = h.timeline(a, b, w, "site")
        x = out["x"]
        assert x[0] == a and x[-1] == b and len(x) == out["width"] + 1 <= w + 1
        for k in range(out["width"]):
            span = totals[x[k]:x[k + 1]]
            assert out["max"][k] == span.max() and out["min"][k] == span.min()
            peak_at = x[k] + int(np.argmax(span))
            held = np.zeros(g.groups, np.int64)
            for i in sets[peak_at]:
                held[g.group[i]] += int(h.a_size[i])
            bands = {band["id"]: band["bytes"][k] for band in out["bands"]}
            assert [bands.get(j, 0) for j in range(g.groups)] == held.tolist()
            assert sum(bands.values()) == out["max"][k]


def test_checkpoints_do_not_change_answers(loaded, monkeypatch):
    h, t, totals, sets, _ = loaded
    want = h.timeline(17, h.events, 64, "site")
    for every in (1, 7, 1000):
        monkeypatch.setattr(history_mod, "EVERY", every)
        g = h.groupings["site"]
        g.ckpt = h._checkpoints(g.group, g.groups)
        assert h.timeline(17, h.events, 64, "site") == want
    monkeypatch.undo()
    g.ckpt = h._checkpoints(g.group, g.groups)


def test_at_is_the_allocation_stacked_there(loaded):
    h, t, totals, sets, _ = loaded
    rng = random.Random(9)
    for _ in range(200):
        e = rng.randrange(h.events)
        y = rng.randrange(0, max(1, int(totals[e]) + 100))
        got = h.at(e, y)
        assert got["live_bytes"] == totals[e] and got["live_count"] == len(sets[e])
        below = 0
        want = None
        for i in sets[e]:
            if below <= y < below + int(h.a_size[i]):
                want = i
                break
            below += int(h.a_size[i])
        assert (got["allocation"] or {}).get("id") == want
        if want is not None:
            a = got["allocation"]
            assert a["lo"] == below and a["hi"] == below + int(h.a_size[want])
            assert a["frames"] == h.stack(int(h.a_stack[want]))


def test_allocation_bands_match_the_stacking(loaded):
    h, t, totals, sets, _ = loaded
    start, end = 400, 700
    out = h.timeline(start, end, 100, "site")
    assert out["allocations"]
    for band in out["allocations"]:
        a, pts = band["id"], band["points"]
        for (e0, lo, hi), (e1, _, _) in zip(pts[:-1], pts[1:]):
            for e in range(e0, e1):
                assert a in sets[e]
                below = sum(int(h.a_size[i]) for i in sets[e] if i < a)
                assert (lo, hi) == (below, below + int(h.a_size[a]))


def test_search_counts_and_overlay(loaded):
    h, t, totals, sets, _ = loaded
    res = h.search("MODEL.py")
    match = h._matching("model.py")
    want = [i for i in range(len(h.a_size)) if any("model.py" in f["filename"] for f in h.stack(int(h.a_stack[i])))]
    assert np.flatnonzero(match).tolist() == want and res["allocations"] == len(want)
    matched_live = [sum(int(h.a_size[i]) for i in s if match[i]) for s in sets]
    assert res["peak_bytes"] == max(matched_live)
    out = h.timeline(0, h.events, 37, "site", search="model.py")
    for k in range(out["width"]):
        assert out["match"][k] == max(matched_live[out["x"][k]:out["x"][k + 1]])


def test_segments_at_an_event(tmp_path):
    entries = [ts.segment_alloc(0x100000, 1 << 21), ts.alloc(0x100000, 4096), ts.alloc(0x101000, 512),
               ts.segment_alloc(0x400000, 1 << 21), *ts.free(0x100000, 4096), ts.segment_free(0x400000, 1 << 21)]
    snap = ts.snapshot([entries], [ts.segment(0x100000, [ts.block(4096), ts.live(512, 512), ts.block((1 << 21) - 4608)])])
    h = load_history(ts.write_pickle(snap, tmp_path / "s.pickle"), cache=False)
    s0 = h.segments(0)
    assert [(s["addr"], s["size"]) for s in s0["segments"]] == [(0x100000, 1 << 21)]
    assert [b["addr"] for b in s0["segments"][0]["blocks"]] == [0x100000]
    s1 = h.segments(1)  # the second segment_alloc comes before event 2 (the free_completed)
    assert [s["addr"] for s in s1["segments"]] == [0x100000] and s1["allocated"] == 4608
    s2 = h.segments(2)  # its segment_free comes after the last event
    assert [s["addr"] for s in s2["segments"]] == [0x100000, 0x400000] and s2["reserved"] == 2 << 21
    assert s2["allocated"] == 512 and [b["addr"] for b in s2["segments"][0]["blocks"]] == [0x101000]


def test_bad_queries_are_value_errors(loaded):
    h = loaded[0]
    for call in (lambda: h.timeline(5, 5, 10, "site"), lambda: h.timeline(0, h.events + 1, 10, "site"),
                 lambda: h.timeline(0, 10, 0, "site"), lambda: h.timeline(0, 10, 10, "nope"),
                 lambda: h.at(-1, 0), lambda: h.segments(h.events), lambda: h.search("")):
        with pytest.raises(ValueError):
            call()


def test_unsafe_and_malformed_files(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    bad = tmp_path / "evil.pickle"
    bad.write_bytes(pickle.dumps({"segments": [], "device_traces": [[Evil()]]}))
    with pytest.raises(TraceFormatError, match="system"):
        load_history(bad, cache=False)
    good = pickle.dumps(random_snapshot(1, steps=50))
    cut = tmp_path / "cut.pickle"
    cut.write_bytes(good[:len(good) // 2])
    with pytest.raises(TraceFormatError, match="truncated|past the end|more bytes|longer than the data"):
        load_history(cut, cache=False)
    contradicting = tmp_path / "c.pickle"
    ts.write_pickle(ts.snapshot([[ts.alloc(0x10, 512), ts.alloc(0x10, 512)]], []), contradicting)
    with pytest.raises(TraceFormatError) as ours:
        load_history(contradicting, cache=False)
    with pytest.raises(TraceFormatError) as theirs:
        from_torch_snapshot(os.fspath(contradicting))
    assert str(ours.value).split(": ", 1)[1] == str(theirs.value).split(": ", 1)[1].replace("0x10,", "0x10,")
    for obj, words in (([1, 2], "expected a dict"), ({"segments": []}, "missing 'device_traces'"),
                       ({"segments": [], "device_traces": [[{"action": "alloc", "addr": 1, "size": -4}]]},
                        "'size' is negative")):
        p = tmp_path / "x.pickle"
        p.write_bytes(pickle.dumps(obj))
        with pytest.raises(TraceFormatError, match=words):
            load_history(p, cache=False)


def test_cache_is_used_and_checked(tmp_path):
    path = ts.write_pickle(random_snapshot(2, steps=200), tmp_path / "s.pickle")
    first = load_history(path)
    where = cache_path(path)
    assert os.path.exists(where)
    again = load_history(path)
    assert isinstance(again.ev_kind, np.memmap) or isinstance(again.ev_kind.base, np.memmap)
    assert again.timeline(0, again.events, 50, "site") == first.timeline(0, first.events, 50, "site")
    # damage the cache: the file is summarized again, with the same answers
    raw = bytearray(open(where, "rb").read())
    raw[len(raw) // 2:] = b"\xff" * (len(raw) - len(raw) // 2)
    open(where, "wb").write(bytes(raw))
    third = load_history(path)
    assert third.timeline(0, third.events, 50, "site") == first.timeline(0, first.events, 50, "site")
    # a changed file is never answered from the old cache
    ts.write_pickle(random_snapshot(4, steps=100), path)
    os.utime(path, ns=(1, 1))
    fourth = load_history(path)
    assert fourth.events == len(from_torch_snapshot(path).kind)
    assert fourth.events != first.events


def test_vktrace_groupings(tmp_path):
    kinds = [0, 0, 1, 0, 1, 1]
    ids = [0, 1, 0, 2, 1, 2]
    sizes = [100, 200, 100, 300, 200, 300]
    trace = Trace.from_columns(kind=np.array(kinds, np.uint8), id=np.array(ids), size=np.array(sizes, np.uint64),
                               alloc_category=np.array([0, 3, 3], np.uint8), alloc_module=np.array([0, 1, -1]),
                               modules=["encoder", "decoder"])
    path = trace.save(tmp_path / "t.vktrace")
    h = load_history(path, cache=False)
    assert set(h.groupings) == {"category", "module"}
    out = h.timeline(0, 6, 6, "category")
    assert out["max"] == [100, 300, 200, 500, 300, 0]
    labels = h.groupings["category"].labels
    act = labels.index("activation")
    assert {b["id"]: b["bytes"] for b in out["bands"]}[act] == [0, 200, 200, 500, 300, 0]
    assert h.search("decoder")["allocations"] == 1


def _shared_histories() -> list[str]:
    """The allocator histories recorded on a real H100 (../shared/gpu-histories), where present."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for shared in (os.path.join(os.path.dirname(root), "shared"), "/work/shared"):
        folder = os.path.join(shared, "gpu-histories", "h100-2026-11-27")
        if os.path.isdir(folder):
            return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".pickle"))
    return []


@pytest.mark.parametrize("path", _shared_histories() or [None])
def test_real_h100_snapshots(path, tmp_path):
    if path is None:
        pytest.skip("no ../shared/gpu-histories here (the H100 recordings)")
    h = load_history(path, cache=False)
    t = from_torch_snapshot(path)
    assert h.ev_kind.tolist() == t.kind.tolist() and h.ev_id.tolist() == t.id.tolist()
    totals, sets = brute(t)
    assert h.info()["peak_bytes"] == totals.max()
    _answers_are_json(h)
    # the segments after the last event are the snapshot's final segments
    last = h.segments(h.events - 1)
    assert last["reserved"] == t.meta["recorded_reserved"]
    # every allocation's stack is its alloc entry's frames
    entries = [e for e in pickle.load(open(path, "rb"))["device_traces"][0] if e["action"] == "alloc"]
    first = t.meta["initial_allocations"]
    for k, e in enumerate(entries[:500]):
        assert h.stack(int(h.a_stack[first + k])) == e["frames"]


def test_mutated_pickles_fail_cleanly(tmp_path):
    """Random byte flips, cuts and insertions of a valid snapshot: a TraceFormatError or a
    history, never a crash (this file also runs under ASan/UBSan in CI)."""
    good = bytearray(pickle.dumps(random_snapshot(8, steps=80), protocol=4))
    rng = random.Random(int(os.environ.get("VRAMKIT_FUZZ_SEED", "1")))
    path = tmp_path / "m.pickle"
    outcomes = {"error": 0, "read": 0}
    for _ in range(int(os.environ.get("VRAMKIT_FUZZ_CASES", "400"))):
        data = bytearray(good)
        for _ in range(rng.randrange(1, 4)):
            at = rng.randrange(len(data))
            r = rng.random()
            if r < 0.6:
                data[at] = rng.randrange(256)
            elif r < 0.8:
                del data[at:at + rng.randrange(1, 16)]
            else:
                data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 9)))
        path.write_bytes(bytes(data))
        try:
            h = load_history(path, cache=False)
        except (TraceFormatError, ValueError):
            outcomes["error"] += 1
        else:
            outcomes["read"] += 1
            if h.events:
                h.timeline(0, h.events, 16, "site")
    assert outcomes["error"] > 0 and sum(outcomes.values()) == int(os.environ.get("VRAMKIT_FUZZ_CASES", "400"))


def test_query_columns_are_checked():
    from vramkit import _C

    kind = np.array([0, 0, 1], np.uint8)
    ids = np.array([0, 1, 0], np.uint32)
    size = np.array([10, 20], np.uint64)
    group = np.array([0, 1], np.int32)
    ckpt = np.frombuffer(_C.view_checkpoints(kind, ids, size, group, 2, 2), np.int64)
    assert ckpt.tolist() == [0, 0, 10, 20]  # before event 0, before event 2
    raw = np.zeros(17, np.uint8)
    odd = raw[1:13].view(np.uint32)  # a view at an odd address
    with pytest.raises(ValueError, match="aligned"):
        _C.view_checkpoints(kind, odd, size, group, 2, 2)
    with pytest.raises(ValueError, match="names allocation 5"):
        _C.view_checkpoints(kind, np.array([0, 5, 0], np.uint32), size, group, 2, 1)
    with pytest.raises(ValueError, match="group"):
        _C.view_checkpoints(kind, ids, size, np.array([0, 2], np.int32), 2, 1)
    with pytest.raises(ValueError, match="sorted"):
        _C.view_groups_at(kind, ids, size, group, 2, ckpt, 2, np.array([2, 1], np.uint64))
    with pytest.raises(ValueError, match="ckpt"):
        _C.view_groups_at(kind, ids, size, group, 2, ckpt[:3], 2, np.array([1], np.uint64))
    with pytest.raises(ValueError, match="edges"):
        _C.view_group_peaks(kind, ids, size, group, 2, ckpt, 2, np.array([0, 4], np.uint64), 1)
    at = np.frombuffer(_C.view_groups_at(kind, ids, size, group, 2, ckpt, 2, np.array([0, 1, 2], np.uint64)),
                       np.int64).reshape(3, 2)
    assert at.tolist() == [[10, 0], [10, 20], [0, 20]]
    peaks = np.frombuffer(_C.view_group_peaks(kind, ids, size, group, 2, ckpt, 2, np.array([0, 2, 3], np.uint64), 0),
                          np.int64)
    assert peaks.tolist() == [10, 0]


def _answers_are_json(h) -> None:
    """Every query's answer is plain JSON (the server sends it as is): no NumPy scalars, no NaN."""
    import json

    rng = random.Random(4)
    n = h.events
    answers = [h.info(), h.timeline(0, n, 300, "site"), h.timeline(0, min(n, 500), 300, "site", "py"),
               h.search("py")]
    for _ in range(20):
        e = rng.randrange(n)
        answers += [h.at(e, rng.randrange(max(1, int(h.live[e]) + 1))), h.segments(e)]
    for a in answers:
        assert json.loads(json.dumps(a, allow_nan=False)) == a


def test_answers_are_plain_json(loaded):
    _answers_are_json(loaded[0])


def test_vramkit_snapshot_with_an_out_of_memory(tmp_path):
    """A snapshot vramkit writes (as `vramkit run` and the post-mortem do) opens with its OOM point."""
    import vramkit

    dev = str(vramkit.sim.create(64 << 20))
    vramkit.record_memory_history(device=dev)
    try:
        kept = vramkit.raw_alloc(8 << 20, dev)
        with pytest.raises(vramkit.OutOfMemoryError):
            vramkit.raw_alloc(100 << 20, dev)
        path = vramkit.dump_snapshot(str(tmp_path / "oom.pickle"), device=dev) or str(tmp_path / "oom.pickle")
        vramkit.raw_free(kept)
    finally:
        vramkit.record_memory_history(enabled=None, device=dev)
    h = load_history(path, cache=False)
    ooms = h.info()["ooms"]
    assert len(ooms) == 1 and ooms[0]["size"] == 100 << 20 and ooms[0]["event"] == 1
    assert ooms[0]["device_free"] == (64 << 20) - int(h.segments(0)["reserved"])
    assert h.at(0, 0)["allocation"]["size"] == 8 << 20
