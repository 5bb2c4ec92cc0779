"""The cpu pool against the host: what it reads of the host's memory, the host_* options and
counters, pages of freed blocks given back, zeroed memory, the cache limit, and the warning a
NumPy user sees when vramkit refuses an array.

Expected host figures are read independently here from /proc and the cgroup files; page
residency comes from /proc/self/smaps_rollup (the kernel's own accounting)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

import vramkit
import vramkit.numpy as vnp
from conftest import subprocess_env

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))
from host_pressure import _own_cgroup_dir, rss_and_lazyfree  # noqa: E402  (an independent reading of /proc)

MiB = 1 << 20
HOST_STAT_KEYS = {"host_cache_limit", "host_reclaimable_bytes", "host_lazy_reused_bytes", "host_untouched_bytes",
                  "num_host_page_releases", "num_host_cache_limit_releases", "num_host_memory_rejections"}


@pytest.fixture
def cpu_defaults():
    """Restore the cpu pool's host options after a test that changes them."""
    before = vramkit.get_settings("cpu")
    yield
    vramkit.configure("cpu", host_memory_check=before["host_memory_check"], host_lazy_free=before["host_lazy_free"],
                      host_reserve_mb=before["host_reserve"] // MiB,
                      host_page_release_mb=None if before["host_page_release"] is None
                      else before["host_page_release"] // MiB,
                      host_cache_limit_mb=None if before["host_cache_limit_bytes"] is None
                      else before["host_cache_limit_bytes"] // MiB,
                      host_cache_limit_fraction=before["host_cache_limit_fraction"])
    after = vramkit.get_settings("cpu")
    assert {k: v for k, v in after.items() if k.startswith("host_")} == \
        {k: v for k, v in before.items() if k.startswith("host_")}


def meminfo() -> dict[str, int]:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            out[key] = int(rest.split()[0]) * 1024
    return out


def cgroup_limit() -> int | None:
    """The tightest memory limit from our cgroup up to the mount point, read directly."""
    for version in (1, 2):
        d = _own_cgroup_dir(version)
        if d is None:
            continue
        name = "memory.limit_in_bytes" if version == 1 else "memory.max"
        limits = []
        while True:
            try:
                with open(os.path.join(d, name)) as f:
                    text = f.read().strip()
                if text != "max" and int(text) < (1 << 62):
                    limits.append(int(text))
            except OSError:
                pass
            parent = os.path.dirname(d)
            if parent == d or not os.path.exists(os.path.join(parent, "cgroup.procs")):
                break
            d = parent
        return min(limits) if limits else None
    return None


def lazy_and_rss() -> tuple[int, int]:
    rss, lazy = rss_and_lazyfree()
    return lazy, rss


def as_array(address: int, nbytes: int) -> np.ndarray:
    return np.frombuffer((ctypes.c_char * nbytes).from_address(address), dtype=np.uint8)


def test_host_memory_info_matches_proc_and_cgroup():
    info = vramkit.host_memory_info()
    m = meminfo()
    assert info["ram_total"] == m["MemTotal"]
    assert abs(info["mem_available"] - m["MemAvailable"]) < 256 * MiB  # it moves between the two readings
    assert info["swap_free"] == pytest.approx(m["SwapFree"], abs=64 * MiB)
    limit = cgroup_limit()
    assert info["cgroup_limit"] == limit
    assert info["total"] == min(m["MemTotal"], limit or m["MemTotal"])
    assert info["available"] <= info["mem_available"] + info["swap_free"]
    if limit is not None:
        assert info["cgroup_path"].startswith("/") and info["available"] <= limit
    free, total = vramkit.mem_get_info("cpu")
    assert total == info["total"]
    assert free <= vramkit.host_memory_info()["available"] + 256 * MiB


