"""Independent Python reference for the checkpoint planner (docs/checkpoint_model.md).

Not a test module: the tests import it.

Each function also takes `loss=`, the loss as one more stage (a 6-tuple); without it the
loss is free and reads `output_bytes`.

- `simulate(stages, ops, output_bytes=None)` replays a schedule under the model's rules and
  returns (time, peak); it raises ValueError naming the op index on an invalid schedule.
- `exhaustive(stages, budget, output_bytes=None)` is the least-time valid schedule with
  peak <= budget over *all* op sequences (A* / uniform-cost search over simulator states).
- `persistent_dp(stages, budget, output_bytes=None)` is a plain memoised transcription of the
  persistent dynamic program of the model document (exact bytes), with reconstruction.
- `min_budget(stages, output_bytes=None)` is the least feasible budget, from the min-peak form
  of the same DP (exact; equal to the exhaustive minimum on every chain checked).
- `recompute_all_schedule(L)` is the "store only x_0 and recompute" schedule.

A stage is a dict with keys fwd_time, bwd_time, input_bytes, saved_bytes, fwd_tmp, bwd_tmp and
optionally fwd_all_tmp (the saving forward's transient; default fwd_tmp), or a tuple in that
order. An op is (kind, i), kind in {"FN", "FC", "FA", "B"}, 0 <= i <= L (L is
the loss). Sizes may be ints or floats; times are summed in op order.
"""

from __future__ import annotations

import heapq
import itertools
from functools import lru_cache

__all__ = ["Chain", "simulate", "replay", "exhaustive", "persistent_dp", "min_budget",
           "recompute_all_schedule", "store_all_schedule", "SearchLimit"]

_FIELDS = ("fwd_time", "bwd_time", "input_bytes", "saved_bytes", "fwd_tmp", "bwd_tmp", "fwd_all_tmp")
KINDS = ("FN", "FC", "FA", "B")


class SearchLimit(RuntimeError):
    """exhaustive() gave up after max_states expansions."""


class Chain:
    """Index k = 0..L+1 as in the model: f, b, tape, ft, bt have L+1 entries (stage L is the loss:
    all zero, or the `loss` stage given), a has L+2 entries (a[L] = output bytes, a[L+1] = 0)."""

    def __init__(self, stages, output_bytes=None, loss=None):
        if isinstance(stages, Chain):
            self.__dict__.update(stages.__dict__)
            return
        rows = []
        for n, s in enumerate(stages):
            if isinstance(s, dict):
                try:
                    row = tuple(s[k] for k in _FIELDS[:6]) + (s.get("fwd_all_tmp", s["fwd_tmp"]),)
                except KeyError as e:
                    raise ValueError(f"stage {n}: missing key {e.args[0]!r}") from None
            else:
                row = tuple(s)
                if len(row) == 6:
                    row += (row[4],)
                if len(row) != 7:
                    raise ValueError(f"stage {n}: expected 6 or 7 values {_FIELDS}, got {len(row)}")
            f, b, a, s_, ft, bt, fat = row
            if min(f, b, a, s_, ft, bt, fat) < 0:
                raise ValueError(f"stage {n}: negative value in {row}")
            if s_ < a:
                raise ValueError(f"stage {n}: saved_bytes ({s_}) < input_bytes ({a})")
            rows.append(row)
        if not rows:
            raise ValueError("a chain needs at least one stage")
        L = len(rows)
        self.L = L
        self.f = [r[0] for r in rows] + [0]
        self.b = [r[1] for r in rows] + [0]
        out = rows[-1][2] if output_bytes is None else output_bytes
        loss = (0, 0, out, out, 0, 0) if loss is None else tuple(loss)
        lf, lb, la, ls, lft, lbt, lfat = loss if len(loss) == 7 else loss + (loss[4],)
        self.f[-1], self.b[-1] = lf, lb
        self.a = [r[2] for r in rows] + [la, 0]
        self.tape = [r[3] - r[2] for r in rows] + [ls - la]
        self.ft = [r[4] for r in rows] + [lft]
        self.bt = [r[5] for r in rows] + [lbt]
        self.fat = [r[6] for r in rows] + [lfat]


def _parse_op(n, op, L):
    try:
        kind, i = op
    except (TypeError, ValueError):
        raise ValueError(f"op {n}: {op!r} is not a (kind, stage) pair") from None
    if kind not in KINDS:
        raise ValueError(f"op {n}: unknown kind {kind!r} (expected one of {KINDS})")
    if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i <= L:
        raise ValueError(f"op {n}: stage index {i!r} is outside 0..{L}")
    return kind, i


