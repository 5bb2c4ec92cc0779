"""A seeded mutation fuzzer for the files vramkit reads: ``.vktrace`` traces and snapshot pickles.

The oracle: reading a file (``vramkit.trace.load``) either succeeds or raises
``TraceFormatError``; a trace that loads then replays, renders its report and its timeline
without any other exception; and ``vramkit replay FILE`` exits 0, 2 or 3 without a traceback.
Anything else (TypeError, OverflowError, MemoryError, a crash) is a finding, and so is a file
that makes the process's peak resident memory grow by more than 512 MiB (a memory bomb that
the reader survived by luck).

Mutations, each drawn from a seeded ``random.Random``:

* ``.vktrace``: bytes flipped, set, inserted, deleted or cut anywhere; a header field replaced by
  a JSON value of another type or range (null, booleans, negative and huge integers, NaN and
  Infinity, strings, lists, objects) or deleted, with the header length fixed up; column values
  changed (ids, kinds, sizes, step and phase markers, table indexes) with the CRC fixed up, so
  the mutation reaches the column checks and the replay instead of stopping at the CRC.
* snapshots: a random node of the dict replaced by a value of another type, deleted or
  duplicated, then pickled (protocols 2 to 5); bytes of the pickle flipped, cut, or overwritten
  with a huge length, count or memo index; a class reference spliced in (which must be
  refused).

Run more cases than CI does with ``VRAMKIT_FUZZ_CASES=200000 python -m pytest
tests/stress/test_fuzz_files.py`` or ``python tests/stress/fuzz_files.py 200000``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import random
import resource
import sys
import tempfile
import zlib
from typing import Any, Callable

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "unit"))  # torch_snapshots: the snapshot builders

import vramkit  # noqa: E402
from vramkit import trace as vt  # noqa: E402
from vramkit.trace.formats.file_format import MAGIC  # noqa: E402

import torch_snapshots as ts  # noqa: E402

GiB = 1 << 30

# ---------------------------------------------------------------------------------- seeds


def seed_traces() -> list[vt.Trace]:
    """Valid traces with every feature the format has: phases, steps, streams, string tables."""
    small = vt.Trace.from_columns(
        kind=[vt.STEP, vt.PHASE, vt.ALLOC, vt.ALLOC, vt.FREE, vt.PHASE, vt.ALLOC, vt.FREE, vt.STEP, vt.ALLOC],
        id=[0, 1, 0, 1, 0, 2, 2, 1, 1, 3], size=[0, 0, 100, 3 << 20, 100, 0, 0, 3 << 20, 0, 4096],
        stream=[0, 0, 0, 7, 0, 0, 0, 7, 0, 0],
        alloc_dtype=[0, 1, -1, 0], alloc_category=[3, 0, 9, 4], alloc_module=[0, 1, -1, 0], alloc_op=[0, 0, 1, 1],
        dtypes=["float32", "bfloat16"], modules=["layers.0", "head"], ops=["aten::mm", "aten::empty"],
        meta={"source": "capture", "batch_size": 4})
    rng = np.random.default_rng(7)
    n = 200
    kinds, ids, sizes, live, nid = [], [], [], [], 0
    for step in range(2):
        kinds.append(vt.STEP); ids.append(step); sizes.append(0)
        for _ in range(n // 2):
            if live and rng.random() < 0.45:
                i = live.pop(int(rng.integers(len(live))))
                kinds.append(vt.FREE); ids.append(i); sizes.append(sizes[ids.index(i)])
            else:
                kinds.append(vt.ALLOC); ids.append(nid); sizes.append(int(rng.integers(1, 64 << 20)))
                live.append(nid)
                nid += 1
    random_trace = vt.Trace.from_columns(kind=kinds, id=ids, size=sizes, meta={"source": "random"})
    return [small, random_trace]


def seed_snapshots() -> list[dict[str, Any]]:
    """PyTorch-shaped snapshots (tests/unit/torch_snapshots.py) and one of vramkit's own."""
    A, B = 0x7F3A_0000_0000, 0x7F3A_0040_0000
    user = ts.frame("/home/u/train.py", 12, "step")
    torch_frame = ts.frame("/x/torch/nn/modules/linear.py", 125, "forward")
    snaps = [
        ts.snapshot([[ts.segment_alloc(A, 2 * ts.MiB), ts.alloc(A, 512, frames=[torch_frame, user]),
                      ts.alloc(A + 512, 1000, frames=[user]), *ts.free(A, 512), ts.oom(64 * ts.MiB, 1 << 20),
                      ts.free_requested(A + 512, 1000), ts.snapshot_entry(1024)]],
                    [ts.segment(A, [ts.block(512), ts.pending(1024, 1000), ts.block(2 * ts.MiB - 1536)]),
                     ts.segment(B, [ts.live(4 * ts.MiB, 4 * ts.MiB - 8, [user]), ts.block(16 * ts.MiB)])]),
        ts.snapshot([[ts.alloc(A, 512)], [ts.alloc(B, 3 * ts.MiB, stream=0x55D0), *ts.free(B, 3 * ts.MiB, 0x55D0)]],
                    [ts.segment(A, [ts.live(512, 512), ts.block(2 * ts.MiB - 512)]),
                     ts.segment(B, [ts.block(20 * ts.MiB)], stream=0x55D0, device=1)]),
    ]
    dev = vramkit.sim.create(1 * GiB)
    vramkit.record_memory_history(True, device=dev)
    bufs = [vramkit.raw_alloc(s, dev) for s in (100, 5 << 20, 2048)]
    vramkit.raw_free(bufs.pop(1))
    snaps.append(vramkit.memory_snapshot(dev))
    for b in bufs:
        vramkit.raw_free(b)
    vramkit.record_memory_history(False, device=dev)
    return snaps


