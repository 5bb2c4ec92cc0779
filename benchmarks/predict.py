"""predict — how long `vramkit fit` takes, and what a parameter-only estimate misses.

What it measures
  For examples/gpt_fit.py (a 1.42B-parameter GPT-style decoder, AdamW, 1024-token sequences)
  and a 6.7B decoder of LLaMA-7B's sizes (width 4096, 32 layers, 32000 tokens, 256-token
  sequences): the time to capture two training steps on the meta device (one for the 6.7B
  model), the events per second of the capture, and the time of the replay on a simulated 256
  GiB GPU (large enough that the peak, not an OOM, is measured). With --quick the 6.7B model
  is skipped and the GPT is captured once.
  The peer is the estimate people make without a tool: 16 bytes per parameter (fp32
  weight, gradient and two Adam moments) and nothing for activations; the ratio is vramkit's
  predicted peak allocated over that estimate, i.e. how much the estimate leaves out.

Checks: the predicted peak is at least the parameter-only estimate, and the capture's
parameter bytes equal 4 x the model's parameter count.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import REPO, Row, fmt_bytes, main_for, median, use_source_tree

use_source_tree()


def _models(quick: bool):
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("gpt_fit", os.path.join(REPO, "examples", "gpt_fit.py"))
    gpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpt)
    with torch.device("meta"):
        n = sum(p.numel() for p in gpt.GPT().parameters())
    yield "gpt_fit.py (1.42B), batch 8", gpt.vramkit_step, 8, 2, n
    if quick:
        return
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from trace_models import GPTConfig, gpt_builder

    cfg = GPTConfig(vocab=32000, seq=256, dim=4096, heads=32, layers=32)
    yield "decoder 6.7B (LLaMA-7B sizes), batch 1", gpt_builder(cfg), 1, 1, cfg.num_params


def run(quick: bool = False) -> list[Row]:
    try:
        import torch  # noqa: F401
    except ImportError:
        return []
    from vramkit import trace as vt

    rows = []
    passes = 1 if quick else 3
    for name, build, batch, steps, params in _models(quick):
        capture_s, replay_s = [], []
        for _ in range(passes):
            t0 = time.perf_counter()
            t = vt.capture(build, batch, device="meta", steps=steps)
            t1 = time.perf_counter()
            p = vt.replay(t, "256GiB")  # large enough that the peak, not an OOM, is measured
            capture_s.append(t1 - t0)
            replay_s.append(time.perf_counter() - t1)
        estimate = 16 * params
        cap = median(capture_s)
        checks = {
            "predicted peak >= parameter-only estimate": p.peak_allocated >= estimate or not p.fits,
            "parameter bytes == 4 x parameters": int(t.alloc_size[t.alloc_category == vt.CATEGORIES.index("parameter")]
                                                     .sum()) == 4 * params,
        }
        rows.append(Row(
            benchmark=f"predict: {name}, {steps} step(s) on meta", vramkit=cap,
            vramkit_text=f"capture {cap:.2f} s ({t.num_events / cap / 1e3:.0f}k events/s), replay "
                         f"{median(replay_s) * 1e3:.1f} ms; peak {fmt_bytes(p.peak_allocated)}"
                         + ("" if p.fits else " (OOM on 256 GiB)"),
            peer_name="16 B/parameter estimate", peer=estimate, peer_text=fmt_bytes(estimate),
            ratio=p.peak_allocated / estimate, ratio_text=f"{p.peak_allocated / estimate:.2f}x the estimate",
            target="", met=None, checks=checks,
            detail={"events": t.num_events, "capture_s": capture_s, "replay_s": replay_s, "parameters": params,
                    "by_category": p.by_category, "fits_256GiB": p.fits},
        ))
    return rows


if __name__ == "__main__":
    main_for(run, __doc__.splitlines()[0])