def simulate(stages, ops, output_bytes=None, loss=None):
    """Replay `ops`; return (time, peak). ValueError naming the op on any broken rule."""
    time, peak, nb = replay(stages, ops, output_bytes, loss=loss)
    if nb != -1:
        raise ValueError(f"op {len(ops)}: the schedule ends without delta_0 "
                         f"(the next backward would be B({nb}))")
    return time, peak


def replay(stages, ops, output_bytes=None, with_state=False, loss=None):
    """Replay a (possibly incomplete) op sequence: (time, peak, next_backward); next_backward is
    -1 once B(0) has run. ValueError naming the op on any broken rule; one rule is the
    executor's: the loss's backward B(L) follows its forward FA(L) at once (the user computes
    the loss, then calls backward). With with_state, a fourth
    item: the state after the last op, as (present x indices, checkpoint-marked indices, taped
    indices, next_backward), tuples of indices."""
    c = Chain(stages, output_bytes, loss)
    L, a, tape = c.L, c.a, c.tape
    x = [False] * (L + 1)       # x_k present
    ck = [False] * (L + 1)      # x_k marked as a checkpoint (FC), until B(k)
    tp = [False] * (L + 1)      # tape_k present (FA(k) done, B(k) not): x_k is held for B(k)
    x[0] = True
    nb = L                      # next backward expected; delta_{nb+1} present (size a[nb+1])
    time = 0
    peak = 0
    for n, op in enumerate(ops):
        kind, i = _parse_op(n, op, L)
        if nb < 0:
            raise ValueError(f"op {n}: {kind}({i}) after B(0): the schedule is already complete")
        if tp[L] and nb == L and kind != "B":
            raise ValueError(f"op {n}: {kind}({i}) between the loss's FA({L}) and B({L})")
        # delta_{L+1} has size a[L+1] = 0
        cur = sum(a[k] for k in range(L + 1) if x[k]) + sum(tape[k] for k in range(L + 1) if tp[k]) + a[nb + 1]
        if kind == "B":
            if i != nb:
                raise ValueError(f"op {n}: B({i}) out of order: the next backward must be B({nb})")
            if not tp[i]:
                raise ValueError(f"op {n}: B({i}) needs tape_{i}, but FA({i}) has not run")
            if not x[i]:  # unreachable: tape_i holds x_i; kept as a guard
                raise ValueError(f"op {n}: B({i}) needs x_{i} present")
            peak = max(peak, cur + a[i] + c.bt[i])
            time += c.b[i]
            x[i] = ck[i] = tp[i] = False
            nb = i - 1
            continue
        if not x[i]:
            raise ValueError(f"op {n}: {kind}({i}) needs x_{i} present")
        peak = max(peak, cur + a[i + 1] + (tape[i] + c.fat[i] if kind == "FA" else c.ft[i]))
        time += c.f[i]
        if kind == "FA":
            tp[i] = True
        elif kind == "FC":
            ck[i] = True
        elif not (ck[i] or tp[i] or i == 0):
            x[i] = False        # FN consumes x_i
        if i + 1 <= nb:         # output kept only if B(i+1) has not run (x_{L+1} does not exist)
            x[i + 1] = True
    if with_state:
        state = tuple(tuple(k for k in range(L + 1) if v[k]) for v in (x, ck, tp)) + (nb,)
        return time, peak, nb, state
    return time, peak, nb


# ---------------------------------------------------------------------------------------------
# Exhaustive search over all valid op sequences.
#
# State: (xmask, ckmask, tpmask, nb). Memory of a state is determined by it; each op's "during"
# memory must be <= budget (which also bounds every state's memory). A* with the consistent
# heuristic h = sum_{i<=nb} b_i + sum_{i<=nb, no tape_i} f_i (every such stage still needs FA(i)
# and B(i)), which makes it a uniform-cost search on reduced costs: the first time the goal is
# popped its time is optimal.
# ---------------------------------------------------------------------------------------------

