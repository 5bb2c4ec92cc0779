"""Write a large snapshot pickle fast, laid out as PyTorch's ``_dump_snapshot`` lays one out.

``pickle.dump`` of a 1 GB snapshot needs the 10+ million entry dicts in memory first (tens of
GB); this writes the same opcodes straight from NumPy columns: protocol 4, the entry keys and
action names memoized once and read back with BINGET, a few thousand frames lists memoized once
and shared by the entries of their context (as torch's pickled snapshots share them), entries
appended to the device's list in batches of 1,000 (APPENDS), as Python's pickler batches them.

The workload is a training loop: each step allocates a run of tensors (activations and
temporaries of random sizes), then frees them newest first, each with ``free_requested`` then
``free_completed``; a set of parameters stays live throughout; one ``oom`` entry sits at the
step with the highest peak.

    python benchmarks/view_data.py OUT.pickle --entries 16000000
"""

from __future__ import annotations

import argparse
import os
import struct

import numpy as np

KEYS = ("action", "addr", "size", "stream", "time_us", "frames", "compile_context", "user_metadata")
VALUES = ("alloc", "free_requested", "free_completed", "N/A", "")
FRAME_KEYS = ("filename", "line", "name")
PER_STEP = 48  # tensors a step allocates
PARAMS = 200


def _str(s: str) -> bytes:
    b = s.encode()
    return (b"\x8c" + bytes([len(b)]) + b) if len(b) < 256 else (b"X" + struct.pack("<I", len(b)) + b)


def _get(i: int) -> bytes:
    return b"h" + bytes([i]) if i < 256 else b"j" + struct.pack("<I", i)


def _frames_table(n_stacks: int, seed: int) -> tuple[bytes, int]:
    """A list of `n_stacks` memoized frames lists (memo indices from `first`), and `first`."""
    rng = np.random.default_rng(seed)
    out = bytearray(b"]" + b"(")
    memo = len(KEYS) + len(VALUES) + len(FRAME_KEYS)
    first = memo
    files = ["/home/user/train.py", "/home/user/model/layers.py", "/home/user/model/attention.py",
             "/opt/conda/lib/python3.11/site-packages/torch/nn/modules/module.py",
             "/opt/conda/lib/python3.11/site-packages/torch/nn/functional.py", "/home/user/data/loader.py"]
    names = ["forward", "backward", "step", "__call__", "linear", "softmax", "collate", "_call_impl"]
    for s in range(n_stacks):
        out += b"]" + b"("
        for depth in range(int(rng.integers(2, 7))):
            f = files[int(rng.integers(len(files)))]
            out += b"}" + b"(" + _get(len(KEYS) + len(VALUES)) + _str(f) + _get(len(KEYS) + len(VALUES) + 1)
            out += b"J" + struct.pack("<i", int(rng.integers(1, 2000))) + _get(len(KEYS) + len(VALUES) + 2)
            out += _str(names[int(rng.integers(len(names)))] + ("" if depth else f"_{s}")) + b"u"
        out += b"e" + b"\x94"
        memo += 1
    out += b"e"
    return bytes(out), first


