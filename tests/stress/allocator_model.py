"""A plain Python model of what the allocator must have handed out, used by the randomized
differential tests. It knows every live allocation (its request, stream and pool), every
freed block still used by another stream, and checks after each operation that:

- the counters (allocation, allocated/active/requested bytes, per pool) equal the model's;
- a new block is at least the 512-rounded request, lies in the right pool, on the right
  stream, and overlaps no live block and no block another stream may still use;
- on the cpu device, the bytes stamped into every live block survive all other operations;
- vramkit.pool_check() passes (segments tiled, free blocks merged and indexed, counters
  equal to a recount).
Block sizes can exceed the rounded request by an unsplit remainder: at most 1 MiB in the
large pool (PyTorch splits remainders above 1 MiB), or max_non_split_rounding for oversize
blocks when max_split_size is set; with expandable segments, never (every remainder of 512 B
or more is split off).
"""

from __future__ import annotations

import bisect
import ctypes
from dataclasses import dataclass, field

import vramkit
from vramkit import _C

MiB = 1 << 20
SMALL = 1 << 20


def round512(n: int) -> int:
    return max(512, (n + 511) // 512 * 512)


@dataclass
class Live:
    size: int
    requested: int
    stream: int
    small: bool
    tag: int


@dataclass
class AllocatorModel:
    device: str
    touch_memory: bool
    max_split: int | None = None
    expandable: bool = False  # expandable segments split every remainder of 512 B or more
    live: dict[int, Live] = field(default_factory=dict)
    pending: dict[int, tuple[Live, int]] = field(default_factory=dict)  # ptr -> (block, stream it waits on)
    starts: list[int] = field(default_factory=list)  # sorted starts of live + pending blocks
    ends: dict[int, int] = field(default_factory=dict)
    ooms: int = 0
    violations: list[str] = field(default_factory=list)
    _tag: int = 1
    ooms_before: int = -1  # the pool's num_ooms when the model started (shared pools carry earlier tests')

    def __post_init__(self) -> None:
        if self.ooms_before < 0:
            self.ooms_before = _C.memory_stats(self.device)["num_ooms"]

    # ---- bookkeeping -------------------------------------------------------------------
    def _occupy(self, ptr: int, size: int) -> None:
        i = bisect.bisect_left(self.starts, ptr)
        if i > 0 and self.ends[self.starts[i - 1]] > ptr:
            self.violations.append(f"block {ptr:#x} overlaps the block at {self.starts[i - 1]:#x}")
        if i < len(self.starts) and self.starts[i] < ptr + size:
            self.violations.append(f"block {ptr:#x}+{size} overlaps the block at {self.starts[i]:#x}")
        self.starts.insert(i, ptr)
        self.ends[ptr] = ptr + size

    def _release(self, ptr: int) -> None:
        self.starts.pop(bisect.bisect_left(self.starts, ptr))
        del self.ends[ptr]

    def _drop_pending(self, stream: int | None) -> None:
        for ptr in [p for p, (_, s) in self.pending.items() if stream is None or s == stream]:
            del self.pending[ptr]
            self._release(ptr)

    def _syncs(self) -> int:
        return _C.memory_stats(self.device)["num_sync_all_streams"]

    # ---- operations --------------------------------------------------------------------
    def alloc(self, nbytes: int, stream: int) -> None:
        syncs = self._syncs()
        try:
            ptr = vramkit.raw_alloc(nbytes, self.device, stream)
        except vramkit.OutOfMemoryError:
            self.ooms += 1
            ptr = None
        # Under memory pressure malloc waits on every outstanding event before it releases
        # the cache (PyTorch's release_cached_blocks): every pending block is returned.
        if self._syncs() != syncs:
            self._drop_pending(None)
        if ptr is None:
            return
        info = vramkit._C.block_info(ptr)
        rounded, small = round512(nbytes), round512(nbytes) <= SMALL
        slack = info["size"] - rounded
        allowed = 0 if small or self.expandable else (20 * MiB if self.max_split and rounded >= self.max_split else SMALL)
        if info["requested_size"] != nbytes or info["stream"] != stream or slack < 0 or slack > allowed:
            self.violations.append(f"alloc({nbytes}) gave {info}")
        if info["pool"] != ("small" if small else "large") or info["size"] % 512:
            self.violations.append(f"alloc({nbytes}) landed in the {info['pool']} pool: {info}")
        self._occupy(ptr, info["size"])
        tag = self._tag = self._tag % 251 + 1
        self.live[ptr] = Live(info["size"], nbytes, stream, small, tag)
        if self.touch_memory:
            ctypes.memset(ptr, tag, min(nbytes, 64))
            ctypes.memset(ptr + max(0, nbytes - 64), tag, min(nbytes, 64))

    def free(self, ptr: int, other_stream: int | None) -> None:
        block = self.live.pop(ptr)
        if self.touch_memory:
            expected = bytes([block.tag]) * min(block.requested, 64)
            if ctypes.string_at(ptr, len(expected)) != expected or \
               ctypes.string_at(ptr + max(0, block.requested - 64), len(expected)) != expected:
                self.violations.append(f"the bytes of live block {ptr:#x} were overwritten")
        if other_stream is not None:
            vramkit.record_stream(ptr, other_stream)
        vramkit.raw_free(ptr)
        if other_stream is not None and other_stream != block.stream:
            self.pending[ptr] = (block, other_stream)
        else:
            self._release(ptr)

    def synchronize(self, stream: int) -> None:
        vramkit.synchronize(self.device, stream)
        self._drop_pending(stream)

    def empty_cache(self) -> None:
        vramkit.empty_cache(self.device)
        self._drop_pending(None)

    def bad_input(self, which: int) -> None:
        before = _C.memory_stats(self.device)
        calls = [
            (lambda: vramkit.raw_alloc(-1, self.device), ValueError),
            (lambda: vramkit.raw_alloc(1 << 62, self.device), ValueError),
            (lambda: vramkit.raw_free(0x7), ValueError),
            (lambda: vramkit.raw_alloc(2.5, self.device), TypeError),
            (lambda: vramkit.record_stream(0x9, 1), ValueError),
        ]
        call, exc = calls[which % len(calls)]
        try:
            call()
            self.violations.append(f"bad input #{which % len(calls)} was accepted")
        except exc:
            pass
        if _C.memory_stats(self.device) != before:
            self.violations.append(f"bad input #{which % len(calls)} changed the counters")

    # ---- checks --------------------------------------------------------------------------
    def check(self, where: str) -> None:
        try:
            vramkit.pool_check(self.device)
        except vramkit.VramkitError as e:
            self.violations.append(f"{where}: {e}")
        s = _C.memory_stats(self.device)
        blocks = list(self.live.values())
        waiting = [b for b, _ in self.pending.values()]
        for pool, keep in (("all", lambda b: True), ("small_pool", lambda b: b.small), ("large_pool", lambda b: not b.small)):
            got = (s[f"allocation.{pool}.current"], s[f"allocated_bytes.{pool}.current"], s[f"active.{pool}.current"],
                   s[f"active_bytes.{pool}.current"], s[f"requested_bytes.{pool}.current"])
            mine = [b for b in blocks if keep(b)]
            held = mine + [b for b in waiting if keep(b)]
            want = (len(mine), sum(b.size for b in mine), len(held), sum(b.size for b in held),
                    sum(b.requested for b in held))
            if got != want:
                self.violations.append(f"{where}: {pool} counters {got} != model {want}")
        if s["num_ooms"] - self.ooms_before != self.ooms:
            self.violations.append(f"{where}: num_ooms {s['num_ooms'] - self.ooms_before} != model {self.ooms}")
        if s["reserved_bytes.all.current"] < s["active_bytes.all.current"]:
            self.violations.append(f"{where}: reserved below active")

    def drain(self) -> None:
        for ptr in list(self.live):
            self.free(ptr, None)
        self.empty_cache()
        self.check("drain")
        if vramkit.memory_reserved(self.device) != 0:
            self.violations.append("memory remained reserved after freeing everything and empty_cache()")
