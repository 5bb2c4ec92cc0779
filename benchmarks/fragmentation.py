"""fragmentation — how much memory the caching allocator holds beyond what a training run uses.

What it measures
  A deterministic synthetic trace of a mixed-precision GPT-style training run is replayed with
  `vramkit.raw_alloc` / `vramkit.raw_free` on a fresh simulated 80 GiB device (`sim`, no memory
  behind the addresses), and the figure is

      peak reserved / peak allocated  = vramkit.max_memory_reserved(dev) / max_memory_allocated(dev)

  (allocated counts rounded block sizes, as PyTorch does). The "peer" is the ideal allocator,
  one that reserves exactly its peak allocation (ratio 1.00). The same trace is replayed twice,
  each on its own new sim device: with default settings, and with `max_split_size_mb=128`
  (the value in vramkit's design notes and PyTorch's documentation example; here it makes the
  logits, their fp32 copy and gradient (132 MiB and up, a different size every step), the
  embedding's state and the MLP activations at full length unsplittable "oversize" blocks,
  while the other per-layer activations, at most 96 MiB, are split as usual).

The trace (seed 1234; 400 steps, 12 with --quick):
  * model: 24 layers, hidden 2048, 16 heads, vocabulary 50304, context 2048, tied embeddings;
    about 1.31 G parameters in 24 * 12 + 4 tensors.
  * persistent, allocated once before step 1: bf16 weights, fp32 master weights, AdamW
    exp_avg and exp_avg_sq (14 bytes per parameter, about 17 GiB).
  * each step: batch 4, sequence length = longest of 4 log-normal lengths (median 512)
    padded to a multiple of 8 and capped at 2048, so the token count t varies every step.
    - forward, per layer: saved activations (layer input, LayerNorm outputs and fp32
      mean/rstd, qkv, flash-attention output and fp32 logsumexp, dropout masks, MLP
      4h-wide pre- and post-GELU, residuals) kept until backward; transient q/k/v copies and
      pre-dropout projections freed at once.
    - head: bf16 logits and an fp32 logsumexp kept; the fp32 upcast of the logits for the
      loss freed at once; in backward an fp32 and a bf16 logits gradient.
    - backward in reverse layer order: each layer's incoming-gradient temporaries, weight
      gradients (bf16, kept until the optimizer step), and its saved activations freed in
      reverse order of creation as autograd releases each node.
    - optimizer: per parameter an fp32 temporary (upcast gradient), then all gradients freed
      (zero_grad(set_to_none=True)).

Also reported, for information: the smallest simulated device (bisected to 1/16 GiB) on which
the whole trace runs without an OutOfMemoryError, over peak allocated, for both settings. Under
memory pressure the allocator frees cached blocks and retries, so this is the figure that says
whether a run fits, while the first one says how much the cache holds when nothing forces it
to give memory back.

Four settings throughout: defaults, max_split_size_mb=128, expandable_segments (PyTorch's
20 MiB large-pool pages) and expandable_segments with expandable_page_mb=2.

Targets (from the issues): <= 1.15 with default settings; <= 1.02 with expandable segments;
the max_split_size_mb figure is reported alongside.

The serving trace (serving_trace.py: requests arriving and finishing at random, each KV cache
reallocated larger every 16-64 tokens, about 300 requests in flight; 3000 decoding steps, 300
with --quick) is replayed with the C loop (`vramkit.trace.replay`) on simulated devices: the
smallest device on which it completes (bisected to 16 MiB) over its peak allocated, and peak
reserved over peak allocated on an 80 GiB device. Target for expandable segments: <= 1.05;
the classic settings are the baseline.

Cost of expandable segments (target: within 1.5x of the classic policy), passes interleaved:
ns per cached alloc+free pair looped in C over alloc.py's realistic size mix on two warm
80 GiB sim devices, and ns per event of the serving trace's C replay on an 80 GiB device.

cpu: growing_arrays.py (NumPy buffers grown by np.concatenate, vramkit's handler installed)
in two fresh child Pythons, VRAMKIT_ALLOC_CONF empty and expandable_segments:True: resident
memory (/proc/self/statm) at the end, before any empty_cache. Reported, no target.
"""

