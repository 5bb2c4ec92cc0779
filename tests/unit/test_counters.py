"""Counters with torch.cuda's names: memory_stats keys, the getters, resets and the summary.

Expected values come from PyTorch's documented policy (512 B rounding, 2 MiB small segments,
20 MiB large segments below 10 MiB) and, for the summary text, from torch's own formatter."""

from __future__ import annotations

import itertools

import pytest

import vramkit

MiB = 1 << 20

# torch.cuda.memory_stats' 108 core keys, written out rather than generated from vramkit.
CORE_ARRAYS = ["allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes",
               "active_bytes", "inactive_split_bytes", "requested_bytes"]
EXPECTED_CORE_KEYS = {f"{a}.{p}.{m}" for a, p, m in itertools.product(
    CORE_ARRAYS, ["all", "small_pool", "large_pool"], ["current", "peak", "allocated", "freed"])}
EXPECTED_EXTRA_KEYS = {"num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc", "num_device_free",
                       "max_split_size"} | {f"oversize_{k}.{m}" for k in ("allocations", "segments")
                                            for m in ("current", "peak", "allocated", "freed")}


def test_memory_stats_keys_match_pytorch(sim):
    stats = vramkit.memory_stats(sim)
    assert len(EXPECTED_CORE_KEYS) == 108
    core = {k for k in stats if k.split(".")[0] in CORE_ARRAYS}
    assert core == EXPECTED_CORE_KEYS
    assert set(stats) == EXPECTED_CORE_KEYS | EXPECTED_EXTRA_KEYS
    assert list(stats) == sorted(stats)  # torch returns an OrderedDict sorted by key
    assert all(v == 0 for k, v in stats.items() if k != "max_split_size")
    assert stats["max_split_size"] == -1  # unlimited, as torch reports it


def test_getters_follow_allocations(sim):
    a = vramkit.raw_alloc(1000, sim)            # 1024 B block in a 2 MiB small segment
    b = vramkit.raw_alloc(3 * MiB, sim)         # 3 MiB block in a 20 MiB large segment
    assert vramkit.memory_allocated(sim) == 1024 + 3 * MiB
    assert vramkit.memory_reserved(sim) == 2 * MiB + 20 * MiB
    stats = vramkit.memory_stats(sim)
    assert stats["requested_bytes.all.current"] == 1000 + 3 * MiB
    assert stats["allocation.small_pool.current"] == 1 and stats["allocation.large_pool.current"] == 1
    assert stats["segment.all.current"] == 2 and stats["num_device_alloc"] == 2
    vramkit.raw_free(b)
    assert vramkit.memory_allocated(sim) == 1024
    assert vramkit.max_memory_allocated(sim) == 1024 + 3 * MiB
    assert vramkit.memory_reserved(sim) == 22 * MiB  # freed memory stays cached
    vramkit.reset_peak_memory_stats(sim)
    assert vramkit.max_memory_allocated(sim) == 1024
    assert vramkit.max_memory_reserved(sim) == 22 * MiB
    assert vramkit.empty_cache(sim) == 20 * MiB  # the large segment is wholly free; the small one is not
    assert vramkit.memory_reserved(sim) == 2 * MiB
    stats = vramkit.memory_stats(sim)
    assert stats["allocated_bytes.all.allocated"] == 1024 + 3 * MiB
    assert stats["allocated_bytes.all.freed"] == 3 * MiB
    assert stats["num_device_free"] == 1
    vramkit.reset_accumulated_memory_stats(sim)
    stats = vramkit.memory_stats(sim)
    assert stats["allocated_bytes.all.allocated"] == 0 and stats["allocated_bytes.all.freed"] == 0
    assert stats["num_device_alloc"] == 0 and stats["allocated_bytes.all.current"] == 1024
    vramkit.raw_free(a)
    vramkit.pool_check(sim)


def test_default_device_and_device_arguments(sim):
    assert vramkit.current_device() in ("cpu", "cuda:0")
    vramkit.set_device(sim)
    assert vramkit.current_device() == sim
    p = vramkit.raw_alloc(4096)  # goes to the default device
    assert vramkit.memory_allocated() == 4096 == vramkit.memory_allocated(sim)
    vramkit.raw_free(p)
    with pytest.raises(ValueError, match="unknown device 'gpu:0'"):
        vramkit.set_device("gpu:0")
    assert vramkit.current_device() == sim  # unchanged by the bad call
    with pytest.raises(TypeError, match="device must be a string"):
        vramkit.memory_allocated(1.5)
    with pytest.raises(ValueError, match="does not exist"):
        vramkit.memory_allocated("sim:100000")


