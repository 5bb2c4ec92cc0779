"""Where memory went: replay a snapshot's allocation history and group it by Python call site.

Everything here is a pure function of a snapshot dict (memory_snapshot(), or a pickle written by
dump_snapshot() or by torch.cuda.memory._dump_snapshot()), so a snapshot can be analysed on
another machine, and tests can check the arithmetic on hand-built traces.

The history is a ring buffer: it may have dropped its oldest events, or recording may have begun
while memory was already allocated. Replay therefore anchors the curves on the snapshot's
segments (what is allocated and reserved *now*) and runs the recorded deltas backwards from
there, instead of assuming that memory starts at zero.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BEFORE_HISTORY", "NO_PYTHON_FRAME", "AllocationSite", "Frame", "LiveAllocation", "MemoryReplay", "allocation_sites",
    "device_trace", "format_bytes", "is_internal_frame", "live_at_oom", "live_sites", "replay", "site_key", "site_label",
    "user_frames",
]

Snapshot = Mapping[str, Any]

# The label of allocations made before the recorded history began without a recorded stack: the
# history saw only their free, or they are still alive but were allocated while recording was off.
BEFORE_HISTORY = "(allocated before the recorded history)"
# The label of allocations the history recorded without a Python frame: made inside an operator
# with no Python on the stack (autograd's backward runs on its own C++ thread), followed by the
# nearest recorded Python frame, the step's code running then ("near train.py:52 in step").
NO_PYTHON_FRAME = "(made inside an operator: no Python frame)"


@dataclass(frozen=True)
class Frame:
    """One Python stack frame as recorded in a snapshot."""

    filename: str
    line: int
    name: str

    @classmethod
    def from_dict(cls, frame: Mapping[str, Any]) -> Frame:
        return cls(str(frame.get("filename", "?")), int(frame.get("line", 0) or 0), str(frame.get("name", "?")))

    def short(self) -> str:
        """'file.py:12 in name': the base name keeps report lines short; full paths are in the pickle."""
        return f"{os.path.basename(self.filename) or self.filename}:{self.line} in {self.name}"


Stack = tuple[Frame, ...]  # innermost frame first, as in the snapshot


@dataclass(frozen=True)
class LiveAllocation:
    """A block that was allocated at the moment of the peak."""

    address: int
    size: int
    frames: Stack
    before_history: bool = False  # allocated before the first recorded event
    near: Stack = ()  # recorded without frames: the nearest recorded event's stack (see NO_PYTHON_FRAME)

    @property
    def frame(self) -> Frame | None:
        """The innermost frame of user code (outside NumPy, vramkit, runpy, importlib)."""
        user = user_frames(self.frames)
        return user[0] if user else None

    @property
    def label(self) -> str:
        """Where it was made, in a report's words (``site_label``)."""
        return site_label(site_key(self.frames) if self.frames else (), self.near, self.before_history)


@dataclass(frozen=True)
class MemoryReplay:
    """Allocated and reserved bytes after every recorded event of one device.

    Point 0 is the state before the first recorded event; point i the state after event i-1.
    `time_us[i]` is the event's time (point 0 repeats the first event's time); traces without
    time_us use the event index instead.
    """

    device: int
    time_us: tuple[int, ...]
    allocated: tuple[int, ...]
    reserved: tuple[int, ...]
    peak_index: int  # first point where `allocated` reaches its maximum
    live_at_peak: tuple[LiveAllocation, ...]  # largest first
    initial_live: tuple[LiveAllocation, ...]  # allocations that predate the recorded history
    num_events: int
    num_allocs: int  # 'alloc' events in the trace
    has_time: bool

    @property
    def peak_allocated(self) -> int:
        return self.allocated[self.peak_index]

    @property
    def peak_reserved(self) -> int:
        return max(self.reserved)


@dataclass(frozen=True)
class AllocationSite:
    """All recorded allocations made from one place in the user's code."""

    frames: Stack  # the site's stack, innermost first (see site_key); () when none was recorded
    live_at_peak: int  # bytes from this site alive at the peak of allocated bytes
    total_bytes: int  # bytes allocated from this site over the whole history
    count: int  # allocations from this site
    # Recorded without frames (NO_PYTHON_FRAME): the site key of the nearest recorded stack, or ()
    # for allocations made before the history (BEFORE_HISTORY).
    near: Stack = ()
    before_history: bool = False

    @property
    def frame(self) -> Frame | None:
        """The frame that names the site: the innermost one in user code."""
        return self.frames[0] if self.frames else None

    @property
    def label(self) -> str:
        return site_label(self.frames, self.near, self.before_history)