from __future__ import annotations

import math
import os
import sys

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Row, fmt_bytes, fmt_ns, interleaved, main_for, median, use_source_tree

use_source_tree()

import numpy as np
import vramkit

SEED = 1234
DEVICE_BYTES = 80 << 30
TARGET = 1.15
EXPANDABLE_TRAINING_TARGET = 1.02
SERVING_TARGET = 1.05
COST_TARGET = 1.5
MAX_SPLIT_MB = 128
CAPACITY_STEP = 1 << 26  # 1/16 GiB

LAYERS, HIDDEN, HEADS, VOCAB, CONTEXT, BATCH = 24, 2048, 16, 50304, 2048, 4
BF16, FP32, BOOL = 2, 4, 1


class Trace:
    """A list of ops: (id, size) allocates buffer `id`, (id, -1) frees it."""

    def __init__(self) -> None:
        self.ops: list[tuple[int, int]] = []
        self.next_id = 0
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak_requested = 0

    def alloc(self, size: int) -> int:
        i = self.next_id
        self.next_id += 1
        self.ops.append((i, size))
        self.live[i] = size
        self.current += size
        self.peak_requested = max(self.peak_requested, self.current)
        return i

    def free(self, i: int) -> None:
        self.ops.append((i, -1))
        self.current -= self.live.pop(i)


def sequence_lengths(steps: int, seed: int = SEED) -> list[int]:
    rng = np.random.default_rng(seed)
    lengths = rng.lognormal(mean=math.log(512), sigma=0.6, size=(steps, BATCH)).max(axis=1)
    padded = np.ceil(lengths / 8) * 8
    return [int(min(CONTEXT, max(8, s))) for s in padded]


def layer_param_shapes() -> list[int]:
    h = HIDDEN
    return [h, h, 3 * h * h, 3 * h, h * h, h, h, h, 4 * h * h, 4 * h, 4 * h * h, h]


