"""vramkit._C.trace_replay: the C replay loop over NumPy columns (csrc/alloc/replay.c,
csrc/python/trace.c), checked against

- an independent pure-Python model of PyTorch's caching policy written here (best fit per
  stream, splitting, merging; segment addresses from the replay's private range), which gives
  every per-event reserved/allocated figure and every address;
- the same sequence driven through the public Python API (raw_alloc / raw_free) on a fresh
  `vramkit.sim` device, under tests/stress/allocator_model.py's AllocatorModel, which checks
  the device's counters and blocks after every operation (it checks a live allocator; it does
  not compute reserved bytes itself, hence the model above);
- the same sequence on a sim device at a capacity where the OOM ladder runs and finally
  raises: same per-event reserved bytes, same OOM event, same message and figures;

plus every argument error and the OOM result fields.
"""

from __future__ import annotations

import bisect
import threading

import numpy as np
import pytest

import vramkit
from vramkit import _C
from allocator_model import AllocatorModel

MiB = 1 << 20
GiB = 1 << 30
SIM_BASE = 1 << 48
ALLOC, FREE, MARKER = 0, 1, 9
USE, SYNC = 4, 5  # record_stream, a synchronize


# ---- traces ---------------------------------------------------------------------------------

def random_trace(n: int, seed: int, streams: int = 1, max_live: int = 60):
    """n events: allocs of 0 B .. 300 MiB (log-uniform over 1 B .. 300 MiB, plus some 0 B), frees
    of random live ids, and 2 % markers. Ids are distinct and not in allocation order."""
    rng = np.random.default_rng(seed)
    kind = np.empty(n, np.uint8)
    ids = np.empty(n, np.int64)
    size = np.zeros(n, np.uint64)
    stream = np.zeros(n, np.uint64)
    perm = rng.permutation(n)  # the id of the k-th allocation
    live: list[int] = []
    k = 0
    for i in range(n):
        r = rng.random()
        if r < 0.02:
            kind[i], ids[i], size[i] = MARKER, -1, 2**64 - 1  # ignored, whatever they hold
        elif live and (r < 0.47 or len(live) >= max_live):
            kind[i] = FREE
            ids[i] = live.pop(int(rng.integers(len(live))))
        else:
            kind[i] = ALLOC
            ids[i] = perm[k]
            k += 1
            size[i] = 0 if rng.random() < 0.05 else int(np.exp(rng.uniform(0, np.log(300 * MiB))))
            live.append(int(ids[i]))
        stream[i] = rng.integers(streams)
    return kind, ids, size, stream


def random_trace_with_uses(n: int, seed: int, streams: int = 3):
    """random_trace's allocations and frees on `streams` streams, plus record_stream uses (8 %
    of events: a random live allocation used on a random stream) and synchronizations (3 %:
    one stream, or every stream with id -1)."""
    kind, ids, size, stream = random_trace(n, seed, streams=streams)
    rng = np.random.default_rng(seed + 1000)
    live: set[int] = set()
    out: list[tuple[int, int, int, int]] = []
    for k, i, sz, st in zip(kind.tolist(), ids.tolist(), size.tolist(), stream.tolist()):
        if k == FREE and st != stream[np.flatnonzero((kind == ALLOC) & (ids == i))[0]]:
            st = int(stream[np.flatnonzero((kind == ALLOC) & (ids == i))[0]])  # a FREE is on its block's stream
        out.append((k, i, sz, st))
        if k == ALLOC:
            live.add(i)
        elif k == FREE:
            live.discard(i)
        r = rng.random()
        if r < 0.08 and live:
            out.append((USE, int(rng.choice(sorted(live))), 0, int(rng.integers(streams))))
        elif r < 0.11:
            every = rng.random() < 0.3
            out.append((SYNC, -1 if every else 0, 0, int(rng.integers(streams))))
    k, i, sz, st = zip(*out)
    return (np.array(k, np.uint8), np.array(i, np.int64), np.array(sz, np.uint64), np.array(st, np.uint64))


def outs(n: int):
    return tuple(np.full(n, 0xDEADBEEF, np.uint64) for _ in range(3))


# ---- an independent model of PyTorch's policy (default settings, no OOM) ----------------------

class _Block:
    __slots__ = ("addr", "size", "stream", "small", "free", "prev", "next", "uses")

    def __init__(self, addr, size, stream, small):
        self.addr, self.size, self.stream, self.small = addr, size, stream, small
        self.free, self.prev, self.next = True, None, None
        self.uses: set[int] = set()