def site_label(frames: Stack, near: Stack = (), before_history: bool = True) -> str:
    """A site's words: its innermost frame; for a block recorded without frames, NO_PYTHON_FRAME
    and the nearest recorded frame; for one made before the history, BEFORE_HISTORY."""
    if frames:
        return frames[0].short()
    if before_history:
        return BEFORE_HISTORY
    return f"{NO_PYTHON_FRAME} near {near[0].short()}" if near else NO_PYTHON_FRAME


def format_bytes(n: int) -> str:
    """Bytes with a binary unit and one decimal ('40.0 MiB'), for reports and the timeline."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


_LIBRARIES = ("numpy", "torch", "vramkit")  # their frames are plumbing: a site is where the user's code called them


# The standard library's directory: its site-packages (inside it on some layouts) is excluded above.
_STDLIB = os.path.dirname(os.path.abspath(os.__file__)) + os.sep


@functools.lru_cache(maxsize=1)
def _internal_dirs() -> tuple[str, ...]:
    """Directories whose frames are plumbing rather than the user's code, in this interpreter."""
    import importlib as _importlib
    import runpy

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # vramkit/, above report/
    dirs = [package + os.sep,
            os.path.dirname(os.path.abspath(_importlib.__file__)) + os.sep,
            os.path.abspath(runpy.__file__)]
    for package in _LIBRARIES:
        try:
            spec = importlib.util.find_spec(package)  # finds the package without importing it
        except (ImportError, ValueError):
            continue
        if spec is not None and spec.submodule_search_locations:
            dirs += [os.path.abspath(d) + os.sep for d in spec.submodule_search_locations]
    return tuple(dirs)


@functools.lru_cache(maxsize=4096)  # a trace repeats the same few hundred files
def is_internal_frame(filename: str) -> bool:
    """Whether a frame belongs to NumPy, PyTorch, vramkit or Python's standard library (copy.deepcopy,
    runpy, importlib) rather than the user's code.

    Besides this interpreter's own install locations, any `site-packages/numpy/`,
    `site-packages/torch/` or `site-packages/vramkit/` path counts, so snapshots recorded
    elsewhere are read the same way. vramkit's bundled examples are user code, and so is any other
    installed package.
    """
    if filename.startswith("<frozen "):  # runpy and importlib are frozen modules since 3.11
        return True
    path = filename.replace("\\", "/")
    if "/vramkit/examples/" in path:
        return False
    if filename.startswith(_internal_dirs()):
        return True
    if filename.startswith(_STDLIB) and not any(d in path for d in ("/site-packages/", "/dist-packages/")):
        return True
    parts = path.split("/")
    return any(p in ("site-packages", "dist-packages") and q in _LIBRARIES
               for p, q in itertools.pairwise(parts))


def user_frames(frames: Iterable[Frame]) -> Stack:
    """The frames of user code, innermost first."""
    return tuple(f for f in frames if not is_internal_frame(f.filename))


def site_key(frames: Stack) -> Stack:
    """What makes two allocations the same site: their stacks of user frames.

    NumPy's own frames are left out, so one line of user code is one site whichever NumPy
    function path allocated for it; a stack with no user frame at all is kept whole.
    """
    return user_frames(frames) or frames


def _device_index(snapshot: Snapshot, device: int | None) -> int:
    if device is not None:
        if isinstance(device, bool) or not isinstance(device, int) or device < 0:
            raise ValueError(f"device must be a trace index (an int >= 0) or None, got {device!r}")
        return device
    name = snapshot.get("vramkit_device")
    if isinstance(name, str):  # 'cpu', 'sim:N' or 'cuda:N', maybe with '/mempool:M' (a private pool on it)
        index = name.partition("/")[0].rpartition(":")[2]
        return int(index) if index.isdigit() else 0
    traces = snapshot.get("device_traces") or []
    return next((i for i, t in enumerate(traces) if t), 0)  # a PyTorch snapshot: first busy GPU


def device_trace(snapshot: Snapshot, device: int | None = None) -> list[Mapping[str, Any]]:
    """The recorded events of one device: `device_traces[device]`.

    device=None picks the device the snapshot was taken of ('vramkit_device': index 0 for cpu,
    N for 'sim:N' and 'cuda:N'), or for a PyTorch snapshot the first device with events.
    """
    if "segments" not in snapshot or "device_traces" not in snapshot:
        raise ValueError("not a memory snapshot: expected a dict with 'segments' and 'device_traces' "
                         "(from vramkit.memory_snapshot() or torch.cuda.memory._snapshot())")
    traces = snapshot["device_traces"]
    index = _device_index(snapshot, device)
    return list(traces[index]) if index < len(traces) else []


def _segments(snapshot: Snapshot, index: int) -> list[Mapping[str, Any]]:
    return [s for s in snapshot["segments"] if int(s.get("device", index)) == index]


