"""amp_dense_ab — does the strided/sparse fallback cost the dense fast path anything?

    python benchmarks/amp_dense_ab.py OLD_PYTHONPATH NEW_PYTHONPATH

Times `vramkit.amp.unscale_(grads, 0.5)` on 200 dense float32 arrays of log-uniform sizes
(300 to 300 000 elements, seed 0; 11.2 M elements in all), one thread, in fresh child Pythons
importing vramkit from each path in turn (old, new, new, old, ...: 6 children). Each child warms
up 50 calls and reports the median of 400; the table gives the median of the children. Build the
old tree with `python setup.py build_ext --inplace` in a checkout of the earlier commit.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time
import numpy as np
sys.path.insert(0, sys.argv[1])
import vramkit.amp as amp
rng = np.random.default_rng(0)
sizes = np.maximum((np.exp(rng.uniform(0, np.log(1000), 200)) * 300).astype(int), 1)
grads = [rng.standard_normal(int(n)).astype(np.float32) for n in sizes]
amp.set_num_threads(1)
for _ in range(50):
    amp.unscale_(grads, 0.5)
times = []
for _ in range(400):
    t = time.perf_counter_ns()
    amp.unscale_(grads, 0.5)
    times.append(time.perf_counter_ns() - t)
print(json.dumps({"median_ns": sorted(times)[len(times) // 2], "elements": int(sizes.sum())}))
"""


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__)
        return 2
    paths = {"old": argv[0], "new": argv[1]}
    runs: dict[str, list[float]] = {"old": [], "new": []}
    elements = 0
    for i in range(6):
        for name in ("old", "new") if i % 2 == 0 else ("new", "old"):
            out = subprocess.run([sys.executable, "-c", CHILD, paths[name]], capture_output=True, text=True, check=True)
            rec = json.loads(out.stdout.strip().splitlines()[-1])
            runs[name].append(rec["median_ns"] / 1e3)
            elements = rec["elements"]
    old, new = statistics.median(runs["old"]), statistics.median(runs["new"])
    print(f"| build | unscale_ of {elements:,} fp32 elements in 200 arrays (median µs) | children |")
    print("|---|---|---|")
    print(f"| old ({paths['old']}) | {old:.1f} | {', '.join(f'{x:.0f}' for x in runs['old'])} |")
    print(f"| new ({paths['new']}) | {new:.1f} ({new / old:.3f}x) | {', '.join(f'{x:.0f}' for x in runs['new'])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
