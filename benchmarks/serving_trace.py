"""A serving-style allocation trace: requests arrive and finish at random, and each request's
KV cache grows by being reallocated larger every 16-64 tokens (allocate the larger buffer,
copy, free the old one), with several hundred requests in flight.

This is the workload on which PyTorch's classic caching-allocator policy fragments worst: every
cache size is different and keeps changing, so freed blocks rarely fit the next request. It is
the serving trace of issue 10 (expandable segments); fragmentation.py replays it.

The model (seed 4321): a decoder with a KV cache of 64 KiB per token (e.g. 16 layers x 2 (K, V)
x 8 KV heads x 128 x fp16); prompts of 64-2048 tokens (log-normal, median 400), outputs of
16-1024 tokens (log-normal, median 200); arrivals Poisson, on average one request every
`arrival_every` decoding steps, at most `max_requests` in flight (later arrivals wait). Each
step decodes one token for every request in flight and allocates that step's activations
(proportional to the batch), freed at the end of the step. A request's cache starts at its
prompt rounded up to a multiple of its chunk (16-64 tokens, drawn per request) and is
reallocated one chunk larger whenever it is full. When it finishes, its cache is freed.
"""

from __future__ import annotations

import math

import numpy as np

KV_BYTES_PER_TOKEN = 64 << 10
ACTIVATION_BYTES_PER_REQUEST = 96 << 10  # per decoding step: hidden states, logits slices, ...


def build_serving_trace(steps: int = 3000, *, seed: int = 4321, arrival_every: float = 0.8,
                        max_requests: int = 400):
    """The trace as a ``vramkit.trace.Trace`` (kind, id, size columns; ALLOC/FREE only)."""
    from vramkit import trace as vt

    rng = np.random.default_rng(seed)
    kind: list[int] = []
    ids: list[int] = []
    size: list[int] = []
    next_id = 0

    def alloc(nbytes: int) -> int:
        nonlocal next_id
        kind.append(vt.ALLOC)
        ids.append(next_id)
        size.append(nbytes)
        next_id += 1
        return next_id - 1

    def free(i: int, nbytes: int) -> None:
        kind.append(vt.FREE)
        ids.append(i)
        size.append(nbytes)

    active: list[dict] = []
    waiting = 0
    for _ in range(steps):
        waiting += rng.poisson(1.0 / arrival_every)
        while waiting and len(active) < max_requests:
            waiting -= 1
            prompt = int(np.clip(rng.lognormal(math.log(400), 0.8), 64, 2048))
            out = int(np.clip(rng.lognormal(math.log(200), 0.9), 16, 1024))
            chunk = int(rng.integers(16, 65))
            cap = -(-prompt // chunk) * chunk
            buf = alloc(cap * KV_BYTES_PER_TOKEN)
            active.append({"tokens": prompt, "end": prompt + out, "chunk": chunk, "cap": cap, "buf": buf})
        if active:
            act = alloc(len(active) * ACTIVATION_BYTES_PER_REQUEST)
        done = []
        for r in active:
            r["tokens"] += 1
            if r["tokens"] > r["cap"]:  # full: reallocate one chunk larger (alloc, copy, free)
                new_cap = r["cap"] + r["chunk"]
                new = alloc(new_cap * KV_BYTES_PER_TOKEN)
                free(r["buf"], r["cap"] * KV_BYTES_PER_TOKEN)
                r["buf"], r["cap"] = new, new_cap
            if r["tokens"] >= r["end"]:
                done.append(r)
        if active:
            free(act, len(active) * ACTIVATION_BYTES_PER_REQUEST)
        for r in done:
            free(r["buf"], r["cap"] * KV_BYTES_PER_TOKEN)
            active.remove(r)
    return vt.Trace.from_columns(kind=kind, id=ids, size=size, meta={"source": "serving_trace.py", "seed": seed,
                                                                     "steps": steps})