def _stack(entry: Mapping[str, Any], cache: dict[tuple[Any, ...], Stack] | None = None) -> Stack:
    """The entry's frames as a Stack; `cache` shares one tuple among the many events of a loop."""
    frames = entry.get("frames") or ()
    if cache is None:
        return tuple(Frame.from_dict(f) for f in frames)
    key = tuple((f.get("filename"), f.get("line"), f.get("name")) for f in frames)
    stack = cache.get(key)
    if stack is None:
        stack = cache[key] = tuple(Frame.from_dict(f) for f in frames)
    return stack


def _nearest_stacks(trace: Sequence[Mapping[str, Any]], cache: dict[tuple[Any, ...], Stack]) -> list[Stack]:
    """Per event, the stack of the nearest event with frames: the last one before it (the step's
    code that was running, as autograd's backward runs from its ``.backward()`` call), else, at
    the start of the history, the first one after it; () when no event has frames."""
    out: list[Stack] = []
    last: Stack = ()
    for e in trace:
        if e.get("frames"):
            last = _stack(e, cache)
        out.append(last)
    first = next((x for x in out if x), ())
    return [x or first for x in out]


def _live(index: int, e: Mapping[str, Any], cache: dict[tuple[Any, ...], Stack],
          near: Sequence[Stack]) -> LiveAllocation:
    """The block event `index` (an 'alloc', `e`) made; recorded without frames, with the nearest stack."""
    frames = _stack(e, cache)
    return LiveAllocation(int(e["addr"]), int(e["size"]), frames, False, () if frames else site_key(near[index]))


def _initial_live(trace: Sequence[Mapping[str, Any]], segments: Sequence[Mapping[str, Any]]) -> list[LiveAllocation]:
    """Allocations that were live before the first recorded event.

    The kept history is the newest part of each address's life: an address whose first event is
    a free was allocated before the history began, and a block allocated now that the history
    never mentions has been allocated since before it began (its stack is in the segment).
    """
    first: dict[int, Mapping[str, Any]] = {}
    for e in trace:
        if e.get("action") in ("alloc", "free_requested") and e.get("addr") is not None:
            first.setdefault(int(e["addr"]), e)
    live = [LiveAllocation(addr, int(e["size"]), (), True)
            for addr, e in first.items() if e["action"] == "free_requested"]
    for seg in segments:
        for b in seg.get("blocks") or ():
            if b.get("state") == "active_allocated" and int(b["address"]) not in first:
                live.append(LiveAllocation(int(b["address"]), int(b["size"]), _stack(b), True))
    return live


def replay(snapshot: Snapshot, device: int | None = None) -> MemoryReplay:
    """Rebuild allocated and reserved bytes over time from a snapshot's trace.

    Allocated bytes rise at 'alloc' and fall at 'free_requested' (as memory_allocated() does);
    reserved bytes follow 'segment_alloc' and 'segment_free' (with expandable segments,
    'segment_map' and 'segment_unmap'). Both curves end at what the
    snapshot's segments hold now (active_allocated block sizes; segment total_size), whatever
    the ring buffer dropped.
    """
    trace = device_trace(snapshot, device)
    index = _device_index(snapshot, device)
    segments = _segments(snapshot, index)
    final_allocated = sum(int(b["size"]) for s in segments for b in s.get("blocks") or ()
                          if b.get("state") == "active_allocated")
    final_reserved = sum(int(s["total_size"]) for s in segments)

    d_alloc = [0] * len(trace)
    d_res = [0] * len(trace)
    for i, e in enumerate(trace):
        action, size = e.get("action"), int(e.get("size") or 0)
        if action == "alloc":
            d_alloc[i] = size
        elif action == "free_requested":
            d_alloc[i] = -size
        elif action in ("segment_alloc", "segment_map"):
            d_res[i] = size
        elif action in ("segment_free", "segment_unmap"):
            d_res[i] = -size
    allocated = [final_allocated - sum(d_alloc)]
    reserved = [final_reserved - sum(d_res)]
    for da, dr in zip(d_alloc, d_res):
        allocated.append(allocated[-1] + da)
        reserved.append(reserved[-1] + dr)

    has_time = bool(trace) and all("time_us" in e for e in trace)
    times = [int(e["time_us"]) for e in trace] if has_time else list(range(len(trace)))
    times = ([times[0]] if times else [0]) + times

    peak = max(range(len(allocated)), key=allocated.__getitem__)  # first maximum
    initial = _initial_live(trace, segments)
    live: dict[int, LiveAllocation | int] = {a.address: a for a in initial}
    for i, e in enumerate(trace[:peak]):  # event indices only: most are freed again before the peak
        action = e.get("action")
        if action == "alloc":
            live[int(e["addr"])] = i
        elif action == "free_requested":
            live.pop(int(e["addr"]), None)
    cache: dict[tuple[Any, ...], Stack] = {}
    near = _nearest_stacks(trace, cache)
    at_peak = sorted((v if isinstance(v, LiveAllocation) else _live(v, trace[v], cache, near)
                      for v in live.values()), key=lambda x: (-x.size, x.address))
    return MemoryReplay(index, tuple(times), tuple(allocated), tuple(reserved), peak, tuple(at_peak),
                        tuple(initial), len(trace), sum(1 for e in trace if e.get("action") == "alloc"), has_time)