def exhaustive(stages, budget, output_bytes=None, max_states=5_000_000, return_stats=False, loss=None):
    """Least-time valid schedule with peak <= budget over all op sequences: (time, ops) or None.

    Raises SearchLimit after max_states expansions. With return_stats, returns
    (result, expanded_states).

    Two exact reductions keep the state space small without losing any optimum:
    - FC(i) on an x_i already held (tape_i present, or i == 0) is the same op as FN(i), so the
      checkpoint flag is only kept for x_i that are not otherwise held;
    - FA(i) with tape_i already present leads to the same state as FN(i) at the same cost and a
      higher peak, so it is skipped.
    """
    c = Chain(stages, output_bytes, loss)
    L, a, tape, f, b, ft, bt, fat = c.L, c.a, c.tape, c.f, c.b, c.ft, c.bt, c.fat
    nbits = L + 1
    size = 1 << nbits
    xsum = [0] * size
    tsum = [0] * size
    fmask = [0] * size                                   # sum of f_i over a mask
    for m in range(1, size):
        low = (m & -m).bit_length() - 1
        rest = m & (m - 1)
        xsum[m] = xsum[rest] + a[low]
        tsum[m] = tsum[rest] + tape[low]
        fmask[m] = fmask[rest] + f[low]
    bpre = list(itertools.accumulate(b[:nbits]))         # bpre[k] = sum_{i<=k} b_i
    # State packed in one int: xm | ckm << S | tpm << 2S | (nb + 1) << 3S.
    S = nbits
    M = size - 1

    def h(tp, nb):
        return bpre[nb] + fmask[((1 << (nb + 1)) - 1) & ~tp] if nb >= 0 else 0

    start = 1 | (L + 1) << (3 * S)
    dist = {start: 0}
    parent = {start: None}
    counter = itertools.count()
    heap = [(h(0, L), 0, 0, start)]
    expanded = 0
    result = None
    push = heapq.heappush
    pop = heapq.heappop
    while heap:
        _, _, g, st = pop(heap)
        if dist[st] != g:
            continue
        xm = st & M
        ckm = (st >> S) & M
        tpm = (st >> (2 * S)) & M
        nb = (st >> (3 * S)) - 1
        if nb < 0:
            ops = []
            while parent[st] is not None:
                st, op = parent[st]
                ops.append(op)
            ops.reverse()
            result = (g, ops)
            break
        expanded += 1
        if expanded > max_states:
            raise SearchLimit(f"exhaustive search stopped after {max_states} states (L={L}, budget={budget})")
        cur = xsum[xm] + tsum[tpm] + a[nb + 1]
        succ = []
        # Backward B(nb).
        bit = 1 << nb
        if (tpm & bit) and (xm & bit) and cur + a[nb] + bt[nb] <= budget:
            succ.append((xm & ~bit, ckm & ~bit, tpm & ~bit, nb - 1, b[nb], ("B", nb)))
        # Forwards on every present x_i (present implies i <= nb); none between the loss's FA(L)
        # and B(L).
        m = 0 if (nb == L and tpm >> L & 1) else xm
        while m:
            bit = m & -m
            m ^= bit
            i = bit.bit_length() - 1
            base = cur + a[i + 1]
            outbit = (bit << 1) if i + 1 <= nb else 0
            if base + ft[i] <= budget:
                held = (ckm & bit) or (tpm & bit) or i == 0
                nx = (xm if held else xm & ~bit) | outbit
                succ.append((nx, ckm, tpm, nb, f[i], ("FN", i)))
                if not held:
                    succ.append((xm | outbit, ckm | bit, tpm, nb, f[i], ("FC", i)))
            if not (tpm & bit) and base + tape[i] + fat[i] <= budget:
                succ.append((xm | outbit, ckm & ~bit, tpm | bit, nb, f[i], ("FA", i)))
        for nx, nck, ntp, nnb, cost, op in succ:
            nst = nx | nck << S | ntp << (2 * S) | (nnb + 1) << (3 * S)
            ng = g + cost
            old = dist.get(nst)
            if old is None or ng < old:
                dist[nst] = ng
                parent[nst] = (st, op)
                push(heap, (ng + h(ntp, nnb), next(counter), ng, nst))
    if return_stats:
        return result, expanded
    return result


# ---------------------------------------------------------------------------------------------
# The persistent DP, transcribed from docs/checkpoint_model.md.
# ---------------------------------------------------------------------------------------------

INF = float("inf")