# ---------------------------------------------------------------------------------- mutations

_INTERESTING_INTS = [0, 1, -1, 7, 8, 255, 256, 2**31 - 1, 2**31, 2**32, 2**40, 2**62, 2**63 - 1, 2**63, 2**64,
                     -(2**63), 10**400]


def random_json(rng: random.Random, depth: int = 0) -> Any:
    r = rng.randrange(12)
    if r == 0:
        return None
    if r == 1:
        return rng.random() < 0.5
    if r in (2, 3):
        return rng.choice(_INTERESTING_INTS)
    if r == 4:
        return rng.choice([float("nan"), float("inf"), -float("inf"), 1.5, -0.0, 1e300])
    if r == 5:
        return rng.choice(["", "bogus", "<u8", "|u1", "<i8", "kind", "id", "\ud800", "x" * 1000, "é"])
    if r == 6 and depth < 3:
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    if r == 7 and depth < 3:
        return {rng.choice(["name", "dtype", "length", "offset", "a"]): random_json(rng, depth + 1)
                for _ in range(rng.randrange(4))}
    return rng.randrange(-1000, 1 << 20)


def _paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path to a node in nested dicts and lists (the root is ())."""
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out += _paths(v, prefix + (i,))
    return out


def mutate_tree(obj: Any, rng: random.Random, new_value: Callable[[random.Random], Any]) -> Any:
    """A deep copy of `obj` (dicts and lists) with one node replaced, deleted or duplicated."""
    obj = _copy(obj)
    paths = [p for p in _paths(obj) if p]
    if not paths:
        return new_value(rng)
    path = rng.choice(paths)
    parent = obj
    for k in path[:-1]:
        parent = parent[k]
    key = path[-1]
    if isinstance(parent, tuple):
        return obj
    op = rng.randrange(4)
    if op == 0 and isinstance(parent, dict):
        del parent[key]
    elif op == 1 and isinstance(parent, list):
        parent.insert(key, parent[key])  # duplicate an entry
    else:
        parent[key] = new_value(rng)
    return obj


def _copy(obj: Any) -> Any:
    """Dicts and lists copied, everything else (tuples included: left unmutated) shared."""
    if isinstance(obj, dict):
        return {k: _copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_copy(v) for v in obj]
    return obj


def _split_trace(data: bytes) -> tuple[dict[str, Any], bytes]:
    hlen = int.from_bytes(data[12:16], "little")
    return json.loads(data[16:16 + hlen]), data[16 + hlen:]


def _join_trace(header: dict[str, Any], payload: bytes, fix_crc: bool = True) -> bytes:
    if fix_crc:
        header = {**header, "payload_crc32": zlib.crc32(payload)} if isinstance(header, dict) else header
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8", "surrogatepass")
    return MAGIC + (1).to_bytes(4, "little") + len(raw).to_bytes(4, "little") + raw + payload


def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randrange(1, 4)):
        op = rng.randrange(6)
        pos = rng.randrange(len(b) + 1) if b else 0
        if op == 0 and b:
            b[min(pos, len(b) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1 and b:
            b[min(pos, len(b) - 1)] = rng.choice([0, 0xFF, 0x80, ord("["), ord('"'), ord("9")])
        elif op == 2:
            b[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 9)))
        elif op == 3 and b:
            del b[pos:pos + rng.randrange(1, 9)]
        elif op == 4:
            # a length, count or memo index gone huge: 4 or 8 bytes of an interesting integer
            width = rng.choice([4, 8])
            value = rng.choice([2**31, 2**32 - 1, 2**40, 2**62, 2**64 - 1]) % (1 << (8 * width))
            b[pos:pos + width] = value.to_bytes(width, "little")
        else:
            del b[pos:]
    return bytes(b)


def mutate_trace(data: bytes, rng: random.Random) -> bytes:
    r = rng.randrange(3)
    if r == 0:
        return mutate_bytes(data, rng)
    header, payload = _split_trace(data)
    if r == 1:
        return _join_trace(mutate_tree(header, rng, random_json), payload, fix_crc=rng.random() < 0.5)
    # Change column values and fix the CRC, so that the columns' own checks are what must hold.
    payload = bytearray(payload)
    for _ in range(rng.randrange(1, 4)):
        spec = rng.choice(header["columns"])
        dtype = np.dtype(spec["dtype"])
        if not spec["length"]:
            continue
        col = np.frombuffer(payload, dtype=dtype, count=spec["length"], offset=spec["offset"]).copy()
        i = rng.randrange(len(col))
        info = np.iinfo(dtype)
        col[i] = rng.choice([info.min, info.max, 0, 1, 2, 3, 4, 5, 9, -1 if info.min < 0 else 2,
                             min(info.max, 2**40), min(info.max, 2**31), col[rng.randrange(len(col))]])
        payload[spec["offset"]:spec["offset"] + col.nbytes] = col.tobytes()
    return _join_trace(header, bytes(payload))


class _Evil:
    def __reduce__(self) -> Any:
        return (os.system, ("echo fuzz-pwned > /dev/null",))


def mutate_snapshot(snap: dict[str, Any], rng: random.Random) -> bytes:
    r = rng.randrange(10)
    protocol = rng.choice([2, 3, 4, 5])  # torch and vramkit write 4 or 5; older writers 2 or 3
    if r < 6:
        return pickle.dumps(mutate_tree(snap, rng, random_json), protocol=protocol)
    if r < 9:
        return mutate_bytes(pickle.dumps(snap, protocol=protocol), rng)
    return pickle.dumps(mutate_tree(snap, rng, lambda _: _Evil()))


# ---------------------------------------------------------------------------------- the oracle


class Finding(AssertionError):
    pass


def check_file(path: str, html: str, run_cli: bool) -> str:
    """Load, replay and render one file; returns "loaded" or "refused"; raises Finding."""
    try:
        t = vt.load(path)
    except vt.TraceFormatError:
        outcome = "refused"
    except BaseException as exc:  # noqa: BLE001 -- anything else is what the fuzzer looks for
        raise Finding(f"load raised {type(exc).__name__}: {exc}") from exc
    else:
        outcome = "loaded"
        try:
            from vramkit.trace.replaying.as_snapshot import prediction_snapshot
            from vramkit.report.timeline import write_html

            pred = vt.replay(t, "1GiB", overheads=vt.NO_OVERHEADS, curves=True)
            pred.table()
            write_html(html, prediction_snapshot(t, pred), title="fuzz")
        except BaseException as exc:  # noqa: BLE001
            raise Finding(f"a trace that loaded then failed: {type(exc).__name__}: {exc}") from exc
    if run_cli:
        from vramkit.commands.main import main

        out, err = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                status = main(["replay", path, "--device-memory", "1GiB", "--html", html, "--top", "3"])
        except BaseException as exc:  # noqa: BLE001
            raise Finding(f"vramkit replay raised {type(exc).__name__}: {exc}") from exc
        if status not in (0, 2, 3) or "Traceback" in err.getvalue():
            raise Finding(f"vramkit replay exited {status}: {err.getvalue()[-2000:]}")
        if (status == 2) != (outcome == "refused"):
            raise Finding(f"vramkit replay exited {status} for a file that was {outcome}: {err.getvalue()[-500:]}")
    return outcome


def run(cases: int, seed: int = 0, cli_every: int = 10) -> dict[str, int]:
    """Run `cases` mutated files (half traces, half snapshots); returns counts by outcome and
    raises Finding, with the seed and case number, on the first failure."""
    rng = random.Random(seed)
    traces = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, t in enumerate(seed_traces()):
            traces.append(open(t.save(os.path.join(tmp, f"seed{i}.vktrace")), "rb").read())
        snaps = seed_snapshots()
        counts = {"loaded": 0, "refused": 0}
        html = os.path.join(tmp, "out.html")
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        for case in range(cases):
            if case % 2 == 0:
                data, name = mutate_trace(rng.choice(traces), rng), "case.vktrace"
                if rng.random() < 0.2:
                    name = "case.bin"  # found by content, not by name
            else:
                data, name = mutate_snapshot(rng.choice(snaps), rng), "case.pickle"
            path = os.path.join(tmp, name)
            with open(path, "wb") as f:
                f.write(data)
            try:
                counts[check_file(path, html, run_cli=case % cli_every == 0)] += 1
                now_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                if now_kib - peak_kib > 512 * 1024:
                    raise Finding(f"peak resident memory grew by {(now_kib - peak_kib) >> 10} MiB reading one file")
            except Finding as exc:
                kept = os.path.join(tempfile.gettempdir(), f"vramkit-fuzz-seed{seed}-case{case}-{name}")
                with open(kept, "wb") as f:
                    f.write(data)
                raise Finding(f"seed {seed}, case {case} ({kept}): {exc}") from exc
    return counts


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 10_000
    s = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    print(run(n, s))