def allocation_sites(snapshot: Snapshot, device: int | None = None, *,
                     replayed: MemoryReplay | None = None) -> list[AllocationSite]:
    """Allocations grouped by call site (see site_key), largest contributors to the peak first.

    Ranked by bytes alive at the peak of allocated bytes, then by total bytes allocated (a site
    that churns large temporaries matters even when none is alive at the peak). Allocations that
    predate the history are included: under their stack when the snapshot's block has one (the
    ring buffer dropped their 'alloc'), else under BEFORE_HISTORY.

    replayed: replay(snapshot, device) if the caller already has it (it is the costly part).
    """
    r = replayed if replayed is not None else replay(snapshot, device)
    # site (its frames' key, the nearest stack's key when it has none, before the history) ->
    # [live_at_peak, total_bytes, count]
    totals: dict[tuple[Stack, Stack, bool], list[int]] = {}
    keys: dict[Stack, Stack] = {}  # stack -> site key, computed once per distinct stack
    cache: dict[tuple[Any, ...], Stack] = {}

    def key_of(frames: Stack) -> Stack:
        key = keys.get(frames)
        if key is None:
            key = keys[frames] = site_key(frames)
        return key

    def add(a: LiveAllocation, live: int, total: int, count: int) -> None:
        site = (key_of(a.frames), () if a.frames else key_of(a.near), not a.frames and a.before_history)
        t = totals.setdefault(site, [0, 0, 0])
        t[0] += live
        t[1] += total
        t[2] += count

    for a in r.initial_live:
        add(a, 0, a.size, 1)
    trace = device_trace(snapshot, r.device)
    near = _nearest_stacks(trace, cache)
    for i, e in enumerate(trace):
        if e.get("action") == "alloc":
            add(_live(i, e, cache, near), 0, int(e["size"]), 1)
    for a in r.live_at_peak:
        add(a, a.size, 0, 0)
    sites = [AllocationSite(stack, live, total, count, nearby, before)
             for (stack, nearby, before), (live, total, count) in totals.items()]
    sites.sort(key=lambda s: (-s.live_at_peak, -s.total_bytes, s.label))
    return sites


def live_at_oom(snapshot: Snapshot, device: int | None = None) -> tuple[list[LiveAllocation], bool]:
    """What was allocated when the device's last out-of-memory happened, largest first, and
    whether the trace said so: the history replayed up to its last 'oom' event (vramkit's pools
    and PyTorch's allocator record one per failed request), so frees made while the exception
    unwound do not count. Without such an event (no history recorded), what is allocated now:
    the snapshot's allocated blocks, with the stacks they carry, and False."""
    trace = device_trace(snapshot, device)
    index = _device_index(snapshot, device)
    segments = _segments(snapshot, index)
    last = max((i for i, e in enumerate(trace) if e.get("action") == "oom"), default=None)
    cache: dict[tuple[Any, ...], Stack] = {}
    if last is None:
        now = [LiveAllocation(int(b["address"]), int(b["size"]), _stack(b, cache))
               for s in segments for b in s.get("blocks") or () if b.get("state") == "active_allocated"]
        return sorted(now, key=lambda x: (-x.size, x.address)), False
    live: dict[int, LiveAllocation | int] = {a.address: a for a in _initial_live(trace, segments)}
    for i, e in enumerate(trace[:last]):
        action = e.get("action")
        if action == "alloc":
            live[int(e["addr"])] = i
        elif action == "free_requested":
            live.pop(int(e["addr"]), None)
    near = _nearest_stacks(trace, cache)
    at = [v if isinstance(v, LiveAllocation) else _live(v, trace[v], cache, near) for v in live.values()]
    return sorted(at, key=lambda x: (-x.size, x.address)), True


def live_sites(live: Iterable[LiveAllocation]) -> list[tuple[str, int, int]]:
    """Live allocations grouped by site: (its label, bytes, count), largest first. A site is
    its stack's ``site_key``; blocks recorded without frames are grouped by the nearest recorded
    stack (NO_PYTHON_FRAME), and those made before the history share BEFORE_HISTORY."""
    totals: dict[str, list[int]] = {}
    for a in live:
        t = totals.setdefault(a.label, [0, 0])
        t[0] += a.size
        t[1] += 1
    return sorted(((k, v[0], v[1]) for k, v in totals.items()), key=lambda x: (-x[1], -x[2]))