def build_trace(steps: int, seed: int = SEED) -> tuple[Trace, list[int]]:
    tr = Trace()
    h = HIDDEN
    # Parameter numel in creation order: embeddings, layers, final LayerNorm.
    params = [VOCAB * h, CONTEXT * h] + [n for _ in range(LAYERS) for n in layer_param_shapes()] + [h, h]
    for n in params:  # persistent: bf16 weight, fp32 master, exp_avg, exp_avg_sq
        tr.alloc(n * BF16)
        tr.alloc(n * FP32)
        tr.alloc(n * FP32)
        tr.alloc(n * FP32)
    persistent = len(tr.live)
    lengths = sequence_lengths(steps, seed)
    for s in lengths:
        t = BATCH * s  # tokens this step
        grads: list[int] = []

        # ---- forward ----
        tokens = tr.alloc(t * 8)  # int64 input ids
        x = tr.alloc(t * h * BF16)  # embedding output (wte + wpe)
        saved_per_layer: list[list[int]] = []
        for _ in range(LAYERS):
            saved = [x]  # the layer input is saved for ln1's backward
            saved += [tr.alloc(t * FP32), tr.alloc(t * FP32)]  # ln1 mean, rstd
            ln1 = tr.alloc(t * h * BF16)
            saved.append(ln1)
            qkv = tr.alloc(t * 3 * h * BF16)
            saved.append(qkv)
            q, k, v = (tr.alloc(t * h * BF16) for _ in range(3))  # contiguous per-head copies
            attn = tr.alloc(t * h * BF16)
            lse = tr.alloc(BATCH * HEADS * s * FP32)
            for buf in (v, k, q):
                tr.free(buf)
            saved += [attn, lse]
            proj = tr.alloc(t * h * BF16)
            mask1 = tr.alloc(t * h * BOOL)
            x2 = tr.alloc(t * h * BF16)  # residual: x + dropout(proj)
            tr.free(proj)
            saved += [mask1, x2]
            saved += [tr.alloc(t * FP32), tr.alloc(t * FP32)]  # ln2 mean, rstd
            ln2 = tr.alloc(t * h * BF16)
            fc1 = tr.alloc(t * 4 * h * BF16)
            gelu = tr.alloc(t * 4 * h * BF16)
            saved += [ln2, fc1, gelu]
            fc2 = tr.alloc(t * h * BF16)
            mask2 = tr.alloc(t * h * BOOL)
            x3 = tr.alloc(t * h * BF16)  # residual: x2 + dropout(fc2)
            tr.free(fc2)
            saved.append(mask2)
            saved_per_layer.append(saved)
            x = x3
        lnf_stats = [tr.alloc(t * FP32), tr.alloc(t * FP32)]
        lnf = tr.alloc(t * h * BF16)
        logits = tr.alloc(t * VOCAB * BF16)
        logits32 = tr.alloc(t * VOCAB * FP32)  # upcast for the loss
        lse_loss = tr.alloc(t * FP32)
        loss = tr.alloc(FP32)
        tr.free(logits32)

        # ---- backward ----
        g_logits32 = tr.alloc(t * VOCAB * FP32)
        g_logits = tr.alloc(t * VOCAB * BF16)
        tr.free(g_logits32)
        grads.append(tr.alloc(VOCAB * h * BF16))  # tied wte/lm-head gradient
        g = tr.alloc(t * h * BF16)  # d lnf
        tr.free(g_logits)
        tr.free(logits)
        tr.free(lse_loss)
        g_x = tr.alloc(t * h * BF16)  # d (last layer output)
        grads += [tr.alloc(h * BF16), tr.alloc(h * BF16)]  # final LN weight/bias
        tr.free(g)
        tr.free(lnf)
        for buf in reversed(lnf_stats):
            tr.free(buf)
        tr.free(x)  # last layer's output, saved by the final LayerNorm
        for saved in reversed(saved_per_layer):
            (x_in, m1, r1, ln1, qkv, attn, lse, mask1, x2, m2, r2, ln2, fc1, gelu, mask2) = saved
            # fc2 <- dropout: grad of gelu output, fc2 weight/bias grads
            g_gelu = tr.alloc(t * 4 * h * BF16)
            grads += [tr.alloc(4 * h * h * BF16), tr.alloc(h * BF16)]
            tr.free(mask2)
            tr.free(gelu)
            g_fc1 = tr.alloc(t * 4 * h * BF16)  # gelu backward
            tr.free(g_gelu)
            tr.free(fc1)
            g_ln2 = tr.alloc(t * h * BF16)  # fc1 backward
            grads += [tr.alloc(4 * h * h * BF16), tr.alloc(4 * h * BF16)]
            tr.free(g_fc1)
            tr.free(ln2)
            g_x2_part = tr.alloc(t * h * BF16)  # ln2 backward
            grads += [tr.alloc(h * BF16), tr.alloc(h * BF16)]
            tr.free(g_ln2)
            tr.free(r2)
            tr.free(m2)
            g_x2 = tr.alloc(t * h * BF16)  # residual: g_x + g_x2_part
            tr.free(g_x2_part)
            tr.free(g_x)
            tr.free(x2)
            g_attn = tr.alloc(t * h * BF16)  # proj backward (through dropout)
            grads += [tr.alloc(h * h * BF16), tr.alloc(h * BF16)]
            tr.free(mask1)
            dq_acc = tr.alloc(t * h * FP32)  # flash-attention backward workspace
            g_qkv = tr.alloc(t * 3 * h * BF16)
            tr.free(dq_acc)
            tr.free(g_attn)
            tr.free(lse)
            tr.free(attn)
            g_ln1 = tr.alloc(t * h * BF16)  # qkv backward
            grads += [tr.alloc(3 * h * h * BF16), tr.alloc(3 * h * BF16)]
            tr.free(g_qkv)
            tr.free(qkv)
            tr.free(ln1)
            g_x_part = tr.alloc(t * h * BF16)  # ln1 backward
            grads += [tr.alloc(h * BF16), tr.alloc(h * BF16)]
            tr.free(g_ln1)
            tr.free(r1)
            tr.free(m1)
            g_in = tr.alloc(t * h * BF16)  # residual: g_x2 + g_x_part
            tr.free(g_x_part)
            tr.free(g_x2)
            tr.free(x_in)
            g_x = g_in
        grads.append(tr.alloc(CONTEXT * h * BF16))  # wpe gradient (wte's accumulates in place)
        tr.free(g_x)
        tr.free(tokens)
        tr.free(loss)

        # ---- optimizer step, then zero_grad(set_to_none=True) ----
        for gi in grads:
            tmp = tr.alloc(tr.live[gi] * 2)  # fp32 upcast of the bf16 gradient
            tr.free(tmp)
        for gi in grads:
            tr.free(gi)
        assert len(tr.live) == persistent, "the trace leaks buffers across steps"
    return tr, lengths