class PolicyModel:
    """PyTorch's CUDACachingAllocator rules, from its source rather than from vramkit's:
    round to 512 B; <= 1 MiB small pool with 2 MiB segments; else large pool with 20 MiB
    segments below 10 MiB and the request rounded to 2 MiB above; best fit = smallest free
    block of the pool on the request's stream, lowest address among equals; split when the
    remainder is >= 512 B (small) or > 1 MiB (large); merge free neighbours on free."""

    def __init__(self):
        self.waiting = []  # blocks freed while used on other streams
        self.free_keys = {True: [], False: []}  # sorted (stream, size, addr) per pool
        self.blocks: dict[int, _Block] = {}  # addr -> block, every block
        self.next_addr = SIM_BASE
        self.reserved = self.allocated = 0

    def _index(self, b, add):
        keys = self.free_keys[b.small]
        if add:
            bisect.insort(keys, (b.stream, b.size, b.addr))
        else:
            keys.pop(bisect.bisect_left(keys, (b.stream, b.size, b.addr)))

    def alloc(self, n, stream):
        if n == 0:
            return 0
        rounded = max(512, -(-n // 512) * 512)
        small = rounded <= MiB
        keys = self.free_keys[small]
        i = bisect.bisect_left(keys, (stream, rounded, 0))
        if i < len(keys) and keys[i][0] == stream:
            b = self.blocks[keys[i][2]]
            self._index(b, False)
        else:
            seg = 2 * MiB if small else 20 * MiB if rounded < 10 * MiB else -(-rounded // (2 * MiB)) * 2 * MiB
            b = _Block(self.next_addr, seg, stream, small)
            self.blocks[b.addr] = b
            self.next_addr += seg
            self.reserved += seg
        rest = b.size - rounded
        if (small and rest >= 512) or (not small and rest > MiB):
            r = _Block(b.addr + rounded, rest, stream, small)
            r.prev, r.next = b, b.next
            if b.next:
                b.next.prev = r
            b.next, b.size = r, rounded
            self.blocks[r.addr] = r
            self._index(r, True)
        b.free = False
        self.allocated += b.size
        return b.addr

    def record_stream(self, addr, stream):
        """Tensor.record_stream: the block's free will wait for `stream` (its own orders itself)."""
        if addr and stream != self.blocks[addr].stream:
            self.blocks[addr].uses.add(stream)

    def free(self, addr):
        if addr == 0:
            return
        b = self.blocks[addr]
        self.allocated -= b.size  # PyTorch counts it freed now ...
        if b.uses:
            self.waiting.append(b)  # ... but the block returns to the pool only after its streams
            return
        self._release(b)

    def synchronize(self, stream):
        """`stream` (None: every stream) has finished its work: blocks waiting only on what is
        finished go back to their pools."""
        still = []
        for b in self.waiting:
            b.uses = set() if stream is None else b.uses - {stream}
            (still if b.uses else [self._release(b)]).append(b)
        self.waiting = still

    def _release(self, b):
        addr = b.addr
        b.free = True
        for nb in (b.prev, b.next):
            if nb is not None and nb.free:
                self._index(nb, False)
                del self.blocks[nb.addr]
                if nb is b.prev:
                    b.addr, b.prev = nb.addr, nb.prev
                    if nb.prev:
                        nb.prev.next = b
                else:
                    b.next = nb.next
                    if nb.next:
                        nb.next.prev = b
                b.size += nb.size
        self.blocks.pop(addr, None)
        self.blocks[b.addr] = b
        self._index(b, True)


def run_model(kind, ids, size, stream):
    m = PolicyModel()
    addr_of: dict[int, int] = {}
    reserved, allocated, addrs = [], [], []
    for k, i, s, st in zip(kind.tolist(), ids.tolist(), size.tolist(), stream.tolist()):
        a = 0
        if k == ALLOC:
            a = addr_of[i] = m.alloc(s, st)
        elif k == FREE:
            m.free(addr_of.pop(i))
        elif k == USE:
            m.record_stream(addr_of[i], st)
        elif k == SYNC:
            m.synchronize(None if i == -1 else st)
        reserved.append(m.reserved)
        allocated.append(m.allocated)
        addrs.append(a)
    return np.array(reserved, np.uint64), np.array(allocated, np.uint64), np.array(addrs, np.uint64)


def first_argmax(a: np.ndarray) -> int:
    return int(np.argmax(a)) if a.max() > 0 else -1


# ---- (a) against the models --------------------------------------------------------------

def replay_equals_model(kind, ids, size, stream):
    """The C replay's per-event reserved, allocated and address columns equal the policy
    model's; returns the replay's result and the model's reserved and allocated columns."""
    reserved, allocated, addr = outs(len(kind))
    r = _C.trace_replay(kind, ids, size, stream, 1 << 50, None, reserved, allocated, addr)
    want_reserved, want_allocated, want_addr = run_model(kind, ids, size, stream)
    assert r["oom_event"] == -1 and r["events"] == len(kind)
    np.testing.assert_array_equal(reserved, want_reserved)
    np.testing.assert_array_equal(allocated, want_allocated)
    np.testing.assert_array_equal(addr, want_addr)
    return r, want_reserved, want_allocated


@pytest.mark.parametrize("streams", [1, 2])
def test_matches_the_policy_model_event_by_event(streams):
    kind, ids, size, stream = random_trace(4000, seed=7 + streams, streams=streams)
    r, want_reserved, want_allocated = replay_equals_model(kind, ids, size, stream)
    assert r["peak_reserved"] == want_reserved.max() and r["peak_reserved_event"] == first_argmax(want_reserved)
    assert r["peak_allocated"] == want_allocated.max() and r["peak_allocated_event"] == first_argmax(want_allocated)
    assert r["reserved_at_peak_allocated"] == want_reserved[r["peak_allocated_event"]]
    assert r["allocated_at_peak_reserved"] == want_allocated[r["peak_reserved_event"]]
    assert r["final_reserved"] == want_reserved[-1] and r["final_allocated"] == want_allocated[-1]
    assert r["num_device_free"] == 0 and r["num_ooms"] == 0


def test_stream_uses_and_synchronizes_match_the_policy_model():
    """record_stream uses and synchronizations: a block freed while used on other streams
    returns to its own stream's pool only when all of them are synchronized."""
    kind, ids, size, stream = random_trace_with_uses(4000, seed=21)
    assert (kind == USE).sum() > 100 and (kind == SYNC).sum() > 50
    r, _, _ = replay_equals_model(kind, ids, size, stream)
    # The uses matter: without them the same trace reserves less.
    plain = kind != USE
    r2 = _C.trace_replay(kind[plain], ids[plain], size[plain], stream[plain], 1 << 50, None)
    assert r2["peak_reserved"] < r["peak_reserved"]


def test_matches_the_public_api_under_the_allocator_model():
    kind, ids, size, stream = random_trace(3000, seed=11, streams=2)
    capacity = 64 * GiB
    reserved, allocated, addr = outs(len(kind))
    r = _C.trace_replay(kind, ids, size, stream, capacity, None, reserved, allocated, addr)

    device = vramkit.sim.create(capacity)
    model = AllocatorModel(device, touch_memory=False)
    ptr_of: dict[int, int] = {}
    got_reserved, got_allocated, got_ptr, requested, peak_requested = [], [], [], {}, 0
    for i, (k, x, s, st) in enumerate(zip(kind.tolist(), ids.tolist(), size.tolist(), stream.tolist())):
        p = 0
        if k == ALLOC:
            if s == 0:
                ptr_of[x] = 0
            else:
                before = set(model.live)
                model.alloc(s, st)
                (p,) = set(model.live) - before
                ptr_of[x] = p
                requested[x] = s
                peak_requested = max(peak_requested, sum(requested.values()))
        elif k == FREE:
            freed = ptr_of.pop(x)
            if freed:
                model.free(freed, None)
                del requested[x]
        if i % 50 == 0:
            model.check(f"event {i}")
        got_reserved.append(vramkit.memory_reserved(device))
        got_allocated.append(vramkit.memory_allocated(device))
        got_ptr.append(p)
    model.check("end")
    assert model.violations == []
    assert model.ooms == 0 and r["oom_event"] == -1
    np.testing.assert_array_equal(reserved, np.array(got_reserved, np.uint64))
    np.testing.assert_array_equal(allocated, np.array(got_allocated, np.uint64))
    assert r["peak_reserved"] == vramkit.max_memory_reserved(device)
    assert r["peak_allocated"] == vramkit.max_memory_allocated(device)
    assert r["peak_requested"] == peak_requested
    stats = _C.memory_stats(device)
    for key in ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_ooms"):
        assert r[key] == stats[key], key
    # Same layout: the device's addresses are the replay's, shifted to where its range began
    # (its first block starts its first segment).
    base = next(p for p in got_ptr if p)
    np.testing.assert_array_equal(addr, np.array([p - base + SIM_BASE if p else 0 for p in got_ptr], np.uint64))
    model.drain()
    assert model.violations == []


# ---- (b) against the public API, with the OOM ladder and the OOM ---------------------------

def test_matches_the_public_api_up_to_the_oom():
    kind, ids, size, stream = random_trace(3000, seed=5, streams=2, max_live=80)
    capacity = 1536 * MiB  # the ladder releases cached segments, and at event 1216 a request fails
    reserved, allocated, addr = outs(len(kind))
    r = _C.trace_replay(kind, ids, size, stream, capacity, None, reserved, allocated, addr)
    assert r["oom_event"] >= 0, "the trace should run out of memory at this capacity"

    device = vramkit.sim.create(capacity)
    ptr_of: dict[int, int] = {}
    got_reserved, got_allocated, got_addr = [], [], []
    base = None
    oom_event, oom = -1, None
    for i, (k, x, s, st) in enumerate(zip(kind.tolist(), ids.tolist(), size.tolist(), stream.tolist())):
        p = 0
        if k == ALLOC:
            try:
                p = ptr_of[x] = vramkit.raw_alloc(s, device, st)
            except vramkit.OutOfMemoryError as e:
                oom_event, oom = i, e
            if p and base is None:
                base = p
        elif k == FREE:
            vramkit.raw_free(ptr_of.pop(x))
        got_reserved.append(vramkit.memory_reserved(device))
        got_allocated.append(vramkit.memory_allocated(device))
        got_addr.append(p - base + SIM_BASE if p else 0)
        if oom is not None:
            break
    stats = _C.memory_stats(device)
    assert r["oom_event"] == oom_event and r["events"] == oom_event + 1
    e = r["events"]
    np.testing.assert_array_equal(reserved[:e], np.array(got_reserved, np.uint64))
    np.testing.assert_array_equal(allocated[:e], np.array(got_allocated, np.uint64))
    np.testing.assert_array_equal(addr[:e], np.array(got_addr, np.uint64))
    assert (reserved[e:] == 0xDEADBEEF).all() and (addr[e:] == 0xDEADBEEF).all()
    assert r["num_alloc_retries"] == stats["num_alloc_retries"] > 0
    assert r["num_device_free"] == stats["num_device_free"] > 0
    assert r["num_ooms"] == stats["num_ooms"] == 1
    assert r["peak_reserved"] == vramkit.max_memory_reserved(device)
    assert r["oom_message"] == str(oom).replace(device, "sim:-1")
    info = r["oom_info"]
    assert (info["requested"], info["segment_size"], info["device_free"], info["device_total"], info["allocated"],
            info["reserved"], info["allowed"]) == (oom.requested, oom.segment_size, oom.free, oom.total,
                                                   oom.allocated, oom.reserved, oom.allowed)
    for p in ptr_of.values():
        vramkit.raw_free(p)
    vramkit.empty_cache(device)


# ---- (d) OOM result fields ---------------------------------------------------------------

def test_oom_result_fields():
    kind = np.array([ALLOC, ALLOC, MARKER, ALLOC, FREE], np.uint8)
    ids = np.array([0, 1, -1, 2, 0], np.int64)
    size = np.array([30 * MiB, 30 * MiB, 0, 10 * MiB, 0], np.uint64)
    reserved, allocated, addr = outs(5)
    r = _C.trace_replay(kind, ids, size, None, 64 * MiB, None, reserved, allocated, addr)
    expected = {
        "events": 4, "oom_event": 3, "peak_allocated": 60 * MiB, "peak_allocated_event": 1,
        "reserved_at_peak_allocated": 60 * MiB, "peak_reserved": 60 * MiB, "peak_reserved_event": 1,
        "allocated_at_peak_reserved": 60 * MiB, "peak_requested": 60 * MiB, "final_allocated": 60 * MiB,
        "final_reserved": 60 * MiB, "num_alloc_retries": 1, "num_ooms": 1, "num_device_alloc": 2,
        "num_device_free": 0, "segments_at_peak_reserved": 2,
    }
    assert {k: r[k] for k in expected} == expected
    assert set(r) == set(expected) | {"oom_message", "oom_info"}
    assert "Tried to allocate 10.00 MiB" in r["oom_message"] and "out of memory" in r["oom_message"]
    assert r["oom_info"] == {"device_kind": 2, "device_index": -1, "requested": 10 * MiB, "segment_size": 10 * MiB,
                             "device_free": 4 * MiB, "device_total": 64 * MiB, "allocated": 60 * MiB,
                             "reserved": 60 * MiB, "allowed": None}
    assert reserved[:4].tolist() == [30 * MiB, 60 * MiB, 60 * MiB, 60 * MiB] and reserved[4] == 0xDEADBEEF
    assert addr[2] == 0 and addr[3] == 0 and addr[4] == 0xDEADBEEF
    # A limit from the conf is reported as "allowed".
    r = _C.trace_replay(kind, ids, size, None, 1 * GiB, "memory_limit_mb:64")
    assert r["oom_event"] == 3 and r["oom_info"]["allowed"] == 64 * MiB
    # Without an OOM there are no oom_* keys.
    r = _C.trace_replay(kind[:3], ids[:3], size[:3], None, GiB)
    assert r["oom_event"] == -1 and "oom_message" not in r and "oom_info" not in r


def test_conf_and_keywords():
    kind = np.array([ALLOC, FREE, ALLOC], np.uint8)
    ids = np.array([0, 0, 1], np.int64)
    size = np.array([100 * MiB, 0, 30 * MiB], np.uint64)
    assert _C.trace_replay(kind, ids, size, None, 8 * GiB)["peak_reserved"] == 100 * MiB
    r = _C.trace_replay(kind=kind, id=ids, size=size, stream=None, capacity=8 * GiB, conf="max_split_size_mb:64")
    assert r["peak_reserved"] == 130 * MiB and r["peak_reserved_event"] == 2


def test_replays_run_in_parallel_threads():
    kind, ids, size, stream = random_trace(20000, seed=3, streams=2)
    want = _C.trace_replay(kind, ids, size, stream, 16 * GiB)
    results = []
    threads = [threading.Thread(target=lambda: results.append(_C.trace_replay(kind, ids, size, stream, 16 * GiB)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [want] * 4


def test_accepted_formats():
    kind = np.array([ALLOC, FREE], np.uint8)
    ids = np.array([0, 0], np.int64)
    size = np.array([100, 0], np.uint64)
    want = _C.trace_replay(kind, ids, size, None, GiB)
    # 'q'/'Q' (long long) and 'l'/'L' (long) are both 8-byte integers on LP64 Linux.
    q = memoryview(ids.tobytes()).cast("q")
    big_q = memoryview(size.tobytes()).cast("Q")
    assert _C.trace_replay(memoryview(kind.tobytes()), q, big_q, big_q, GiB) == want
    assert _C.trace_replay(kind, ids.astype(np.longlong), size.astype(np.ulonglong), None, GiB) == want
    assert _C.trace_replay(kind, ids.astype("<i8"), size.astype("<u8"), None, GiB) == want
    empty = _C.trace_replay(np.zeros(0, np.uint8), np.zeros(0, np.int64), np.zeros(0, np.uint64), None, GiB)
    assert empty["events"] == 0 and empty["peak_reserved_event"] == -1 and empty["peak_allocated_event"] == -1


# ---- (c) argument errors -----------------------------------------------------------------

def _good():
    return (np.array([ALLOC, FREE, ALLOC], np.uint8), np.array([0, 0, 1], np.int64),
            np.array([100, 0, 200], np.uint64), np.zeros(3, np.uint64))


ARGS = ("kind", "id", "size", "stream", "capacity", "conf", "reserved_out", "allocated_out", "addr_out")


def _call(**change):
    kind, ids, size, stream = _good()
    args = dict(kind=kind, id=ids, size=size, stream=stream, capacity=GiB, conf=None,
                reserved_out=np.zeros(3, np.uint64), allocated_out=np.zeros(3, np.uint64),
                addr_out=np.zeros(3, np.uint64))
    args.update(change)
    return _C.trace_replay(*(args[a] for a in ARGS))


COLUMN_DTYPE = {"kind": np.uint8, "id": np.int64, "size": np.uint64, "stream": np.uint64,
                "reserved_out": np.uint64, "allocated_out": np.uint64, "addr_out": np.uint64}


@pytest.mark.parametrize("name", list(COLUMN_DTYPE))
def test_column_errors_name_the_argument(name):
    dtype = COLUMN_DTYPE[name]
    wrong = {np.uint8: np.int8, np.int64: np.uint64, np.uint64: np.int64}[dtype]
    good = np.zeros(3, dtype)
    cases = [
        (np.zeros(3, wrong), TypeError, np.dtype(dtype).name),
        (np.zeros(3, np.float64), TypeError, np.dtype(dtype).name),
        (np.zeros(3, np.dtype(dtype).newbyteorder(">")) if dtype != np.uint8 else np.zeros(3, np.bool_),
         TypeError, "byte order" if dtype != np.uint8 else "uint8"),
        ([0, 0, 0], TypeError, "NumPy array"),
        (np.zeros((3, 1), dtype), ValueError, "one-dimensional"),
        (np.zeros(6, dtype)[::2], ValueError, "C-contiguous"),
        (np.zeros(4, dtype), ValueError, "entries" if name != "kind" else "entries"),
    ]
    if name in ("kind", "id", "size"):
        cases.append((None, TypeError, "NumPy array"))
    if name.endswith("_out"):
        ro = good.copy()
        ro.flags.writeable = False
        cases.append((ro, ValueError, "writable"))
    for value, exc, text in cases:
        if name == "kind" and isinstance(value, np.ndarray) and value.shape == (4,):
            continue  # a longer kind makes the other columns the short ones: covered below
        with pytest.raises(exc, match=name) as info:
            _call(**{name: value})
        assert text in str(info.value), (value, str(info.value))
    if name == "kind":
        with pytest.raises(ValueError, match="id has 3 entries but kind has 4"):
            _call(kind=np.array([0, 1, 0, 7], np.uint8))


def test_outputs_untouched_on_error_and_no_overlap():
    kind, ids, size, stream = _good()
    out = np.full(3, 7, np.uint64)
    with pytest.raises(ValueError, match="trace event 1: free of id 0, which is not allocated"):
        _C.trace_replay(kind, np.array([1, 0, 2], np.int64), size, None, GiB, None, out, None, None)
    assert out.tolist() == [7, 7, 7]
    with pytest.raises(ValueError, match="addr_out shares memory with size"):
        _C.trace_replay(kind, ids, size, None, GiB, None, None, None, size)
    both = np.zeros(6, np.uint64)
    with pytest.raises(ValueError, match="reserved_out shares memory with allocated_out"):
        _C.trace_replay(kind, ids, size, None, GiB, None, both[:3], both[2:5], None)


def test_scalar_argument_errors():
    with pytest.raises(ValueError, match="capacity"):
        _call(capacity=0)
    with pytest.raises(ValueError, match="capacity"):
        _call(capacity=-1)
    with pytest.raises(ValueError, match="capacity"):
        _call(capacity=1 << 62)
    with pytest.raises(TypeError, match="capacity"):
        _call(capacity=1.5)
    with pytest.raises(TypeError, match="conf"):
        _call(conf=64)
    with pytest.raises(ValueError, match="trace replay conf"):
        _call(conf="max_split_size_mb:5")
    with pytest.raises(ValueError, match="trace replay conf|bogus"):
        _call(conf="bogus:1")
    with pytest.raises(TypeError):
        _C.trace_replay(*_good())  # capacity is required


@pytest.mark.parametrize("kind,ids,size,message", [
    ([ALLOC, FREE], [0, 1], [100, 0], "trace event 1: free of id 1, which is not allocated"),
    ([ALLOC, FREE, FREE], [0, 0, 0], [100, 0, 0], "trace event 2: free of id 0, which is not allocated (it was freed at event 1)"),
    ([ALLOC, MARKER, ALLOC], [4, 4, 4], [100, 0, 100], "trace event 2: alloc of id 4, which is already allocated (at event 0)"),
    ([ALLOC, FREE, ALLOC], [4, 4, 4], [0, 0, 100], "trace event 2: alloc of id 4, which was already used"),
    ([ALLOC, ALLOC], [0, -3], [100, 100], "trace event 1: alloc of id -3: ids must be >= 0"),
    ([FREE], [-1], [0], "trace event 0: free of id -1: ids must be >= 0"),
    ([ALLOC, ALLOC], [0, 1], [100, 1 << 62], "trace event 1: alloc of id 1, size 4611686018427387904"),
])
def test_bad_trace_rules(kind, ids, size, message):
    out = np.full(len(kind), 5, np.uint64)
    with pytest.raises(ValueError) as info:
        _C.trace_replay(np.array(kind, np.uint8), np.array(ids, np.int64), np.array(size, np.uint64), None, GiB,
                        None, out, out.copy(), out.copy())
    assert message in str(info.value)
    assert (out == 5).all()
