"""torch_glue — what vramkit as torch's CUDA allocator costs, layer by layer (issue 35, part 3).

torch reaches vramkit through ``CUDAPluggableAllocator``: per tensor, an alloc_fn call through a
std::function, a mutex and a hash-map insert; per free, the map lookup and erase under the mutex
and a free_fn call. This measures, on the realistic size mix of ``alloc.py`` (20,000 sizes; 2,000
with --quick), in loops written in C and C++ so that no Python is timed:

  * direct: ``vram_malloc`` + ``vram_free`` on the pool (vramkit's own pair);
  * hooks: ``vramkit_torch_malloc`` + ``vramkit_torch_free``, the functions torch calls, with the
    request for cuda:0 routed to the same pool (what vramkit's glue adds);
  * hooks + torch's bookkeeping: the same calls inside the operations CUDAPluggableAllocator
    does around them (std::function, mutex, unordered_map; csrc/torch/bench_glue.cpp), which a
    CPU build of torch does not have: a stand-in for torch's side, measured rather than guessed.

On a machine without a GPU the pool is a simulated device (same allocator code, no CUDA calls);
with ``--device cuda:0`` it is the GPU's. What is left of the GPU figure (``torch.empty`` + ``del``
against torch's own allocator, ``gpu/alloc.py``) is torch's tensor machinery, common to both.

    PYTHONPATH=python python benchmarks/torch_glue.py [--quick] [--device sim|cuda:0]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import median, use_source_tree  # noqa: E402

use_source_tree()

from alloc import realistic_mix  # noqa: E402


def measure(device: str, n_sizes: int, passes: int) -> dict[str, float]:
    """Median ns per alloc+free pair: direct, through the hooks, through hooks and bookkeeping."""
    import vramkit
    from vramkit import _C

    target = str(vramkit.sim.create(64 << 30)) if device == "sim" else device
    sizes = realistic_mix(n_sizes)
    _C.bench_torch_glue_pairs(target, sizes, 1)  # warm-up: fills the cache the timed passes reuse
    direct, hooks, booked = _C.bench_torch_glue_pairs(target, sizes, passes)
    return {"device": target, "direct": median(direct), "hooks": median(hooks), "hooks_and_bookkeeping": median(booked)}


def table(r: dict[str, float]) -> str:
    d = r["direct"]
    lines = ["| path | ns per alloc+free pair | over vramkit's own pair |", "|---|---|---|",
             f"| vramkit's pair (`vram_malloc` + `vram_free`) on {r['device']} | {d:.1f} | 1.00 |",
             f"| torch's hooks (`vramkit_torch_malloc` + `vramkit_torch_free`) | {r['hooks']:.1f} | "
             f"{r['hooks'] / d:.2f} (+{r['hooks'] - d:.1f} ns) |",
             f"| hooks inside CUDAPluggableAllocator's bookkeeping (stand-in) | {r['hooks_and_bookkeeping']:.1f} | "
             f"{r['hooks_and_bookkeeping'] / d:.2f} (+{r['hooks_and_bookkeeping'] - r['hooks']:.1f} ns more) |"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2,000 sizes, 5 passes")
    parser.add_argument("--device", default="sim", help="'sim' (a simulated device, default) or cuda:0")
    args = parser.parse_args(argv)
    r = measure(args.device, 2_000 if args.quick else 20_000, 5 if args.quick else 15)
    print(table(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
