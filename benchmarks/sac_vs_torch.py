"""sac_vs_torch — selective activation checkpointing: torch's SAC estimator + ILP against vramkit.

Usage
  PYTHONPATH=python python benchmarks/sac_vs_torch.py [--layers 6] [--d 256] [--heads 4] [--seq 256]
      [--batch 8] [--vocab 1024] [--budgets 0.7,0.5,0.35] [--repeats 5] [--threads N] [--json out.json]

What it measures
  A GPT-like model (float32, CPU, no dropout; n blocks of LayerNorm, q/k/v Linear, causal SDPA,
  out projection, LayerNorm, MLP d->4d->d with GELU, residuals; cross-entropy). A step is forward
  + loss + backward, gradients preallocated; its activation peak is measured by
  vramkit.torch.track(); "full" is that peak storing everything. At each budget (a fraction of
  full) three choices are applied to copies of the same model and measured the same way:
    torch SAC        torch.distributed._tools: MemTracker, RuntimeEstimator and SACEstimator run
                     under FakeTensorMode as PyTorch's own test runs them, aggregate_stats,
                     parse_module_info, sac_milp (ac_units = the blocks) and, per chosen block,
                     get_optimal_checkpointing_policy_per_module; then applied to the real model
                     with torch.utils.checkpoint (use_reentrant=False) and a selective policy
                     (MUST_SAVE for the ops the ILP saves, PREFER_RECOMPUTE for the rest; ops
                     matched by (name, occurrence of that name) in the block's op sequence and
                     checked against the estimator's sequence on the first real forward).
                     Equal budget: sac_milp takes a total peak in GiB; it is given torch's own
                     baseline peak (get_peak_memory_runtime_baseline) minus (full - budget), so
                     both tools are asked to remove the same number of bytes.
    vramkit sel.     vramkit.checkpoint.apply(model, budget_bytes, ..., selective=True)
    vramkit blocks   the same with selective=False (whole blocks only)
  Columns: activation peak (and /full), fits the budget, median step and recompute overhead
  (minus the no-checkpoint median, interleaved passes), each tool's own predicted recompute
  time, what was chosen. Gradients are checked against the unmodified model's.

The one change made to torch's pipeline
  No GPU here: torch's "operator-level-benchmark" mode times ops with torch.cuda.Event and
  "operator-level-cost-model" needs CUDA. CPURuntimeEstimator (a RuntimeEstimator subclass)
  replaces only the classmethod that runs an op on real tensors and times it
  (_maybe_run_and_benchmark_fallback_kernel) by a CPU version timed with time.perf_counter (2
  warm-up runs, mean of 3, as torch counts). Wiring: RuntimeEstimator.__call__ binds
  RuntimeEstimator._benchmark_estimate, so the subclass rebinds its own; the SACEstimator's
  _estimate_runtime is set to CPURuntimeEstimator._benchmark_estimate after
  sac_estimator("operator-level-benchmark"); the fake mode is RuntimeEstimator.fake_mode, which
  both estimators' __enter__ set. All else (memory tracking, trade-off curves, ILPs) is torch's.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import gc
import io
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import use_source_tree

use_source_tree()

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools import ilp_utils, sac_ilp
from torch.distributed._tools.mem_tracker import MemTracker, _ModState
from torch.distributed._tools.runtime_estimator import RuntimeEstimator
from torch.distributed._tools.sac_estimator import SACEstimator
from torch.utils import checkpoint as tuc
from torch.utils._mode_utils import no_dispatch
from torch.utils._runtime_estimation import _FLOAT_TYPES
from vramkit import checkpoint as ck
from vramkit.torch import track

MiB, GiB = 1 << 20, 1 << 30


# ----------------------------------------------------------------------------- model


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.proj = (nn.Linear(d, d) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        h = self.ln1(x)
        q, k, v = (m(h).view(b, t, self.heads, d // self.heads).transpose(1, 2) for m in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.tok, self.pos = nn.Embedding(cfg.vocab, cfg.d), nn.Embedding(cfg.seq, cfg.d)
        self.blocks = nn.ModuleList(Block(cfg.d, cfg.heads) for _ in range(cfg.layers))
        self.ln, self.head = nn.LayerNorm(cfg.d), nn.Linear(cfg.d, cfg.vocab)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def make_loss(tgt):  # a closure over the targets: the model returns logits (batch, T, vocab)
    return lambda out: F.cross_entropy(out.flatten(0, 1), tgt.flatten())


# ----------------------------------------------------------------------------- torch's pipeline, CPU timing


class CPURuntimeEstimator(RuntimeEstimator):
    """RuntimeEstimator whose "operator-level-benchmark" mode times ops on the CPU (module docstring).
    Same contract as torch's: (fake outputs, mean ms), or raise the exception given if unmappable."""

    warmup_iters, timed_iters = 2, 3  # torch's counts

    @classmethod
    def _maybe_run_and_benchmark_fallback_kernel(cls, func, args, kwargs, orig_not_implemented_exception):
        fake_mode = RuntimeEstimator.fake_mode  # set by RuntimeEstimator/SACEstimator.__enter__
        if torch.Tag.inplace_view in func.tags:  # the fake inputs' metadata would not follow
            raise orig_not_implemented_exception
        fake_of: dict[int, torch.Tensor] = {}  # id(real stand-in) -> the fake tensor it stands for
        flat, spec = pytree.tree_flatten((args, kwargs))

        def to_real(a):
            if not fake_mode.is_our_fake(a):
                return a
            r = (torch.rand_like if a.dtype in _FLOAT_TYPES else torch.ones_like)(a, device=a.fake_device)
            fake_of[id(r)] = a
            return r

        with no_dispatch():  # real computation, not the fake mode's meta kernels
            real = [to_real(a) for a in flat]
            r_args, r_kwargs = pytree.tree_unflatten(real, spec)
            for _ in range(1 + cls.warmup_iters):  # a run for the result, then the warm-up runs
                out = func(*r_args, **r_kwargs)
            start = time.perf_counter()
            for _ in range(cls.timed_iters):
                func(*r_args, **r_kwargs)
            ms = (time.perf_counter() - start) * 1e3 / cls.timed_iters
        in_storages = {a.untyped_storage()._cdata for a in real if isinstance(a, torch.Tensor) and not a.is_sparse}

        def to_fake(e):
            if not isinstance(e, torch.Tensor):
                return e
            if id(e) in fake_of:  # an input returned (in-place op): its fake original
                return fake_of[id(e)]
            if not e.is_sparse and e.untyped_storage()._cdata in in_storages:
                raise orig_not_implemented_exception  # aliases an input: no faithful fake output
            return fake_mode.fake_tensor_converter.from_real_tensor(fake_mode, e)

        return pytree.tree_map(to_fake, out), ms

    def __call__(self, estimate_mode_type):
        super().__call__(estimate_mode_type)
        if estimate_mode_type == "operator-level-benchmark":  # torch binds RuntimeEstimator's classmethod
            self._estimate = type(self)._benchmark_estimate
        return self