def _columns(entries: int, seed: int) -> dict[str, np.ndarray]:
    """Per entry: action (0 alloc, 1 free_requested, 2 free_completed), addr, size, time, stack."""
    rng = np.random.default_rng(seed)
    steps = max(1, (entries - PARAMS) // (3 * PER_STEP))
    sizes = (rng.lognormal(13, 2.0, size=(steps, PER_STEP)).astype(np.int64) // 512 + 1) * 512
    sizes = np.minimum(sizes, 1 << 30)
    slot_addr = 0x7F00_0000_0000 + (np.arange(PER_STEP, dtype=np.int64) << 31)
    # one step: PER_STEP allocs, then frees newest first (free_requested, free_completed)
    order = np.arange(PER_STEP - 1, -1, -1)
    act = np.concatenate([np.zeros(PER_STEP, np.uint8), np.tile(np.array([1, 2], np.uint8), PER_STEP)])
    slot = np.concatenate([np.arange(PER_STEP), np.repeat(order, 2)])
    action = np.tile(act, steps)
    addr = np.tile(slot_addr[slot], steps)
    size = sizes[np.repeat(np.arange(steps), 3 * PER_STEP), np.tile(slot, steps)]
    stack = rng.integers(0, 4000, size=(steps, PER_STEP))[np.repeat(np.arange(steps), 3 * PER_STEP),
                                                           np.tile(slot, steps)]
    p_addr = 0x7E00_0000_0000 + (np.arange(PARAMS, dtype=np.int64) << 24)
    p_size = (rng.lognormal(16, 1.5, size=PARAMS).astype(np.int64) // 512 + 1) * 512
    action = np.concatenate([np.zeros(PARAMS, np.uint8), action])
    addr = np.concatenate([p_addr, addr])
    size = np.concatenate([p_size, size])
    stack = np.concatenate([rng.integers(0, 4000, PARAMS), stack])
    time = 1_700_000_000_000_000 + np.cumsum(rng.integers(1, 50, len(action)))
    return {"action": action, "addr": addr, "size": size, "time": time, "stack": stack}


def write_snapshot(path: str, entries: int, seed: int = 0) -> dict[str, int]:
    """Write the pickle; returns figures about it (entries, memory events, bytes)."""
    cols = _columns(entries, seed)
    n = len(cols["action"])
    table, first_stack = _frames_table(4000, seed)
    head = bytearray(b"\x80\x04" + b"}" + b"(")
    head += _str("vk_bench_memo") + b"]" + b"("
    for s in KEYS + VALUES + FRAME_KEYS:
        head += _str(s) + b"\x94"
    head += table + b"e"
    head += _str("segments") + b"]"
    head += _str("device_traces") + b"]" + b"]"  # the outer list, then device 0's list
    # one entry, fixed width: } ( key action | key addr LONG1(8) | key size LONG1(8) | key stream K 0 |
    # key time LONG1(8) | key frames LONG_BINGET | key compile_context BINGET | key user_metadata BINGET ) u
    rec = np.zeros((n, 62), np.uint8)
    k = {name: i for i, name in enumerate(KEYS)}
    v = {name: len(KEYS) + i for i, name in enumerate(VALUES)}
    pos = 0

    def put(b: bytes) -> int:
        nonlocal pos
        rec[:, pos:pos + len(b)] = np.frombuffer(b, np.uint8)
        pos += len(b)
        return pos - len(b)

    put(b"}(" + _get(k["action"]))
    at_action = put(b"h\x00")
    put(_get(k["addr"]) + b"\x8a\x08")
    at_addr = put(bytes(8))
    put(_get(k["size"]) + b"\x8a\x08")
    at_size = put(bytes(8))
    put(_get(k["stream"]) + b"K\x00" + _get(k["time_us"]) + b"\x8a\x08")
    at_time = put(bytes(8))
    put(_get(k["frames"]) + b"j")
    at_stack = put(bytes(4))
    put(_get(k["compile_context"]) + _get(v["N/A"]) + _get(k["user_metadata"]) + _get(v[""]) + b"u")
    assert pos == rec.shape[1], pos
    rec[:, at_action + 1] = np.array([v["alloc"], v["free_requested"], v["free_completed"]], np.uint8)[cols["action"]]
    rec[:, at_addr:at_addr + 8] = cols["addr"].astype("<u8").view(np.uint8).reshape(n, 8)
    rec[:, at_size:at_size + 8] = cols["size"].astype("<u8").view(np.uint8).reshape(n, 8)
    rec[:, at_time:at_time + 8] = cols["time"].astype("<u8").view(np.uint8).reshape(n, 8)
    rec[:, at_stack:at_stack + 4] = (cols["stack"] + first_stack).astype("<u4").view(np.uint8).reshape(n, 4)
    with open(path, "wb") as f:
        f.write(bytes(head))
        for b in range(0, n, 1000):
            f.write(b"(")
            f.write(rec[b:b + 1000].tobytes())
            f.write(b"e")
        f.write(b"a" + b"u" + b".")  # device 0's list into device_traces; the root's items; STOP
    return {"entries": n, "memory_events": int((cols["action"] != 1).sum()), "bytes": os.path.getsize(path)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--entries", type=int, default=16_000_000)
    ap.add_argument("--seed", type=int, default=0)
    ns = ap.parse_args()
    print(write_snapshot(ns.out, ns.entries, ns.seed))


if __name__ == "__main__":
    main()