def replay(trace: Trace, device: str) -> None:
    """Run the trace on `device`; everything still live at the end (or at an OOM) is freed."""
    raw_alloc, raw_free = vramkit.raw_alloc, vramkit.raw_free
    ptrs: dict[int, int] = {}
    try:
        for i, size in trace.ops:
            if size >= 0:
                ptrs[i] = raw_alloc(size, device)
            else:
                raw_free(ptrs.pop(i))
    finally:
        for ptr in ptrs.values():  # persistent state, freed at the end of the run
            raw_free(ptr)


def fits(trace: Trace, capacity: int, options: dict[str, object]) -> tuple[bool, dict[str, int]]:
    device = vramkit.sim.create(capacity)
    if options:
        vramkit.configure(device, **options)
    try:
        replay(trace, device)
        ok = True
    except vramkit.OutOfMemoryError:
        ok = False
    stats = vramkit.memory_stats(device)
    vramkit.empty_cache(device)
    return ok, {k: stats.get(k, 0) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free")}


def smallest_capacity(trace: Trace, options: dict[str, object], lo: int, hi: int) -> tuple[int, dict[str, int]]:
    """Bisect the smallest sim capacity (to 1/16 GiB) on which the whole trace runs without an
    OOM error; `lo` must fail (below peak allocated) and `hi` must fit."""
    ok, stats = fits(trace, hi, options)
    if not ok:
        raise RuntimeError("the trace does not fit the upper bound of the search")
    while hi - lo > CAPACITY_STEP:
        mid = (lo + hi) // 2 // CAPACITY_STEP * CAPACITY_STEP
        if mid <= lo:
            break
        ok, mid_stats = fits(trace, mid, options)
        if ok:
            hi, stats = mid, mid_stats
        else:
            lo = mid
    return hi, stats


def measure(trace: Trace, label: str, options: dict[str, object], target: float | None) -> Row:
    device = vramkit.sim.create(DEVICE_BYTES)
    if options:
        vramkit.configure(device, **options)
    replay(trace, device)
    stats = vramkit.memory_stats(device)
    reserved = vramkit.max_memory_reserved(device)
    allocated = vramkit.max_memory_allocated(device)
    ratio = reserved / allocated
    vramkit.empty_cache(device)
    return Row(
        benchmark=f"fragmentation: {label}", vramkit=float(reserved), vramkit_text=f"{fmt_bytes(reserved)} reserved",
        peer_name="ideal", peer=float(allocated), peer_text=f"{fmt_bytes(allocated)} allocated",
        ratio=ratio, ratio_text=f"{ratio:.3f} reserved/alloc",
        target=f"<= {target:.2f}" if target else "(report)", met=(ratio <= target) if target else None,
        detail={"device": device, "options": options, "peak_requested_bytes": trace.peak_requested,
                "num_ops": len(trace.ops), "num_alloc_retries": stats.get("num_alloc_retries"),
                "num_device_alloc": stats.get("num_device_alloc"), "num_device_free": stats.get("num_device_free"),
                "segment_peak": stats.get("segment.all.peak"),
                "inactive_split_bytes_peak": stats.get("inactive_split_bytes.all.peak")},
    )


# The configurations compared on both traces: label, VRAMKIT_ALLOC_CONF, configure() options.
CLASSIC = ("defaults", None, {})
MAX_SPLIT = (f"max_split_size_mb={MAX_SPLIT_MB}", f"max_split_size_mb:{MAX_SPLIT_MB}", {"max_split_size_mb": MAX_SPLIT_MB})
EXPANDABLE = ("expandable_segments (PyTorch's 20 MiB pages)", "expandable_segments:True", {"expandable_segments": True})
EXPANDABLE_2MB = ("expandable_segments, 2 MiB pages", "expandable_segments:True,expandable_page_mb:2",
                  {"expandable_segments": True, "expandable_page_mb": 2})
CONFIGS = (CLASSIC, MAX_SPLIT, EXPANDABLE, EXPANDABLE_2MB)
TRAINING_TARGETS = {CLASSIC[0]: TARGET, EXPANDABLE[0]: EXPANDABLE_TRAINING_TARGET,
                    EXPANDABLE_2MB[0]: EXPANDABLE_TRAINING_TARGET}


def serving_rows(quick: bool) -> list[Row]:
    from serving_trace import build_serving_trace

    from vramkit import trace as vt

    steps = 300 if quick else 3000
    trace = build_serving_trace(steps)
    rows = []
    for label, conf, _ in CONFIGS:
        big = vt.replay(trace, DEVICE_BYTES, conf, overheads=vt.NO_OVERHEADS)
        lo, hi = big.peak_allocated - 1, big.peak_reserved
        while hi - lo > (1 << 24):
            mid = (lo + hi) // 2
            if vt.replay(trace, mid, conf, overheads=vt.NO_OVERHEADS).fits:
                hi = mid
            else:
                lo = mid
        ratio = hi / big.peak_allocated
        expandable = conf is not None and "expandable" in conf
        rows.append(Row(
            benchmark=f"fragmentation: serving trace, smallest device, {label}", vramkit=float(hi),
            vramkit_text=f"{fmt_bytes(hi)} device ({big.fragmentation:.3f} reserved/alloc on 80 GiB)",
            peer_name="ideal", peer=float(big.peak_allocated), peer_text=f"{fmt_bytes(big.peak_allocated)} allocated",
            ratio=ratio, ratio_text=f"{ratio:.3f} device/alloc",
            target=f"<= {SERVING_TARGET:.2f}" if expandable else "(baseline)",
            met=(ratio <= SERVING_TARGET) if expandable else None,
            detail={"steps": steps, "events": trace.num_events, "peak_reserved_80GiB": big.peak_reserved,
                    "resolution_bytes": 1 << 24, "alloc_conf": conf},
        ))
    rows.append(replay_speed_row(trace, quick))
    return rows


def replay_speed_row(trace, quick: bool) -> Row:
    """The serving trace's events replayed in C on an 80 GiB device, classic policy against
    expandable segments, passes interleaved: ns per event (an alloc or a free)."""
    from vramkit import trace as vt

    def seconds(conf):
        return lambda: vt.replay(trace, DEVICE_BYTES, conf, overheads=vt.NO_OVERHEADS).replay_seconds

    passes = 3 if quick else 9
    times = interleaved({"classic": seconds(None), "expandable": seconds(EXPANDABLE[1])}, passes=passes, warmup=1)
    classic_ns = median(times["classic"]) * 1e9 / trace.num_events
    expandable_ns = median(times["expandable"]) * 1e9 / trace.num_events
    ratio = expandable_ns / classic_ns
    return Row(
        benchmark="cost: serving trace replayed in C, ns per event, expandable_segments vs classic",
        vramkit=expandable_ns, vramkit_text=fmt_ns(expandable_ns), peer_name="classic policy", peer=classic_ns,
        peer_text=fmt_ns(classic_ns), ratio=ratio, ratio_text=f"{ratio:.2f}x the classic cost",
        target=f"<= {COST_TARGET:.1f}x", met=ratio <= COST_TARGET,
        detail={"passes": passes, "events": trace.num_events, "classic_s": times["classic"],
                "expandable_s": times["expandable"]},
    )


def pair_cost_row(quick: bool) -> Row:
    """alloc.py's realistic size mix (512 B - 64 MiB), malloc+free pairs looped in C on two warm
    80 GiB sim devices, classic and expandable, passes interleaved."""
    from alloc import realistic_mix

    from vramkit import _C

    sizes = realistic_mix(10_000 if quick else 100_000)
    classic, expandable = vramkit.sim.create(DEVICE_BYTES), vramkit.sim.create(DEVICE_BYTES)
    vramkit.configure(expandable, **EXPANDABLE[2])
    passes = 3 if quick else 9
    times = interleaved({"classic": lambda: _C.bench_pool_pairs(classic, sizes, 1)[0],
                         "expandable": lambda: _C.bench_pool_pairs(expandable, sizes, 1)[0]}, passes=passes, warmup=2)
    c, e = median(times["classic"]), median(times["expandable"])
    return Row(
        benchmark="cost: alloc+free pair in C, realistic mix, expandable_segments vs classic", vramkit=e,
        vramkit_text=fmt_ns(e), peer_name="classic policy", peer=c, peer_text=fmt_ns(c), ratio=e / c,
        ratio_text=f"{e / c:.2f}x the classic cost", target=f"<= {COST_TARGET:.1f}x", met=e / c <= COST_TARGET,
        detail={"passes": passes, "sizes": len(sizes), "classic_ns": times["classic"],
                "expandable_ns": times["expandable"]},
    )


def numpy_rss_row(quick: bool) -> Row:
    """growing_arrays.py in two fresh child Pythons (cpu pool, handler installed): resident
    memory at the end with expandable segments against the classic policy."""
    import json
    import subprocess

    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "growing_arrays.py")
    results = {}
    for name, conf in (("classic", ""), ("expandable", EXPANDABLE[1])):
        env = dict(os.environ, VRAMKIT_ALLOC_CONF=conf, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        out = subprocess.run([sys.executable, script] + (["--quick"] if quick else []), env=env, check=True,
                             capture_output=True, text=True).stdout
        results[name] = json.loads(out.strip().splitlines()[-1])
    c, e = results["classic"], results["expandable"]
    ratio = e["rss_end"] / c["rss_end"]
    return Row(
        benchmark="cpu: NumPy arrays grown by np.concatenate, resident memory at the end, expandable vs classic",
        vramkit=float(e["rss_end"]), vramkit_text=f"{fmt_bytes(e['rss_end'])} RSS ({fmt_bytes(e['reserved_end'])} reserved)",
        peer_name="classic policy", peer=float(c["rss_end"]),
        peer_text=f"{fmt_bytes(c['rss_end'])} RSS ({fmt_bytes(c['reserved_end'])} reserved)",
        ratio=ratio, ratio_text=f"{ratio:.2f}x the classic RSS", target="(report)", met=None,
        checks={"same result": c["checksum"] == e["checksum"]},
        detail={"classic": c, "expandable": e},
    )


def run(quick: bool = False) -> list[Row]:
    steps = 12 if quick else 400
    trace, lengths = build_trace(steps)
    rows = [measure(trace, label, options, TRAINING_TARGETS.get(label)) for label, _, options in CONFIGS]
    for (label, _, options), row in zip(CONFIGS, list(rows)):
        allocated = int(row.peer)
        capacity, stats = smallest_capacity(trace, options, lo=allocated - 1, hi=DEVICE_BYTES)
        ratio = capacity / allocated
        rows.append(Row(
            benchmark=f"fragmentation: smallest device, {label} (info)", vramkit=float(capacity),
            vramkit_text=f"{fmt_bytes(capacity)} device", peer_name="ideal", peer=float(allocated),
            peer_text=f"{fmt_bytes(allocated)} allocated", ratio=ratio, ratio_text=f"{ratio:.3f} device/alloc",
            target="(info)", met=None, detail={"options": options, "resolution_bytes": CAPACITY_STEP, **stats},
        ))
    for row in rows:
        row.detail.update(steps=steps, seq_len_min=min(lengths), seq_len_max=max(lengths),
                          seq_len_median=float(np.median(lengths)))
    return rows + serving_rows(quick) + [pair_cost_row(quick), numpy_rss_row(quick)]


if __name__ == "__main__":
    main_for(run, __doc__.splitlines()[0])