def torch_estimate(cfg):
    """torch's estimation pipeline under FakeTensorMode, as PyTorch's test of it runs it.
    Returns (graph, sac_estimator, ac_units, baseline peak bytes, baseline ms, seconds taken)."""
    t0 = time.perf_counter()
    with FakeTensorMode(), contextlib.redirect_stdout(io.StringIO()):  # the estimators print on exit
        model = GPT(cfg)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)
        idx = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq))
        loss_fn = make_loss(torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq)))

        def train_step(snapshot=None):
            loss_fn(model(idx)).backward()
            opt.step()
            last = snapshot.get_tracker_snapshot("current") if snapshot else None
            opt.zero_grad()
            return last

        mt = MemTracker()
        mt.track_external(model, opt)
        with mt:
            train_step()  # iteration 0
            mt.reset_mod_stats()
            last = train_step(snapshot=mt)  # iteration 1
        for mod_stats in mt.memory_tracking.values():
            if _ModState.POST_BW not in mod_stats.snapshots:
                mod_stats.snapshots.setdefault(_ModState.POST_BW, []).append(copy.deepcopy(last))

        rt = CPURuntimeEstimator()
        train_step()  # warm-up
        with rt(estimate_mode_type="operator-level-benchmark"):
            train_step()

        sac = SACEstimator()
        est = sac(estimate_mode_type="operator-level-benchmark")
        est._estimate_runtime = CPURuntimeEstimator._benchmark_estimate  # the one change, for SAC stats
        with est:
            loss = loss_fn(model(idx))
        loss.backward()
        opt.zero_grad()

        info = ilp_utils.aggregate_stats(model, mt, rt, sac, torch.device("cpu"))
    g = ilp_utils.parse_module_info(info)
    base_peak, base_ms = ilp_utils.get_peak_memory_runtime_baseline(g)
    ac_units = [f"GPT.blocks.{i}" for i in range(cfg.layers)]  # ModTracker's names for the blocks
    return g, sac, ac_units, int(base_peak), float(base_ms), time.perf_counter() - t0