def _make_opt(c):
    L, a, tape, f, b, ft, bt, fat = c.L, c.a, c.tape, c.f, c.b, c.ft, c.bt, c.fat
    fsum = [0] + list(itertools.accumulate(f))          # fsum[k] = sum_{i<k} f_i

    @lru_cache(maxsize=None)
    def opt(i, l, m):
        """Opt(i, l, m) of the document as (time, choice); (INF, None) when infeasible."""
        if i == l:
            if m >= max(2 * a[i + 1] + tape[i] + fat[i], a[i + 1] + tape[i] + a[i] + bt[i]):
                return f[i] + b[i], ("base",)
            return INF, None
        best, what = INF, None
        # (a) FC(i), FN(i+1..j-1), schedule of [j..l], schedule of [i..j-1]
        if m >= a[l + 1] + a[i + 1] + ft[i]:
            for j in range(i + 1, l + 1):
                # forward-phase condition for k = j-1 (those for smaller k were checked before)
                if j - 1 > i and m < a[l + 1] + a[j - 1] + a[j] + ft[j - 1]:
                    break
                if m >= a[j]:
                    t1 = opt(j, l, m - a[j])[0]
                    if t1 < INF:
                        t = fsum[j] - fsum[i] + t1 + opt(i, j - 1, m)[0]
                        if t < best:
                            best, what = t, ("a", j)
        # (b) FA(i), schedule of [i+1..l], B(i)
        if m >= a[l + 1] + a[i + 1] + tape[i] + fat[i] and m >= a[i + 1] + tape[i] + a[i] + bt[i]:
            t = f[i] + opt(i + 1, l, m - tape[i] - a[i + 1])[0] + b[i]
            if t < best:
                best, what = t, ("b",)
        return best, what

    def rec(i, l, m, out):
        what = opt(i, l, m)[1]
        if what[0] == "base":
            out += [("FA", i), ("B", i)]
        elif what[0] == "a":
            j = what[1]
            out.append(("FC", i))
            out += [("FN", k) for k in range(i + 1, j)]
            rec(j, l, m - a[j], out)
            rec(i, j - 1, m, out)
        else:
            out.append(("FA", i))
            rec(i + 1, l, m - tape[i] - a[i + 1], out)
            out.append(("B", i))

    return opt, rec


def persistent_dp(stages, budget, output_bytes=None, loss=None):
    """The document's persistent DP at top level Opt(0, L, budget - a_0): (time, ops) or None."""
    c = Chain(stages, output_bytes, loss)
    opt, rec = _make_opt(c)
    m = budget - c.a[0]
    t, what = opt(0, c.L, m)
    if what is None:
        return None
    ops = []
    rec(0, c.L, m, ops)
    return t, ops


def min_budget(stages, output_bytes=None, loss=None):
    """Least budget for which persistent_dp is feasible, by the min-peak form of the same DP:

    P(i, i) = max(2 a_{i+1} + tape_i + fat_i, a_{i+1} + tape_i + a_i + bt_i)
    P(i, l) = min( min_{j=i+1..l} max(a_{l+1} + a_{i+1} + ft_i,
                                      max_{i<k<j} (a_{l+1} + a_k + a_{k+1} + ft_k),
                                      a_j + P(j, l), P(i, j-1)),
                   max(a_{l+1} + a_{i+1} + tape_i + fat_i, a_{i+1} + tape_i + a_i + bt_i,
                       tape_i + a_{i+1} + P(i+1, l)) )
    result: a_0 + P(0, L). (Opt(i, l, m) is finite exactly when m >= P(i, l).)
    """
    c = Chain(stages, output_bytes, loss)
    L, a, tape, ft, bt, fat = c.L, c.a, c.tape, c.ft, c.bt, c.fat

    @lru_cache(maxsize=None)
    def P(i, l):
        if i == l:
            return max(2 * a[i + 1] + tape[i] + fat[i], a[i + 1] + tape[i] + a[i] + bt[i])
        fwd = a[l + 1] + a[i + 1] + ft[i]
        best = INF
        for j in range(i + 1, l + 1):
            if j - 1 > i:
                fwd = max(fwd, a[l + 1] + a[j - 1] + a[j] + ft[j - 1])
            best = min(best, max(fwd, a[j] + P(j, l), P(i, j - 1)))
        chain = max(a[l + 1] + a[i + 1] + tape[i] + fat[i], a[i + 1] + tape[i] + a[i] + bt[i],
                    tape[i] + a[i + 1] + P(i + 1, l))
        return min(best, chain)

    return a[0] + P(0, L)


# ---------------------------------------------------------------------------------------------
# Fixed schedules.
# ---------------------------------------------------------------------------------------------

def recompute_all_schedule(L):
    """Store only x_0: for i = L..0, FC(0) (if i > 0), FN(1..i-1), FA(i), B(i)."""
    ops = []
    for i in range(L, -1, -1):
        if i > 0:
            ops.append(("FC", 0))
            ops += [("FN", k) for k in range(1, i)]
        ops += [("FA", i), ("B", i)]
    return ops


def store_all_schedule(L):
    """FA(0..L), B(L..0)."""
    return [("FA", i) for i in range(L + 1)] + [("B", i) for i in range(L, -1, -1)]
