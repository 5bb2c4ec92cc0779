"""The NEP 49 handler: NumPy memory tracked exactly by the cpu pool, zeroing and resizing
done right, arrays that outlive uninstall(), and a clean interpreter exit."""

from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np
import pytest

import vramkit
import vramkit.numpy as vnp
from conftest import subprocess_env


def rounded(n: int) -> int:
    return max(512, (n + 511) // 512 * 512)


def test_empty_raises_allocated_by_its_size_and_del_lowers_it():
    vnp.install()
    assert vnp.is_installed()
    before = vramkit.memory_allocated("cpu")
    a = np.empty(10_000_000)
    grew = vramkit.memory_allocated("cpu") - before
    assert grew >= 80_000_000 and grew == rounded(80_000_000)
    assert vnp.uses_vramkit(a) and vnp.uses_vramkit(a[::2])  # views trace back to the owner
    del a
    assert vramkit.memory_allocated("cpu") == before
    vnp.uninstall()
    assert not vnp.is_installed()
    b = np.empty(1000)
    assert not vnp.uses_vramkit(b)


def test_arrays_outlive_uninstall_and_still_return_to_the_pool():
    vnp.install()
    before = vramkit.memory_allocated("cpu")
    arrays = [np.full(100_000 + i, i, dtype=np.int32) for i in range(5)]
    vnp.uninstall()
    other = np.ones(1000)  # made after uninstall: NumPy's own memory
    assert not vnp.uses_vramkit(other)
    assert vramkit.memory_allocated("cpu") == before + sum(rounded(a.nbytes) for a in arrays)
    assert all(int(a[-1]) == i for i, a in enumerate(arrays))
    del arrays
    assert vramkit.memory_allocated("cpu") == before
    vramkit.pool_check("cpu")


def test_zeros_are_zero_even_in_reused_dirty_blocks():
    with vnp.caching():
        dirty = np.empty(1 << 20, dtype=np.uint8)
        dirty.fill(0xAB)
        address = dirty.__array_interface__["data"][0]
        del dirty
        z = np.zeros(1 << 20, dtype=np.uint8)
        assert z.__array_interface__["data"][0] == address  # the same cached block came back
        assert not z.any()
    assert not vnp.is_installed()


def test_resize_goes_through_realloc():
    with vnp.caching():
        a = np.arange(1000, dtype=np.int64)
        before = vramkit.memory_allocated("cpu")
        a.resize(5000, refcheck=False)
        np.testing.assert_array_equal(a[:1000], np.arange(1000))
        assert vramkit.memory_allocated("cpu") - before == rounded(5000 * 8) - rounded(1000 * 8)
        assert vnp.uses_vramkit(a)


def test_results_match_numpy_without_the_handler():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((300, 200))
    w = rng.standard_normal((200, 50))
    expected = np.tanh(x @ w).sum(axis=0) + np.sort(x, axis=1)[:, :50].mean(axis=0)
    with vnp.caching():
        got = np.tanh(x @ w).sum(axis=0) + np.sort(x, axis=1)[:, :50].mean(axis=0)
        assert vnp.uses_vramkit(got)
    np.testing.assert_array_equal(got, expected)


def test_history_names_the_allocating_numpy_caller():
    vramkit.record_memory_history(True, device="cpu")

    def load_batch():
        return np.empty(3_000_000)

    with vnp.caching():
        batch = load_batch()
    trace = vramkit.memory_snapshot("cpu")["device_traces"][0]
    entry = next(e for e in trace if e["action"] == "alloc" and e["size"] == rounded(24_000_000))
    assert entry["frames"][0]["name"] == "load_batch"
    del batch


def test_handler_is_per_thread_context():
    seen = {}
    vnp.install()

    def worker():
        seen["installed"] = vnp.is_installed()

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen["installed"] is False  # a thread starts with NumPy's default handler
    vnp.uninstall()


def test_threads_using_the_handler_keep_counters_exact():
    before = vramkit.memory_allocated("cpu")

    def churn():
        with vnp.caching():
            for i in range(2000):
                a = np.empty(1000 + i % 700)
                a[0] = 1
                del a

    threads = [threading.Thread(target=churn) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert vramkit.memory_allocated("cpu") == before
    vramkit.pool_check("cpu")


@pytest.mark.parametrize("uninstall_first", [False, True])
def test_interpreter_exit_with_live_arrays_is_clean(uninstall_first):
    code = (
        "import numpy as np, vramkit, vramkit.numpy as vnp\n"
        "vnp.install()\n"
        "keep = [np.ones(n) for n in (10, 100_000, 3_000_000)]\n"
        "class Holder:\n"
        "    def __del__(self):\n"
        "        self.a[1] = self.a[0] + 1.0\n"  # touches pool memory during teardown
        "h = Holder(); h.a = np.arange(50_000.0)\n"
        + ("vnp.uninstall()\n" if uninstall_first else "")
        + "print('allocated', vramkit.memory_allocated('cpu'))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(),
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("allocated ") and int(result.stdout.split()[1]) > 24_000_000
    assert result.stderr == ""
