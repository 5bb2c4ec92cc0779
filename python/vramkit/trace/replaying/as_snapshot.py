"""A replayed trace as a memory snapshot dict (PyTorch's ``_snapshot()`` shape), so the HTML
timeline that ``vramkit run`` writes (``timeline.write_html``) shows a prediction too.

Each allocation becomes an ``alloc`` / ``free_requested`` pair at its simulated address with
its block size; each change of reserved bytes a ``segment_alloc`` / ``segment_free`` entry;
the frames name the module path (as the file) and the op (as the function). The final
``segments`` hold what is still live, so the curves end where the replay did.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..formats.file_format import ALLOC, FREE, Trace
from .replay_sim import Prediction

__all__ = ["prediction_snapshot"]


def prediction_snapshot(trace: Trace, prediction: Prediction) -> dict[str, Any]:
    """Build the snapshot of a ``replay(..., curves=True)`` result."""
    c = prediction.curves
    if not c:
        raise ValueError("the prediction has no per-event curves: replay it with curves=True")
    kind, ids, allocated, reserved, address = c["kind"], c["id"], c["allocated"], c["reserved"], c["address"]
    n = len(kind)
    block = np.diff(allocated.astype(np.int64), prepend=0)
    dres = np.diff(reserved.astype(np.int64), prepend=0)
    num = trace.num_allocations
    frames_of: dict[int, list[dict[str, Any]]] = {}

    def frames(i: int) -> list[dict[str, Any]]:
        if i >= num:
            return [{"filename": "(GPU line item)", "line": 0, "name": "workspace"}]
        key = (int(trace.alloc_module[i]) << 32) ^ int(trace.alloc_op[i])
        f = frames_of.get(key)
        if f is None:
            module = trace.name_of("modules", int(trace.alloc_module[i]))
            f = frames_of[key] = [{"filename": module if module != "?" else "(outside modules)", "line": 0,
                                   "name": trace.name_of("ops", int(trace.alloc_op[i]))}]
        return f

    entries: list[dict[str, Any]] = []
    addr_of: dict[int, int] = {}
    size_of: dict[int, int] = {}
    for e in range(n):
        k = int(kind[e])
        if dres[e] > 0:
            entries.append({"action": "segment_alloc", "addr": 0, "size": int(dres[e]), "stream": 0, "frames": []})
        if k == ALLOC and block[e] > 0:
            i = int(ids[e])
            addr_of[i], size_of[i] = int(address[e]), int(block[e])
            entries.append({"action": "alloc", "addr": addr_of[i], "size": size_of[i], "stream": 0,
                            "frames": frames(i)})
        elif k == FREE:
            i = int(ids[e])
            if i in addr_of:
                entries.append({"action": "free_requested", "addr": addr_of[i], "size": size_of[i], "stream": 0,
                                "frames": frames(i)})
                entries.append({"action": "free_completed", "addr": addr_of.pop(i), "size": size_of.pop(i),
                                "stream": 0, "frames": []})
        if dres[e] < 0:
            entries.append({"action": "segment_free", "addr": 0, "size": int(-dres[e]), "stream": 0, "frames": []})
    live: list[dict[str, Any]] = [
        {"address": addr_of[i], "size": size_of[i], "requested_size": size_of[i], "state": "active_allocated",
         "frames": frames(i)} for i in addr_of]
    final_reserved = int(reserved[-1]) if n else 0
    segments = [{"address": 0, "total_size": final_reserved, "stream": 0, "segment_type": "large",
                 "allocated_size": sum(b["size"] for b in live), "active_size": sum(b["size"] for b in live),
                 "blocks": live}] if final_reserved else []
    return {"segments": segments, "device_traces": [entries],
            "vramkit_device": f"simulated GPU, {prediction.usable:,} bytes usable"}