def torch_choose(g, sac, ac_units, budget_gib):
    """sac_milp, then the per-module policy for every chosen block: {real name: (discard, stats,
    save flags or None for the whole block)}, predicted recompute ms, peak bound."""
    decisions, recompute_ms, peak = sac_ilp.sac_milp(g, memory_budget=budget_gib, world_size=1, ac_units=ac_units)
    if peak == -1:
        raise RuntimeError(f"sac_milp found no solution for a budget of {budget_gib:.4f} GiB")
    chosen = {}
    for fqn, r in decisions.items():
        st = sac.sac_mod_stats[fqn]
        fl = None if r >= 0.999 else sac_ilp.get_optimal_checkpointing_policy_per_module(st, memory_budget=1 - r)
        if fl is not None and len(fl) != len(st.func_names):
            raise RuntimeError(f"per-module ILP failed for {fqn} (discard {r})")
        chosen[fqn.split(".", 1)[1]] = (r, st, fl)  # "GPT.blocks.3" -> "blocks.3"
    return chosen, float(recompute_ms), int(peak)


class SACBlock:
    """A block's instance ``forward``: its own forward under torch.utils.checkpoint with a selective
    policy from torch's per-module ILP (``flags is None``: the whole block is recomputed)."""

    def __init__(self, module, name, func_names, flags):
        self.inner, self.name = type(module).forward.__get__(module), name
        self.expected, self.flags, self.save, seen = list(func_names), flags, set(), collections.Counter()
        for op, f in zip(func_names, flags or []):  # ops are (name, occurrence of that name)
            if f:
                self.save.add((op, seen[op]))
            seen[op] += 1
        self.verified, self.extra, self.first_seq = False, set(), None
        module.forward = self  # an instance attribute: nn.Module.__call__ (and its hooks) stay

    def _context(self):
        counts = {False: collections.Counter(), True: collections.Counter()}  # forward / recompute
        seq = [] if not self.verified else None

        def policy(ctx, op, *args, **kwargs):
            name, c = op._overloadpacket.__name__, counts[ctx.is_recompute]
            k, c[name] = c[name], c[name] + 1
            if seq is not None and not ctx.is_recompute:
                seq.append(name)
            return tuc.CheckpointPolicy.MUST_SAVE if (name, k) in self.save else tuc.CheckpointPolicy.PREFER_RECOMPUTE

        self.first_seq = seq
        return tuc.create_selective_checkpoint_contexts(policy)

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.inner(*args, **kwargs)
        if self.flags is None:
            return tuc.checkpoint(self.inner, *args, use_reentrant=False, **kwargs)
        out = tuc.checkpoint(self.inner, *args, use_reentrant=False, context_fn=self._context, **kwargs)
        if not self.verified:  # the forward has run: compare what SAC saw with the estimator's list
            seen, names = self.first_seq, set(self.expected)
            if [n for n in seen if n in names] != self.expected:
                raise RuntimeError(f"{self.name}: op sequence seen by the SAC policy does not match "
                                   f"SACEstimator's:\n  SAC:       {seen}\n  estimator: {self.expected}")
            self.extra = {n for n in seen if n not in names}
            self.verified = True
        return out


def short_op(name):  # "aten.addmm.default" / "addmm" -> "addmm"; the CPU flash attention -> "sdpa"
    name = str(name).split(".")[1] if str(name).startswith("aten.") else str(name)
    return "sdpa" if "scaled_dot_product" in name else name


def op_summary(names):
    c = collections.Counter(short_op(n) for n in names)
    return "+".join(f"{k}x{v}" if v > 1 else k for k, v in sorted(c.items())) or "none"


def describe_torch(chosen):  # block (fraction discarded): the ops saved; "all": whole block recomputed
    return " ".join(f"{n.replace('blocks.', 'b')}:all" if fl is None else
                    f"{n.replace('blocks.', 'b')}(-{r:.0%}):{op_summary(o for o, f in zip(st.func_names, fl) if f)}"
                    for n, (r, st, fl) in chosen.items()) or "-"


# ----------------------------------------------------------------------------- measuring


