"""Peak figures for comparing a capture with a real run: the steps' peak in a trace, and
PyTorch's own accounting of real CPU steps (torch.profiler's allocator events)."""

from __future__ import annotations

import numpy as np

import vramkit.trace as vt


def step_peak(t: vt.Trace) -> int:
    """Peak live bytes of what the steps allocate (not the setup), host scalars left out."""
    first = np.flatnonzero(t.kind == vt.STEP)[0]
    counted = (t.alloc_index > first) & (t.alloc_category != vt.CATEGORIES.index("host"))
    mem = t.kind <= vt.FREE
    sizes = np.where(counted, t.alloc_size.astype(np.int64), 0)
    return int(np.cumsum(np.where(t.kind[mem] == vt.ALLOC, sizes[t.id[mem]], -sizes[t.id[mem]])).max())


def profiler_peaks(step, steps: int = 2) -> tuple[int, int]:
    """PyTorch's own accounting of `steps` real CPU steps: the peak of the allocator's memory
    events, and the same with each top-level operator's events netted at its end (what an op
    allocates and frees inside itself — a CPU kernel's scratch buffers — taken out; the outputs
    it leaves stay)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(steps):
            step()
    events = list(prof.profiler.kineto_results.events())
    memory = sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns())
    at = np.array([e.start_ns() for e in memory], np.int64)
    nbytes = np.array([e.nbytes() for e in memory], np.int64)
    raw = int(np.cumsum(nbytes).max())
    spans: list[list[int]] = []
    for start, end in sorted((e.start_ns(), e.end_ns()) for e in events if e.name().startswith("aten::")):
        if spans and start < spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], end)  # nested in the previous top-level op
        else:
            spans.append([start, end])
    starts = np.array([s for s, _ in spans], np.int64)
    ends = np.array([e for _, e in spans], np.int64)
    k = np.searchsorted(starts, at, side="right") - 1
    inside = (k >= 0) & (at <= ends[np.maximum(k, 0)])
    net: dict[int, int] = {}
    for op, n in zip(k[inside].tolist(), nbytes[inside].tolist()):
        net[op] = net.get(op, 0) + n
    items = sorted([(int(ends[op]), n) for op, n in net.items()] + list(zip(at[~inside].tolist(), nbytes[~inside].tolist())))
    netted = int(np.cumsum([n for _, n in items]).max())
    return raw, netted


def total_peak(t: vt.Trace) -> int:
    """Peak live bytes of everything in the trace, setup included (what a process holds at
    most), host scalars and the script's own meta storage ("deferred") left out."""
    counted = ~np.isin(t.alloc_category, [vt.CATEGORIES.index("host"), vt.CATEGORIES.index("deferred")])
    mem = t.kind <= vt.FREE
    sizes = np.where(counted, t.alloc_size.astype(np.int64), 0)
    return int(np.cumsum(np.where(t.kind[mem] == vt.ALLOC, sizes[t.id[mem]], -sizes[t.id[mem]])).max())


# Scopes inside which an allocation is the process group backend's own (gloo's copies and
# temporaries): the c10d ops on the calling thread, gloo's named scopes on its worker threads.
BACKEND_SCOPES = ("c10d::", "_c10d_functional::", "gloo:")


def _c10_flag():
    """c10's flag ``caffe2_report_cpu_memory_usage`` (a bool in libc10): while it is set, the
    CPU allocator's reporter counts every allocation and free on every thread. Without it, it
    counts only on threads where the profiler is active, so a storage whose last reference a
    gloo worker thread drops (a finished work holding its tensors) is freed unseen and stays
    counted to the end of the profile."""
    import ctypes
    import os

    import torch

    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    return ctypes.c_bool.in_dll(lib, "FLAGS_caffe2_report_cpu_memory_usage")


def profiled_run(build, steps: int = 2) -> list[tuple[int, int, int, int, bool, str]]:
    """torch.profiler's allocator events of a real run from nothing: `build()` (model, wrapper,
    optimizer, batch) and `steps` steps, so every storage's whole life is in view. Each event is
    (time, ptr, bytes (negative: a free), the allocator's total after it, made by the backend,
    the outermost aten op around it ("" outside any)), in time order."""
    from torch.profiler import ProfilerActivity, profile

    flag = _c10_flag()
    flag.value = True
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step = build()
            for _ in range(steps):
                step()
            del step
    finally:
        flag.value = False
    out = []

    def walk(node, backend: bool, op: str) -> None:
        backend = backend or node.name.startswith(BACKEND_SCOPES)
        if not op and node.name.startswith("aten::"):
            op = f"{node.name}@{node.start_tid}:{node.start_time_ns}"  # one op call, by identity
        extra = node.extra_fields
        if type(extra).__name__ == "_ExtraFields_Allocation":
            out.append((node.start_time_ns, extra.ptr, extra.alloc_size, extra.total_allocated, backend, op))
        for child in node.children:
            walk(child, backend, op)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, False, "")
    out.sort(key=lambda e: e[0])
    return out