def test_host_keys_in_stats_and_settings_of_cpu_only(sim):
    assert HOST_STAT_KEYS <= set(vramkit.memory_stats("cpu"))
    assert not HOST_STAT_KEYS & set(vramkit.memory_stats(sim))
    s = vramkit.get_settings("cpu")
    total = vramkit.mem_get_info("cpu")[1]
    assert s["host_memory_check"] is True and s["host_lazy_free"] is True
    assert s["host_reserve"] == min(total // 64 // MiB * MiB, 1 << 30)
    assert s["host_page_release"] == 64 * MiB
    assert s["host_cache_limit_fraction"] == 0.25 and s["host_cache_limit_bytes"] is None
    assert s["host_cache_limit"] == int(0.25 * total) == vramkit.memory_stats("cpu")["host_cache_limit"]
    assert "host_memory_check" not in vramkit.get_settings(sim)


def test_host_options_round_trip_and_bad_values_change_nothing(cpu_defaults, sim):
    new = vramkit.configure("cpu", host_cache_limit_mb=300, host_cache_limit_fraction=None, host_reserve_mb=5,
                            host_page_release_mb=None, host_lazy_free=False, host_memory_check=False)
    assert new["host_cache_limit"] == new["host_cache_limit_bytes"] == 300 * MiB
    assert new["host_reserve"] == 5 * MiB and new["host_page_release"] is None
    assert new["host_lazy_free"] is False and new["host_memory_check"] is False
    for bad, message in [({"host_memory_check": "maybe"}, "host_memory_check must be True or False; got 'maybe'"),
                         ({"host_cache_limit_fraction": 2}, "host_cache_limit_fraction must be a number in \\[0, 1\\]"),
                         ({"host_reserve_mb": None}, "host_reserve_mb must be a non-negative integer \\(MiB\\); got"),
                         ({"host_page_release_mb": -3}, "host_page_release_mb must be a non-negative integer")]:
        with pytest.raises(ValueError, match=message):
            vramkit.configure("cpu", host_cache_limit_mb=1, **bad)  # the good option before it is not applied
        assert vramkit.get_settings("cpu") == new
    with pytest.raises(ValueError, match="host_cache_limit_mb applies to the cpu pool \\(host memory\\) only"):
        vramkit.configure(sim, host_cache_limit_mb=10)
    vramkit.pool_check("cpu")


def test_freed_large_block_gives_its_pages_back(cpu_defaults):
    vramkit.configure("cpu", host_cache_limit_fraction=None)
    n = 64 * MiB
    p = vramkit.raw_alloc(n, "cpu")
    as_array(p, n)[:] = 7
    lazy0, rss0 = lazy_and_rss()
    before = vramkit.memory_stats("cpu")
    vramkit.raw_free(p)
    lazy1, rss1 = lazy_and_rss()
    after = vramkit.memory_stats("cpu")
    assert after["num_host_page_releases"] == before["num_host_page_releases"] + 1
    assert after["host_reclaimable_bytes"] >= before["host_reclaimable_bytes"] + n
    assert vramkit.memory_reserved("cpu") >= n  # still cached, still mapped
    # The kernel may take the pages at will now: they count as LazyFree (MADV_FREE), or have
    # left Rss already where the kernel lacks MADV_FREE.
    assert (lazy1 - lazy0) + (rss0 - rss1) >= n - 4 * MiB
    q = vramkit.raw_alloc(n, "cpu")  # reuse: the same block, and the units count as reused
    assert q == p
    view = as_array(q, n)
    view[:] = 9
    assert int(view[::4096].sum()) == 9 * (n // 4096)
    if lazy1 - lazy0 >= n - 4 * MiB:
        assert vramkit.memory_stats("cpu")["host_lazy_reused_bytes"] >= n
    vramkit.raw_free(q)
    assert vramkit.memory_stats("cpu")["host_lazy_reused_bytes"] == 0
    vramkit.pool_check("cpu")


def test_dontneed_drops_pages_at_once(cpu_defaults):
    vramkit.configure("cpu", host_lazy_free=False, host_cache_limit_fraction=None)
    n = 64 * MiB
    p = vramkit.raw_alloc(n, "cpu")
    as_array(p, n)[:] = 3
    _, rss0 = lazy_and_rss()
    vramkit.raw_free(p)
    _, rss1 = lazy_and_rss()
    assert rss0 - rss1 >= n - 4 * MiB
    q = vramkit.raw_alloc(n, "cpu")
    assert q == p and not as_array(q, n)[::4096].any()  # MADV_DONTNEED pages read back as zero
    vramkit.raw_free(q)
    vramkit.pool_check("cpu")


def test_zeros_are_zero_and_fresh_ones_cost_no_memory(cpu_defaults):
    vramkit.configure("cpu", host_cache_limit_fraction=None)
    vnp.install()
    n = 256 * MiB
    _, rss0 = lazy_and_rss()
    z = np.zeros(n // 8)  # a fresh segment: known zero, not written
    _, rss1 = lazy_and_rss()
    assert vnp.uses_vramkit(z) and rss1 - rss0 < 32 * MiB
    assert not z.any()
    z[:] = 1.5  # garbage for the next calloc to find
    del z
    z = np.zeros(n // 8)  # the cached block: zeroed by vramkit
    assert vnp.uses_vramkit(z) and not z.any()
    del z


def test_cache_limit_releases_whole_segments(cpu_defaults):
    vramkit.empty_cache("cpu")
    vramkit.configure("cpu", host_cache_limit_mb=64, host_cache_limit_fraction=None)
    before = vramkit.memory_stats("cpu")["num_host_cache_limit_releases"]
    ptrs = [vramkit.raw_alloc(48 * MiB, "cpu") for _ in range(3)]
    for p in ptrs:
        vramkit.raw_free(p)
        assert vramkit.memory_reserved("cpu") - vramkit.memory_allocated("cpu") <= 64 * MiB  # all of it whole segments
    assert vramkit.memory_stats("cpu")["num_host_cache_limit_releases"] == before + 2
    vramkit.pool_check("cpu")


def test_numpy_user_is_told_why(cpu_defaults):
    vnp.install()
    vramkit.set_memory_limit(100 * MiB, "cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(MemoryError):
            np.empty(200 * MiB // 8)
    texts = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert any(t.startswith("vramkit could not allocate this NumPy array: CPU out of memory. Tried to allocate "
                            "200.00 MiB.") and "100.00 MiB allowed" in t for t in texts), texts
    vramkit.pool_check("cpu")


# NumPy arrays in a child Python under an address-space limit (`ulimit -v`, common on shared
# clusters) of whole GiB, set after the imports (they need address space too): the host has
# memory free, mmap fails with ENOMEM all the same, and the warning must say which limit it was.
NUMPY_UNDER_ADDRESS_LIMIT = """
import resource, warnings
import numpy as np
import vramkit, vramkit.numpy as vnp
GiB, MiB = 1 << 30, 1 << 20
with open("/proc/self/statm") as f:
    limit = (int(f.read().split()[0]) * resource.getpagesize() // GiB + 3) * GiB
resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
vnp.install()
def warning_for(nbytes):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            np.empty(nbytes, dtype=np.uint8)
        except MemoryError:
            pass
        else:
            raise AssertionError(f"{nbytes} bytes fit under the limit")
    texts = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(texts) == 1, texts
    return texts[0]
kept = np.empty(GiB, dtype=np.uint8)                  # fits: the limit is not a cap on everything
print("REFUSED:", warning_for(4 * GiB))
vramkit.set_memory_limit(1536 * MiB, "cpu")          # an unrelated OOM next: the note must be gone
print("OTHER:", warning_for(GiB))
vramkit.pool_check("cpu")
print("BOUND=" + str(limit))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/statm") or vramkit.mem_get_info("cpu")[1] < 8 << 30,
                    reason="needs Linux /proc and a host of 8 GiB (the arrays must fit its capacity; they are "
                           "never touched)")
@pytest.mark.parametrize("conf", ["host_memory_check:False", "host_memory_check:False,expandable_segments:True"])
def test_numpy_user_is_told_of_the_address_space_limit(conf):
    """docs/guide/host-memory.md promises that the warning names the limit that refused; under RLIMIT_AS it
    said only how much memory was free. It names RLIMIT_AS and its value now, with the classic
    pool and with expandable segments, and a later OOM with another cause does not. (The host
    check is off so that the figures do not depend on this machine's free memory.)"""
    child = subprocess.run([sys.executable, "-c", NUMPY_UNDER_ADDRESS_LIMIT], capture_output=True, text=True,
                           env={**subprocess_env(), "VRAMKIT_ALLOC_CONF": conf}, timeout=120)
    assert child.returncode == 0, child.stdout + child.stderr
    out = child.stdout
    limit = int(out.split("BOUND=")[1])
    refused = out.split("REFUSED: ")[1].splitlines()[0]
    assert refused.startswith("vramkit could not allocate this NumPy array: CPU out of memory. Tried to allocate "
                              "4.00 GiB."), refused
    assert (f"vramkit could not map 4.00 GiB because of the address-space limit RLIMIT_AS (ulimit -v) of "
            f"{limit / (1 << 30):.2f} GiB, of which ") in refused, refused
    assert "Raise the limit (ulimit -v" in refused
    other = out.split("OTHER: ")[1].splitlines()[0]
    assert "1.50 GiB allowed" in other and "RLIMIT_AS" not in other, other