def zero_grads(model):
    for p in model.parameters():
        p.grad = torch.zeros_like(p) if p.grad is None else p.grad.zero_()


def measure(model, idx, loss_fn):
    """(activation peak of one step, gradients); gradients are preallocated, so not counted."""
    zero_grads(model)
    gc.collect()
    with track() as m:
        loss_fn(model(idx)).backward()
    return int(m.peak), [p.grad.clone() for p in model.parameters()]


def time_steps(models, idx, loss_fn, repeats):
    """Every timed forward+backward (ms) per model: passes interleaved, one warm-up pass each."""
    times = {k: [] for k in models}
    for r in range(repeats + 1):
        for k, m in models.items():
            zero_grads(m)
            t = time.perf_counter()
            loss_fn(m(idx)).backward()
            if r:
                times[k].append((time.perf_counter() - t) * 1e3)
    return times


def describe_vramkit(h):
    sel = h.selective or {}
    return " ".join(f"{n.replace('blocks.', 'b')}:{op_summary(sel[n]) if n in sel else 'all'}"
                    for n in h.checkpointed) or "-"


def run_budget(cfg, frac, base, full, ref_grads, idx, loss_fn, est):
    """Apply the three choices at one budget; measure them and the unmodified model; the rows."""
    budget = int(frac * full)
    remove = full - budget
    print(f"\nbudget {frac:.2f}: vramkit {budget / MiB:.1f} MiB of activations ({budget:,} B)", end="")
    models = {"no checkpoint": copy.deepcopy(base)}
    info = {"no checkpoint": {"pred_ms": 0.0, "chosen": "-", "blocks": []}, "torch SAC": {"error": est}}
    if not isinstance(est, str):
        g, sac, ac_units, t_base = est[:4]
        budget_gib = (t_base - remove) / GiB
        print(f"; torch sac_milp {budget_gib:.4f} GiB = its baseline {t_base / GiB:.4f} GiB - {remove / GiB:.4f} GiB",
              end="")
        try:
            chosen, pred_ms, bound = torch_choose(g, sac, ac_units, budget_gib)
            m = models["torch SAC"] = copy.deepcopy(base)
            wrappers = [SACBlock(m.get_submodule(n), n, st.func_names, fl) for n, (_, st, fl) in chosen.items()]
            info["torch SAC"] = {"pred_ms": pred_ms, "chosen": describe_torch(chosen), "blocks": list(chosen),
                                 "sac_milp_budget_gib": budget_gib, "sac_milp_peak_bound": bound,
                                 "wrappers": wrappers}
        except Exception as e:  # noqa: BLE001 - reported in the row
            info["torch SAC"] = {"error": f"{type(e).__name__}: {e}"}
    for label, sel in (("vramkit sel.", True), ("vramkit blocks", False)):
        try:
            m = copy.deepcopy(base)
            h = ck.apply(m, budget, sample_input=idx, loss_fn=loss_fn, selective=sel)
            info[label] = {"pred_ms": h.recompute_time * 1e3, "chosen": describe_vramkit(h),
                           "blocks": list(h.checkpointed), "predicted_peak": int(h.predicted_peak)}
            models[label] = m
        except Exception as e:  # noqa: BLE001
            info[label] = {"error": f"{type(e).__name__}: {e}"}
    print()
    peaks = {}
    for label, m in list(models.items()):
        try:
            peaks[label], grads = measure(m, idx, loss_fn)
            for a, b in zip(ref_grads, grads):
                torch.testing.assert_close(b, a)
        except Exception as e:  # noqa: BLE001 - e.g. the op sequences disagree, or the gradients do
            info[label] = {"error": f"{type(e).__name__}: {e}"}
            print(f"{label}: FAILED once applied: {info[label]['error']}")
            del models[label]
    times = time_steps(models, idx, loss_fn, cfg.repeats)
    base_ms = statistics.median(times["no checkpoint"])
    rows = []
    for label in ("no checkpoint", "torch SAC", "vramkit sel.", "vramkit blocks"):
        it, row = info[label], {"variant": label, "budget_fraction": frac, "budget_bytes": budget}
        if "error" in it:
            row.update(failed=it["error"])
        else:
            step = statistics.median(times[label])
            row.update(peak_bytes=peaks[label], peak_fraction=peaks[label] / full, fits=peaks[label] <= budget,
                       step_ms=step, overhead_ms=step - base_ms, overhead_pct=100 * (step - base_ms) / base_ms,
                       passes_ms=times[label], predicted_recompute_ms=it["pred_ms"], grads_equal=True,
                       **{k: v for k, v in it.items() if k not in ("pred_ms", "wrappers")})
            if "wrappers" in it:
                row["ops_not_in_estimator"] = sorted(set().union(*[w.extra for w in it["wrappers"]]))
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- main


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for flag, default in (("layers", 6), ("d", 256), ("heads", 4), ("seq", 256), ("batch", 8), ("vocab", 1024)):
        ap.add_argument(f"--{flag}", type=int, default=default)
    ap.add_argument("--budgets", default="0.7,0.5,0.35", help="fractions of the store-everything activation peak")
    ap.add_argument("--repeats", type=int, default=5, help="timed steps per variant and budget (median)")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    ap.add_argument("--json", default=None, help="write the results here")
    cfg = ap.parse_args(argv)
    torch.set_num_threads(cfg.threads or torch.get_num_threads())
    t_start = time.perf_counter()
    print(f"model: {cfg.layers} blocks, d={cfg.d}, heads={cfg.heads}, T={cfg.seq}, batch={cfg.batch}, "
          f"vocab={cfg.vocab}; float32 CPU, {torch.get_num_threads()} threads; torch {torch.__version__}; "
          f"load average {os.getloadavg()[0]:.2f} (other processes on these CPUs distort the timings)")
    torch.manual_seed(0)
    base = GPT(cfg)
    gen = torch.Generator().manual_seed(1)
    idx, tgt = (torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=gen) for _ in range(2))
    loss_fn = make_loss(tgt)
    full, ref_grads = measure(base, idx, loss_fn)
    print(f"full (store everything) activation peak: {full / MiB:.1f} MiB ({full:,} B)")
    try:
        est = torch_estimate(cfg)
        print(f"torch estimation pipeline: {est[5]:.1f} s; its baseline peak (params+grads+acts) "
              f"{est[3] / MiB:.1f} MiB, step {est[4]:.1f} ms (its CPU op timings); ops it could not time (0 ms): "
              f"{sorted(str(o) for o in RuntimeEstimator._no_fallback_kernel) or 'none'}")
    except Exception as e:  # noqa: BLE001 - reported as the torch row's failure
        est = f"torch pipeline: {type(e).__name__}: {e}"
        print(f"torch estimation pipeline FAILED: {est}")
    rows = [r for frac in cfg.budgets.split(",") if frac.strip()
            for r in run_budget(cfg, float(frac), base, full, ref_grads, idx, loss_fn, est)]
    print(f"\nfull activation peak {full / MiB:.1f} MiB; step = median of {cfg.repeats} interleaved fwd+bwd; "
          "overhead = step - no-checkpoint step; pred = each tool's own recompute estimate")
    hdr = (f"{'variant':<15}{'budget':>7}{'peak MiB':>10}{'/full':>7}{'fits':>5}{'step ms':>9}{'overh ms':>9}"
           f"{'ovh %':>7}{'pred ms':>9}  chosen")
    print(hdr + "\n" + "-" * len(hdr))
    for r in rows:
        if "failed" in r:
            print(f"{r['variant']:<15}{r['budget_fraction']:>7.2f}  FAILED: {r['failed'].splitlines()[0][:150]}")
            continue
        print(f"{r['variant']:<15}{r['budget_fraction']:>7.2f}{r['peak_bytes'] / MiB:>10.1f}{r['peak_fraction']:>7.2f}"
              f"{'yes' if r['fits'] else 'NO':>5}{r['step_ms']:>9.0f}{r['overhead_ms']:>9.1f}{r['overhead_pct']:>7.1f}"
              f"{r['predicted_recompute_ms']:>9.1f}  {r['chosen']}")
    extra = sorted({op for r in rows for op in r.get("ops_not_in_estimator", [])})
    if extra:
        print(f"ops the SAC policy saw that SACEstimator does not list (recomputed): {', '.join(extra)}")
    elapsed = time.perf_counter() - t_start
    print(f"total {elapsed:.0f} s; load average {os.getloadavg()[0]:.2f}")
    if cfg.json:
        with open(cfg.json, "w") as f:
            failed = isinstance(est, str)
            json.dump({"config": vars(cfg), "full_peak": full, "torch_baseline_peak": None if failed else est[3],
                       "torch_error": est if failed else None, "rows": rows, "seconds": elapsed}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
