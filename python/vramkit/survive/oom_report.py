"""The out-of-memory post-mortem: one screen a person reads in ten seconds, and the files to dig
in (a snapshot for pytorch.org/memory_viz and the offline HTML timeline).

``PostMortem`` is built from the failed request's figures and a snapshot of the allocator at
the failure (``build``); everything in it is computed here from those, so the tests check it on
hand-built snapshots. The screen says:
- what was asked and what was free, and what this process held (allocated, reserved);
- the top live allocation sites at the moment of the OOM (``report.sites.live_at_oom``);
- with the model and optimizer known (``OomWatch.track``), the split of the device's memory into
  parameters, gradients, optimizer state and the rest (activations, temporaries);
- which remedies apply, each with the figure that makes it apply (``remedies``).
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._core.text_html import TextAsHtml
from ..report.sites import format_bytes, live_at_oom, live_sites

__all__ = ["OomDumpWarning", "PostMortem", "build", "model_state_bytes", "remedies", "write_files"]


class OomDumpWarning(UserWarning):
    """The post-mortem's files could not be written (disk full, a directory that cannot be
    created or written): the out-of-memory itself goes on as it would have."""


@dataclass
class PostMortem(TextAsHtml):
    """What vramkit knows about one out-of-memory (``str()`` is the screen; in a notebook, its
    HTML form)."""

    device: str  # "cuda:0", "cpu", "sim:1"
    allocator: str  # "vramkit" (vramkit's pools) or "torch" (PyTorch's CUDA caching allocator)
    requested: int
    free: int | None
    total: int | None
    allocated: int | None
    reserved: int | None
    allowed: int | None = None  # a cap on reserved bytes (set_memory_limit, memory fraction)
    message: str = ""
    rank: int | None = None
    sites: list[tuple[str, int, int]] = field(default_factory=list)  # (site, live bytes, allocations)
    live_from_history: bool = False  # the sites are what the history says was live at the OOM
    categories: dict[str, int] = field(default_factory=dict)  # from the tracked model and optimizer
    other_processes: list[tuple[int, str, int, bool]] = field(default_factory=list)  # pid, name, bytes, stale
    remedies: list[str] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)  # "snapshot", "timeline" -> path
    problems: list[str] = field(default_factory=list)  # what could not be done, and why
    when: float = field(default_factory=time.time)

    def __str__(self) -> str:
        return self.text()

    def text(self) -> str:
        """The screen."""
        who = f" (rank {self.rank})" if self.rank is not None else ""
        lines = [f"=== vramkit: out of memory on {self.device}{who} ==="]
        free = (f"; {format_bytes(self.free)} free of {format_bytes(self.total)}"
                if self.free is not None and self.total else "")
        held = ""
        if self.allocated is not None and self.reserved is not None:
            held = (f" (this process: {format_bytes(self.allocated)} allocated, {format_bytes(self.reserved)} "
                    f"reserved by {'PyTorch' if self.allocator == 'torch' else 'vramkit'})")
        lines.append(f"asked for {format_bytes(self.requested)}{free}{held}")
        if self.allowed is not None:
            lines.append(f"a limit of {format_bytes(self.allowed)} is set on this device")
        if self.sites:
            when = "at the out-of-memory" if self.live_from_history else "now (no history was recorded)"
            lines.append(f"live {when}, by where it was allocated:")
            lines += [f"  {format_bytes(n):>10}  {site} ({count} allocation{'s' if count != 1 else ''})"
                      for site, n, count in self.sites]
        if self.categories:
            parts = ", ".join(f"{name} {format_bytes(n)}" for name, n in self.categories.items())
            lines.append(f"by what it is: {parts}")
        if self.remedies:
            lines.append("what to try:")
            lines += [f"  - {r}" for r in self.remedies]
        if self.files:
            names = {"snapshot": "explore it with `vramkit view`, or at pytorch.org/memory_viz",
                     "timeline": "the timeline"}
            lines.append("files: " + ", ".join(f"{p} ({names.get(k, k)})" for k, p in self.files.items()))
        lines += [f"(not done: {p})" for p in self.problems]
        return "\n".join(lines)


def build(info: Mapping[str, Any], snapshot: Mapping[str, Any] | None, *, allocator: str, top: int = 5,
          trace_index: int | None = None, categories: Mapping[str, int] | None = None,
          other_processes: Sequence[tuple[int, str, int, bool]] = (), rank: int | None = None) -> PostMortem:
    """A PostMortem from the failure's figures (`info`: device, requested, free, total,
    allocated, reserved, allowed, message) and a snapshot of the allocator then (None when
    none could be taken)."""
    pm = PostMortem(device=str(info.get("device", "?")), allocator=allocator, requested=int(info.get("requested") or 0),
                    free=_int(info.get("free")), total=_int(info.get("total")), allocated=_int(info.get("allocated")),
                    reserved=_int(info.get("reserved")), allowed=_int(info.get("allowed")),
                    message=str(info.get("message") or ""), rank=rank, categories=dict(categories or {}),
                    other_processes=list(other_processes))
    if snapshot is not None:
        try:
            live, pm.live_from_history = live_at_oom(snapshot, trace_index)
            pm.sites = live_sites(live)[:top]
        except (ValueError, KeyError, TypeError) as exc:  # a snapshot we cannot read: the figures still stand
            pm.problems.append(f"the snapshot could not be read: {exc}")
    pm.remedies = remedies(pm)
    return pm


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def remedies(pm: PostMortem) -> list[str]:
    """The remedies that apply to this out-of-memory, most specific first, each with the figure
    that makes it apply."""
    out: list[str] = []
    torch_side = pm.allocator == "torch"
    conf = "PYTORCH_CUDA_ALLOC_CONF" if torch_side or pm.device.startswith("cuda") else "VRAMKIT_ALLOC_CONF"
    if pm.total and pm.requested > pm.total:
        out.append(f"the one request ({format_bytes(pm.requested)}) is larger than the whole device "
                   f"({format_bytes(pm.total)}): no setting makes it fit; make that tensor smaller (split the batch "
                   "or the sequence)")
    if pm.allowed is not None and pm.reserved is not None and pm.reserved + pm.requested > pm.allowed:
        out.append(f"the limit set on this device binds ({format_bytes(pm.allowed)}; reserved "
                   f"{format_bytes(pm.reserved)} + asked {format_bytes(pm.requested)}): raise it "
                   "(set_per_process_memory_fraction / set_memory_limit) if the device has room")
    # Fragmentation: the live bytes and the request would fit in what this process may hold (its
    # cache plus the device's free memory, under any limit) if the cache were one free block.
    unallocated = (pm.reserved or 0) - (pm.allocated or 0)
    room = (pm.reserved or 0) + (pm.free or 0)
    if pm.allowed is not None:
        room = min(room, pm.allowed)
    if (unallocated > 0 and pm.allocated is not None and pm.allocated + pm.requested <= room
            and "Expandable segments are on" not in pm.message):
        out.append(f"{conf}=expandable_segments:True: {format_bytes(unallocated)} is reserved but not allocated, "
                   f"in pieces too small for the {format_bytes(pm.requested)} asked; with the cache in one piece "
                   f"it would fit: the cache is fragmented")
    others = [p for p in pm.other_processes if p[2] > 0]
    if others:
        held = sum(p[2] for p in others)
        who = ", ".join(f"pid {pid} ({name}{', stale' if stale else ''}) {format_bytes(n)}"
                        for pid, name, n, stale in others[:3])
        out.append(f"other processes hold {format_bytes(held)} of this GPU: {who}; `vramkit smi` lists them "
                   "(and which are stale)")
    out += _by_category(pm.categories)
    if not pm.categories:
        out.append("a smaller batch, with gradient accumulation to keep the effective batch: "
                   "vramkit.survive.find_batch_size(step) finds the largest that fits")
        out.append("bf16 autocast or activation checkpointing: `vramkit fit train.py` predicts which of them "
                   "(and which batch size) fits before you run")
    return out


def _by_category(categories: Mapping[str, int]) -> list[str]:
    """Remedies for the largest part of the device's memory, when the model and optimizer are known."""
    if not categories:
        return []
    name, n = max(categories.items(), key=lambda kv: kv[1])
    size = format_bytes(n)
    if name == "optimizer state":
        return [f"the optimizer's state is the largest part ({size}): shard it (FSDP2's fully_shard, "
                "ZeroRedundancyOptimizer) or use an optimizer with less state; foreach=False avoids its step's "
                "temporary copies"]
    if name in ("parameters", "gradients"):
        return [f"{name} are the largest part ({size}): shard them over GPUs (FSDP2's fully_shard; "
                "`vramkit fit train.py --world-size N` says how many), or keep them in bf16"]
    return [f"activations and temporaries are the largest part ({size}): a smaller batch with gradient "
            "accumulation (vramkit.survive.find_batch_size finds the largest that fits), bf16 autocast, or "
            "activation checkpointing of the repeated blocks; `vramkit fit train.py` predicts which fits"]


