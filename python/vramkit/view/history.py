"""One device's memory history in columns, and the queries `vramkit view`'s page makes.

The x axis is the memory event (an allocation's start or end, in order), as on PyTorch's
memory_viz; "live after event e" is what every figure means. Allocations are stacked in the
order they were made, as memory_viz stacks them, so that the allocation under the cursor
(``at``) is the one drawn there. Groupings colour the timeline: the allocation site (the
innermost frame that is the user's, as ``vramkit replay`` attributes snapshot allocations), and
for ``.vktrace`` files vramkit's category and module. A grouping shows its 11 groups holding
the most at the peak; the rest are "other".

The heavy loops are C (csrc/view/timeline_query.c): each grouping keeps every group's live
bytes before every ``EVERY``-th event, so a query walks its range and at most ``EVERY`` events
more, whatever the history's length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import _C

__all__ = ["History", "Grouping", "EVERY", "MAX_WIDTH", "ALLOCATION_EVENTS", "TOP_GROUPS"]

EVERY = 1 << 16  # events between checkpoints
MAX_WIDTH = 8192  # buckets a timeline query may ask for
ALLOCATION_EVENTS = 4000  # at most this many events in range: each allocation drawn on its own
MAX_DRAWN = 600  # allocations drawn on their own in that view (the largest; the rest are the grey fill)
TOP_GROUPS = 11
MAX_SEGMENTS = 2000
MAX_BLOCKS = 20000
NO_TIME = np.iinfo(np.int64).min


@dataclass
class Grouping:
    """labels[g] for g < len(labels); allocations outside the top groups are in group len(labels) ("other")."""

    name: str
    labels: list[str]
    group: np.ndarray  # int32 per allocation, 0..len(labels)
    ckpt: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    @property
    def groups(self) -> int:
        return len(self.labels) + 1


@dataclass
class History:
    file: str
    device: str
    ev_kind: np.ndarray  # uint8
    ev_id: np.ndarray  # uint32
    ev_time: np.ndarray  # int64, NO_TIME where unknown
    a_size: np.ndarray  # uint64
    a_addr: np.ndarray  # uint64
    a_stream: np.ndarray  # uint64
    a_stack: np.ndarray  # int32, -1 without frames
    stack_start: np.ndarray  # uint64
    stack_frames: np.ndarray  # uint32
    f_file: np.ndarray  # uint32
    f_name: np.ndarray  # uint32
    f_line: np.ndarray  # int64
    strings: list[str]
    se_event: np.ndarray
    se_addr: np.ndarray
    se_size: np.ndarray
    se_stream: np.ndarray
    se_sign: np.ndarray
    oom_event: np.ndarray
    oom_size: np.ndarray
    oom_free: np.ndarray
    oom_time: np.ndarray
    fs_addr: np.ndarray
    fs_size: np.ndarray
    fs_stream: np.ndarray
    groupings: dict[str, Grouping]
    live: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # bytes live after each event
    a_alloc_ev: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    a_free_ev: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # events if never freed
    segments_known: bool = True
    _searches: dict[str, Grouping] = field(default_factory=dict)

    # ------------------------------------------------------------------ derived columns

    def derive(self) -> "History":
        """Fill live, a_alloc_ev, a_free_ev and each grouping's checkpoints (after loading columns)."""
        n = len(self.ev_kind)
        sizes = self.a_size.astype(np.int64)[self.ev_id] if n else np.zeros(0, np.int64)
        if not len(self.live):
            self.live = np.cumsum(np.where(self.ev_kind == 0, sizes, -sizes), dtype=np.int64)
        if len(self.a_alloc_ev) != len(self.a_size):
            self.a_alloc_ev = np.zeros(len(self.a_size), np.int64)
            self.a_free_ev = np.full(len(self.a_size), n, np.int64)
            idx = np.arange(n, dtype=np.int64)
            allocs = self.ev_kind == 0
            self.a_alloc_ev[self.ev_id[allocs]] = idx[allocs]
            self.a_free_ev[self.ev_id[~allocs]] = idx[~allocs]
        for g in self.groupings.values():
            if len(g.ckpt) != (n // EVERY + 1) * g.groups:
                g.ckpt = self._checkpoints(g.group, g.groups)
        return self

    def _checkpoints(self, group: np.ndarray, groups: int) -> np.ndarray:
        return np.frombuffer(_C.view_checkpoints(self.ev_kind, self.ev_id, self.a_size, group, groups, EVERY),
                             np.int64)

    def _groups_at(self, g: Grouping, at: np.ndarray) -> np.ndarray:
        raw = _C.view_groups_at(self.ev_kind, self.ev_id, self.a_size, g.group, g.groups, g.ckpt, EVERY,
                                np.ascontiguousarray(at, np.uint64))
        return np.frombuffer(raw, np.int64).reshape(len(at), g.groups)

    @property
    def events(self) -> int:
        return len(self.ev_kind)

    def stack(self, s: int) -> list[dict[str, Any]]:
        if s < 0:
            return []
        ids = self.stack_frames[int(self.stack_start[s]):int(self.stack_start[s + 1])]
        return [{"filename": self.strings[self.f_file[f]], "line": int(self.f_line[f]),
                 "name": self.strings[self.f_name[f]]} for f in ids]

    # ------------------------------------------------------------------ the page's queries

    def info(self) -> dict[str, Any]:
        n = self.events
        peak_event = int(np.argmax(self.live)) if n else 0
        times = self.ev_time[self.ev_time != NO_TIME]
        return {
            "file": self.file, "device": self.device, "events": n, "allocations": len(self.a_size),
            "peak_bytes": int(self.live[peak_event]) if n else 0, "peak_event": peak_event,
            "time_us": [int(times[0]), int(times[-1])] if len(times) else None,
            "groupings": list(self.groupings),
            "groups": {name: [{"id": i, "label": label, "color": i} for i, label in enumerate(g.labels)]
                       + [{"id": len(g.labels), "label": "other", "color": -1}]
                       for name, g in self.groupings.items()},
            "ooms": [{"event": int(e), "size": int(s), "device_free": None if f < 0 else int(f),
                      "time_us": None if t == NO_TIME else int(t)}
                     for e, s, f, t in zip(self.oom_event, self.oom_size, self.oom_free, self.oom_time)],
            "segments_known": self.segments_known,
        }

    def _check_range(self, start: int, end: int) -> None:
        n = self.events
        if not (0 <= start < end <= n):
            raise ValueError(f"start and end must satisfy 0 <= start < end <= {n:,} (the number of events); "
                             f"got start={start}, end={end}")

    def _grouping(self, name: str) -> Grouping:
        g = self.groupings.get(name)
        if g is None:
            raise ValueError(f"unknown grouping {name!r}; this file has {sorted(self.groupings)}")
        return g

    def timeline(self, start: int, end: int, width: int, grouping: str, search: str | None = None) -> dict[str, Any]:
        self._check_range(start, end)
        if not 1 <= width <= MAX_WIDTH:
            raise ValueError(f"width must be from 1 to {MAX_WIDTH} buckets; got {width}")
        g = self._grouping(grouping)
        edges = np.unique(np.linspace(start, end, min(width, end - start) + 1).round().astype(np.int64))
        counts = np.diff(edges)
        live = self.live[start:end]
        offsets = edges[:-1] - start
        peak = np.maximum.reduceat(live, offsets)
        low = np.minimum.reduceat(live, offsets)
        hit = np.flatnonzero(live == np.repeat(peak, counts))
        at = hit[np.searchsorted(hit, offsets)] + start  # each bucket's first event at its peak
        held = self._groups_at(g, at)
        bands = [{"id": k, "bytes": held[:, k].tolist()} for k in range(g.groups) if held[:, k].any()]
        times = self.ev_time[edges[:-1]]
        match = None
        if search:
            m = self._search_grouping(search)
            match = np.frombuffer(_C.view_group_peaks(self.ev_kind, self.ev_id, self.a_size, m.group, 2, m.ckpt,
                                                      EVERY, edges.astype(np.uint64), 1), np.int64).tolist()
        return {
            "start": start, "end": end, "width": len(counts), "x": edges.tolist(), "max": peak.tolist(),
            "min": low.tolist(), "bands": bands,
            "time_us": None if (times == NO_TIME).all() else [None if t == NO_TIME else int(t) for t in times],
            "match": match,
            "allocations": self._allocation_bands(start, end, g) if end - start <= ALLOCATION_EVENTS else None,
        }

    def _live_at(self, event: int) -> np.ndarray:
        """Ids of the allocations live just after `event`, in the order they were made."""
        return np.flatnonzero((self.a_alloc_ev <= event) & (self.a_free_ev > event))

    def _allocation_bands(self, start: int, end: int, g: Grouping) -> list[dict[str, Any]]:
        """The largest allocations live in [start, end) with their [lo, hi) band at each event where
        it moves, stacked in allocation order over every live allocation (the rest draw as fill)."""
        ids = np.flatnonzero((self.a_alloc_ev < end) & (self.a_free_ev >= start))
        if not len(ids):
            return []
        drawn = np.sort(ids[np.argsort(self.a_size[ids], kind="stable")[::-1][:MAX_DRAWN]])
        before = self._live_at(start - 1) if start else np.zeros(0, np.int64)
        sizes = self.a_size.astype(np.int64)
        base_cum = np.concatenate([[0], np.cumsum(sizes[before])])
        base = base_cum[np.searchsorted(before, drawn)]  # bytes below each drawn one at `start`, made before it
        ev_ids = self.ev_id[start:end].astype(np.int64)
        delta = np.where(self.ev_kind[start:end] == 0, sizes[ev_ids], -sizes[ev_ids])
        out = []
        for j, a in enumerate(drawn):
            below = ev_ids < a
            lo = base[j] + np.cumsum(np.where(below, delta, 0))
            first, last = max(int(self.a_alloc_ev[a]), start), min(int(self.a_free_ev[a]), end)
            span = np.arange(first, last) - start
            if not len(span):
                continue
            los = lo[span]
            change = np.flatnonzero(np.diff(los)) + 1
            keep = np.concatenate([[0], change])
            size = int(sizes[a])
            points = [[int(span[k] + start), int(los[k]), int(los[k]) + size] for k in keep]
            points.append([last, int(los[-1]), int(los[-1]) + size])
            out.append({"id": int(a), "group": int(g.group[a]), "points": points})
        return out

    def at(self, event: int, y: int) -> dict[str, Any]:
        if not 0 <= event < self.events:
            raise ValueError(f"event must be from 0 to {self.events - 1:,}; got {event}")
        live = self._live_at(event)
        cum = np.cumsum(self.a_size[live].astype(np.int64))
        total = int(cum[-1]) if len(cum) else 0
        allocation = None
        if 0 <= y < total:
            k = int(np.searchsorted(cum, y, side="right"))
            a = int(live[k])
            free_ev = int(self.a_free_ev[a])
            t_alloc = self.ev_time[self.a_alloc_ev[a]]
            t_free = self.ev_time[free_ev] if free_ev < self.events else NO_TIME
            allocation = {
                "id": a, "size": int(self.a_size[a]), "addr": int(self.a_addr[a]), "stream": int(self.a_stream[a]),
                "alloc_event": int(self.a_alloc_ev[a]), "free_event": free_ev if free_ev < self.events else None,
                "alloc_time_us": None if t_alloc == NO_TIME else int(t_alloc),
                "free_time_us": None if t_free == NO_TIME else int(t_free),
                "group": self._label(a), "lo": int(cum[k] - self.a_size[a]), "hi": int(cum[k]),
                "frames": self.stack(int(self.a_stack[a])),
            }
        return {"event": event, "live_bytes": total, "live_count": len(live), "allocation": allocation}

    def _label(self, a: int) -> str:
        g = next(iter(self.groupings.values()))
        k = int(g.group[a])
        return g.labels[k] if k < len(g.labels) else "other"

    def segments(self, event: int) -> dict[str, Any]:
        if not 0 <= event < self.events:
            raise ValueError(f"event must be from 0 to {self.events - 1:,}; got {event}")
        ranges = [(int(a), int(s), int(st)) for a, s, st in zip(self.fs_addr, self.fs_size, self.fs_stream)]
        later = np.flatnonzero(self.se_event > event)  # changes after `event`, undone newest first
        for k in later[::-1]:
            addr, size, stream = int(self.se_addr[k]), int(self.se_size[k]), int(self.se_stream[k])
            if self.se_sign[k] > 0:
                ranges = _subtract(ranges, addr, size)
            else:
                ranges.append((addr, size, stream))
        ranges.sort()
        live = self._live_at(event)
        addrs, sizes = self.a_addr[live], self.a_size[live]
        order = np.argsort(addrs, kind="stable")
        live, addrs, sizes = live[order], addrs[order], sizes[order]
        out, blocks_listed = [], 0
        for addr, size, stream in ranges[:MAX_SEGMENTS]:
            lo, hi = np.searchsorted(addrs, addr), np.searchsorted(addrs, addr + size)
            take = max(0, min(int(hi - lo), MAX_BLOCKS - blocks_listed))
            blocks_listed += take
            out.append({"addr": addr, "size": size, "stream": stream,
                        "blocks": [{"addr": int(addrs[i]), "size": int(sizes[i]), "id": int(live[i])}
                                   for i in range(int(lo), int(lo) + take)]})
        return {"event": event, "reserved": sum(r[1] for r in ranges), "allocated": int(sizes.sum()),
                "segments": out, "truncated": bool(len(ranges) > MAX_SEGMENTS or blocks_listed >= MAX_BLOCKS)}

    # ------------------------------------------------------------------ search

    def _matching(self, text: str) -> np.ndarray:
        """Per allocation: whether a frame of its stack (file or function) or its group label contains text."""
        needle = text.lower()
        hit_str = np.array([needle in s.lower() for s in self.strings], dtype=bool)
        hit_frame = (hit_str[self.f_file] | hit_str[self.f_name]) if len(self.f_file) else np.zeros(0, bool)
        counts: np.ndarray = np.diff(self.stack_start.astype(np.int64))
        per_frame = hit_frame[self.stack_frames] if len(self.stack_frames) else np.zeros(0, bool)
        hit_stack = np.zeros(len(counts), bool)
        if len(per_frame):
            owners = np.repeat(np.arange(len(counts)), counts)
            hit_stack[owners[per_frame]] = True
        match = np.zeros(len(self.a_size), bool)
        has = self.a_stack >= 0
        match[has] = hit_stack[self.a_stack[has]]
        for g in self.groupings.values():
            labels = np.array([needle in label.lower() for label in g.labels] + [False])
            match |= labels[g.group]
        return match

    def _search_grouping(self, text: str) -> Grouping:
        hit = self._searches.get(text)
        if hit is None:
            group = self._matching(text).astype(np.int32)
            hit = Grouping("search", ["match"], group, self._checkpoints(group, 2))
            if len(self._searches) > 16:
                self._searches.clear()
            self._searches[text] = hit
        return hit

    def search(self, text: str) -> dict[str, Any]:
        if not text or len(text) > 200:
            raise ValueError("search text must be 1 to 200 characters")
        m = self._search_grouping(text)
        hit = m.group.astype(bool)
        stacks = np.unique(self.a_stack[hit & (self.a_stack >= 0)])
        peak = 0
        if self.events:
            peak = int(np.frombuffer(_C.view_group_peaks(self.ev_kind, self.ev_id, self.a_size, m.group, 2, m.ckpt,
                                                         EVERY, np.array([0, self.events], np.uint64), 1),
                                     np.int64)[0])
        return {"text": text, "stacks": len(stacks), "allocations": int(hit.sum()), "peak_bytes": peak}


def _subtract(ranges: list[tuple[int, int, int]], addr: int, size: int) -> list[tuple[int, int, int]]:
    """Address ranges less [addr, addr + size), split where it falls inside one."""
    out = []
    end = addr + size
    for a, s, st in ranges:
        e = a + s
        if e <= addr or a >= end:
            out.append((a, s, st))
            continue
        if a < addr:
            out.append((a, addr - a, st))
        if e > end:
            out.append((end, e - end, st))
    return out
