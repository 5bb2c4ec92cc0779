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


def profiler_total_peak(build, steps: int = 2) -> tuple[int, int]:
    """PyTorch's own accounting of a real run from nothing: `build()` (model, wrapper,
    optimizer, batch) and `steps` steps under torch.profiler, so every storage's whole life is
    in view. Returns the peak of the allocator's memory events on this thread, and on all
    threads (gloo allocates temporaries on its own worker threads, at times that vary from run
    to run; NCCL keeps its buffers outside PyTorch's allocator)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step = build()
        for _ in range(steps):
            step()
        del step
    memory = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    threads = [e.start_thread_id() for e in memory]
    main = max(set(threads), key=threads.count)
    this = int(np.cumsum([e.nbytes() for e, t in zip(memory, threads) if t == main]).max())
    return this, int(np.cumsum([e.nbytes() for e in memory]).max())