def model_state_bytes(device: str, models: Iterable[Any], optimizers: Iterable[Any],
                      allocated: int | None) -> dict[str, int]:
    """Bytes on `device` of the models' parameters, their gradients and the optimizers' state
    tensors (each storage counted once, in the first of those it belongs to), and the rest of
    `allocated` as "activations and other" ({} when nothing of them is on the device)."""
    seen: set[int] = set()
    out = {"parameters": 0, "gradients": 0, "optimizer state": 0}

    def add(name: str, t: Any) -> None:
        if t is None or not hasattr(t, "untyped_storage") or str(t.device) != _torch_device(device):
            return
        storage = t.untyped_storage()
        key = storage.data_ptr() or id(storage)
        if key in seen:
            return
        seen.add(key)
        out[name] += int(storage.nbytes())

    params = [p for m in models for p in m.parameters()]
    for p in params:
        add("parameters", p)
    for p in params:
        add("gradients", p.grad)
    for opt in optimizers:
        for state in opt.state.values():
            for value in state.values():
                add("optimizer state", value)
    if not any(out.values()):
        return {}
    if allocated is not None:
        out["activations and other"] = max(0, allocated - sum(out.values()))
    return {k: v for k, v in out.items() if v}


def _torch_device(device: str) -> str:
    return "cuda:0" if device == "cuda" else device


def write_files(pm: PostMortem, snapshot: Mapping[str, Any] | None, directory: str, stem: str,
                trace_index: int | None = None) -> None:
    """Write the snapshot pickle and the HTML timeline as `directory`/`stem`.pickle and .html
    (into ``pm.files``). A failure is a warning and a line in ``pm.problems``, never an
    exception: the program is handling an out-of-memory already."""
    if snapshot is None:
        return
    from ..memory.api import write_snapshot
    from ..report.timeline import write_html

    snap, page = os.path.join(directory, stem + ".pickle"), os.path.join(directory, stem + ".html")
    try:
        os.makedirs(directory, exist_ok=True)
        pm.files["snapshot"] = write_snapshot(dict(snapshot), snap)
        title = f"vramkit: out of memory on {pm.device}" + (f" (rank {pm.rank})" if pm.rank is not None else "")
        write_html(page, snapshot, title=title, top=10, device=trace_index)
        pm.files["timeline"] = page
    except (OSError, ValueError) as exc:  # disk full, read-only, a directory in the way
        why = f"could not write the out-of-memory dump in {directory!r}: {type(exc).__name__}: {exc}"
        pm.problems.append(why)
        warnings.warn(why, OomDumpWarning, stacklevel=2)