def test_device_availability():
    assert vramkit.is_available("cpu") and vramkit.is_available("sim")
    assert vramkit.device_count("cpu") == 1
    assert vramkit.is_available("cuda") == (vramkit.device_count("cuda") > 0)
    if not vramkit.is_available("cuda"):
        assert not vramkit.is_available("cuda:0")
        with pytest.raises(vramkit.VramkitError, match="cuda:0 is not available"):
            vramkit.memory_allocated("cuda:0")
    before = vramkit.device_count("sim")
    name = vramkit.sim.create(1 << 20)
    assert name == f"sim:{before}" and vramkit.device_count("sim") == before + 1
    assert vramkit.is_available(name) and not vramkit.is_available("sim:999999")
    with pytest.raises(ValueError, match="unknown device kind"):
        vramkit.device_count("tpu")
    with pytest.raises(ValueError, match="at least 1 byte"):
        vramkit.sim.create(0)
    with pytest.raises(ValueError, match="2\\*\\*62"):
        vramkit.sim.create(1 << 62)
    with pytest.raises(TypeError):
        vramkit.sim.create(1.0)


def _torch_summary(stats: dict, abbreviated: bool) -> str:
    """torch's memory_summary, with its stats source replaced by vramkit's figures."""
    torch = pytest.importorskip("torch")
    import torch.cuda.memory as tcm

    original_stats, original_index = tcm.memory_stats, tcm._get_device_index
    tcm.memory_stats = lambda device=None: stats
    tcm._get_device_index = lambda device, optional=False: 0
    try:
        return tcm.memory_summary(device=0, abbreviated=abbreviated)
    finally:
        tcm.memory_stats, tcm._get_device_index = original_stats, original_index


# PyTorch's CUDA words and what a simulated or host device's table says in their place,
# written out by hand: header line (0 OOMs, 0 retries), and row labels of the same length.
DEVICE_HEADERS = {
    "sim": "|             sim OOMs: 0            |         sim alloc retries: 0         |",
    "cpu": "|             CPU OOMs: 0            |              mmap retries: 0         |",
}
TORCH_HEADER = "|            CUDA OOMs: 0            |        cudaMalloc retries: 0         |"


def _as_device(torch_lines: list[str], kind: str) -> list[str]:
    word = {"sim": "sim", "cpu": "CPU"}[kind]
    lines = [line.replace("GPU reserved", f"{word} reserved").replace("Oversize GPU", f"Oversize {word}")
             for line in torch_lines]
    assert lines[3] == TORCH_HEADER
    return lines[:3] + [DEVICE_HEADERS[kind]] + lines[4:]


@pytest.mark.parametrize("abbreviated", [False, True])
def test_summary_matches_torch_formatter(sim, abbreviated):
    """Byte for byte torch's table apart from the title and the device's own words."""
    ptrs = [vramkit.raw_alloc(n, sim) for n in (100, 5000, 900_000, 3 * MiB, 50 * MiB, 700 * MiB)]
    for p in ptrs[::2]:
        vramkit.raw_free(p)
    ours = vramkit.memory_summary(sim, abbreviated=abbreviated).splitlines()
    theirs = _torch_summary(vramkit.memory_stats(sim), abbreviated).splitlines()
    assert len(ours) == len(theirs)
    assert ours[1].strip("| ") == f"vramkit memory summary, device {sim}"
    assert "PyTorch CUDA memory summary, device ID 0" in theirs[1]
    expected = _as_device(theirs, "sim")
    assert ours[:1] + ours[2:] == expected[:1] + expected[2:]
    assert not any(w in line for line in ours for w in ("CUDA", "GPU", "cudaMalloc"))
    assert all(len(line) == 77 for line in ours)
    for p in ptrs[1::2]:
        vramkit.raw_free(p)


def test_cpu_summary_matches_torch_formatter():
    vramkit.reset_accumulated_memory_stats("cpu")  # OOMs and retries of earlier tests
    a = vramkit.raw_alloc(3 * MiB, "cpu")
    stats = vramkit.memory_stats("cpu")
    ours = vramkit.memory_summary("cpu").splitlines()
    theirs = _torch_summary({k: v for k, v in stats.items() if not k.startswith(("host_", "num_host_"))},
                            False).splitlines()
    expected = _as_device(theirs, "cpu")
    assert ours[:1] + ours[2:] == expected[:1] + expected[2:]
    vramkit.raw_free(a)


def test_summary_counts_ooms_and_retries():
    small = vramkit.sim.create(64 * MiB)
    p = vramkit.raw_alloc(40 * MiB, small)
    with pytest.raises(vramkit.OutOfMemoryError):
        vramkit.raw_alloc(40 * MiB, small)
    text = vramkit.memory_summary(small)
    assert "|             sim OOMs: 1            |         sim alloc retries: 1         |" in text
    vramkit.raw_free(p)
