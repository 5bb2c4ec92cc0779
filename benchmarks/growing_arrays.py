"""growing_arrays — NumPy arrays that grow by np.concatenate, on vramkit's cpu pool.

Run by fragmentation.py in a fresh child Python per allocator setting (VRAMKIT_ALLOC_CONF
from the environment: "" for the classic policy, "expandable_segments:True"), so resident
memory belongs to one setting only. Prints one JSON line: resident memory at the end (RSS
from /proc/self/statm, before any empty_cache), reserved bytes at the end and at the peak,
the peak of allocated bytes, and a checksum of the final arrays (equal for both settings).

The workload (seed 1234): four buffers, each extended every step by a float64 chunk of
32 Ki..512 Ki elements (256 KiB..4 MiB, log-uniform) through `np.concatenate`, which
allocates the larger array and frees the old one, as a growing log, a replay buffer or a
token list does; every 16th step a 1 MiB array is kept (a long-lived small object between
the growing ones). 400 steps (100 with --quick): each buffer ends near 400 MiB.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import use_source_tree

use_source_tree()

import numpy as np
import vramkit
import vramkit.numpy as vnp


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    steps = 100 if "--quick" in sys.argv else 400
    rng = np.random.default_rng(1234)
    vnp.install()
    buffers = [np.zeros(0) for _ in range(4)]
    kept = []
    for step in range(steps):
        for k in range(4):
            n = int(np.exp(rng.uniform(np.log(32 << 10), np.log(512 << 10))))
            buffers[k] = np.concatenate([buffers[k], rng.random(n)])
        if step % 16 == 0:
            kept.append(np.full(1 << 17, float(step)))
    checksum = float(sum(b.sum() for b in buffers) + sum(k[0] for k in kept))
    assert all(vnp.uses_vramkit(b) for b in buffers)
    print(json.dumps({
        "rss_end": rss(), "reserved_end": vramkit.memory_reserved("cpu"),
        "reserved_peak": vramkit.max_memory_reserved("cpu"), "allocated_peak": vramkit.max_memory_allocated("cpu"),
        "allocated_end": vramkit.memory_allocated("cpu"), "checksum": checksum,
        "alloc_conf": os.environ.get("VRAMKIT_ALLOC_CONF", ""), "steps": steps,
    }))


if __name__ == "__main__":
    main()