def allocator_peaks(events) -> dict[str, int]:
    """Peaks of a real run's allocator events (``profiled_run``):

    * "main": the events' own sum, as torch.profiler's figure is usually read; it never sees
      the frees done on threads the profiler does not follow, so it only grows with them;
    * "all": the allocator's exact total (every thread, c10's own count): the real figure;
    * "no_backend": "all" less what the process group backend itself holds at that moment
      (gloo's full-size copy of a reduce-scatter input, its all-gather temporaries): what a run
      whose backend keeps its buffers outside PyTorch's allocator (NCCL) would show;
    * "no_backend_netted": "no_backend" less what an op allocates and frees inside itself (a
      CPU kernel's scratch: oneDNN's reordered bf16 weights, im2col columns), while it runs;
    * "backend", "scratch": the first less the second of those, at their peaks;
    * "unseen_frees": how many frees the events miss (found from the allocator's total).

    A free the events miss shows as a drop of the total between two events; it is paired with a
    live storage of that size whose free is never seen (its address next allocated again, or
    never freed), so that what the backend holds stays known. Storages from before the run
    that it frees are added back: the figure is the run's own, from nothing."""
    ends: dict[int, tuple[str, str]] = {}  # alloc index -> ("free", op of the free) or ("unseen", "")
    last: dict[int, int] = {}
    for k, (_, ptr, n, _total, _b, op) in enumerate(events):
        if ptr in last:
            ends[last.pop(ptr)] = ("free", op) if n < 0 else ("unseen", "")
        if n > 0:
            last[ptr] = k
    live: dict[int, tuple[int, bool, bool, int]] = {}  # ptr -> (bytes, the backend's, an op's scratch, event)
    # size -> (ptr, event) of storages whose free is never seen; an entry is stale once its ptr
    # was dropped (allocated again) and is skipped then
    unseen: dict[int, list[tuple[int, int]]] = {}
    held = {"backend": 0, "scratch": 0}
    main = before = 0  # the events' sum; bytes of storages from before the run freed in it
    peaks = dict.fromkeys(("main", "all", "no_backend", "no_backend_netted"), 0)
    prev_total = base = events[0][3] - events[0][2]

    def drop(ptr: int) -> None:
        size, by_backend, is_scratch, _ = live.pop(ptr)
        held["backend"] -= size if by_backend else 0
        held["scratch"] -= size if is_scratch else 0

    for k, (_, ptr, n, total, by_backend, op) in enumerate(events):
        gap = total - n - prev_total  # what changed between the two events, unseen
        while gap < 0:
            size = max((s for s, ptrs in unseen.items() if ptrs and s <= -gap), default=None)
            if size is None:
                before -= gap  # freed unseen, allocated before the run
                break
            ptr_u, k_u = unseen[size].pop()
            if live.get(ptr_u, (0, False, False, -1))[3] != k_u:
                continue  # stale: that storage was dropped when its address came back
            drop(ptr_u)
            gap += size
        main += n
        if n > 0:
            if ptr in live:  # allocated again: its free was unseen, and is paired by now
                drop(ptr)
            end, end_op = ends.get(k, ("unseen", ""))
            is_scratch = bool(op) and end == "free" and end_op == op
            live[ptr] = (n, by_backend, is_scratch, k)
            held["backend"] += n if by_backend else 0
            held["scratch"] += n if is_scratch else 0
            if end == "unseen":
                unseen.setdefault(n, []).append((ptr, k))
        elif ptr in live:
            drop(ptr)
        else:
            before -= n  # a storage from before the run
        prev_total = total
        real = total - base + before
        peaks["main"] = max(peaks["main"], main)
        peaks["all"] = max(peaks["all"], real)
        peaks["no_backend"] = max(peaks["no_backend"], real - held["backend"])
        peaks["no_backend_netted"] = max(peaks["no_backend_netted"], real - held["backend"] - held["scratch"])
    peaks["backend"] = peaks["all"] - peaks["no_backend"]
    peaks["scratch"] = peaks["no_backend"] - peaks["no_backend_netted"]
    peaks["unseen_frees"] = sum(1 for e, _ in ends.values() if e == "unseen")
    return peaks


def profiler_total_peak(build, steps: int = 2) -> dict[str, int]:
    """``allocator_peaks`` of a real run of `build` and `steps` steps."""
    return allocator_peaks(profiled_run(build, steps))
