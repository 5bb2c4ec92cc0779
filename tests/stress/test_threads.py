"""4 Python threads x 50,000 alloc/free pairs on one pool: the counters must be exact at the
end and the invariants intact. (tests/c/test_threads.c runs the same load without the GIL.)"""

from __future__ import annotations

import threading

import pytest

import vramkit

THREADS, PAIRS = 4, 50_000


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", "sim"])
def test_four_threads_one_pool(device):
    if device == "sim":
        device = vramkit.sim.create(4 << 30)
    before = vramkit.memory_stats(device)
    errors = []

    def work(seed):
        try:
            held = []
            for i in range(PAIRS):
                n = 1 + (seed * 7919 + i * 104729) % (3 << 20 if i % 2 else 4096)
                held.append(vramkit.raw_alloc(n, device, stream=seed % 2))
                if len(held) > 8:
                    vramkit.raw_free(held.pop(0))
            for p in held:
                vramkit.raw_free(p)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    after = vramkit.memory_stats(device)
    assert after["allocation.all.allocated"] - before["allocation.all.allocated"] == THREADS * PAIRS
    assert after["allocation.all.freed"] - before["allocation.all.freed"] == THREADS * PAIRS
    assert after["allocation.all.current"] == before["allocation.all.current"]
    assert after["allocated_bytes.all.current"] == before["allocated_bytes.all.current"]
    assert after["requested_bytes.all.current"] == before["requested_bytes.all.current"]
    vramkit.pool_check(device)
