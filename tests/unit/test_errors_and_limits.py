"""Bad input raises a specific exception and changes nothing; OOM behaves like PyTorch's;
limits, fractions and options apply and validate."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest

import vramkit
from conftest import subprocess_env

MiB = 1 << 20


def unchanged(device, action, exc, match):
    """Run a bad call and check it raised `exc` and left every counter and invariant intact."""
    before = vramkit.memory_stats(device)
    with pytest.raises(exc, match=match):
        action()
    assert vramkit.memory_stats(device) == before
    vramkit.pool_check(device)


@pytest.mark.parametrize("device", ["cpu", "sim"])
def test_bad_sizes_and_pointers_change_nothing(device, sim):
    device = sim if device == "sim" else device
    live = vramkit.raw_alloc(5000, device)
    unchanged(device, lambda: vramkit.raw_alloc(-1, device), ValueError, "nbytes must be non-negative, got -1")
    unchanged(device, lambda: vramkit.raw_alloc(1 << 62, device), ValueError, "absurd: sizes must be below 2\\*\\*62")
    unchanged(device, lambda: vramkit.raw_alloc(1 << 70, device), ValueError, "absurd")
    unchanged(device, lambda: vramkit.raw_alloc(1.5, device), TypeError, "nbytes must be an integer.*float")
    unchanged(device, lambda: vramkit.raw_alloc("10", device), TypeError, "nbytes must be an integer.*str")
    unchanged(device, lambda: vramkit.raw_alloc(True, device), TypeError, "got bool")
    unchanged(device, lambda: vramkit.raw_alloc(10, device, stream="s"), TypeError, "stream must be")
    unchanged(device, lambda: vramkit.raw_free(live + 512), ValueError, "not a live allocation of vramkit")
    unchanged(device, lambda: vramkit.raw_free(12345), ValueError, "never returned by vramkit")
    unchanged(device, lambda: vramkit.raw_free(-5), ValueError, "non-negative")
    unchanged(device, lambda: vramkit.raw_free(1.0), TypeError, "ptr must be an int")
    unchanged(device, lambda: vramkit.record_stream(12345, 1), ValueError, "not a live allocation")
    vramkit.raw_free(live)
    unchanged(device, lambda: vramkit.raw_free(live), ValueError, "already freed")  # double free


def test_zero_byte_requests_are_valid(sim):
    assert vramkit.raw_alloc(0, sim) == 0
    vramkit.raw_free(0)
    assert vramkit.memory_stats(sim)["allocation.all.allocated"] == 0
    buf = vramkit.empty(0, device="cpu")
    assert buf.nbytes == 0 and buf.ptr == 0 and buf.shape == (0,)
    import numpy as np

    assert np.asarray(buf).size == 0


def test_numpy_integers_are_sizes(sim):
    import numpy as np

    p = vramkit.raw_alloc(np.int64(4096), sim)
    assert vramkit.memory_allocated(sim) == 4096
    vramkit.raw_free(p)


def test_oom_on_sim_message_attributes_and_recovery():
    dev = vramkit.sim.create(100 * MiB)
    keep = vramkit.raw_alloc(60 * MiB, dev)
    before = vramkit.memory_stats(dev)
    with pytest.raises(vramkit.OutOfMemoryError) as info:
        vramkit.raw_alloc(60 * MiB, dev)
    e = info.value
    n = dev.split(":")[1]
    assert str(e).startswith(f"sim:{n} out of memory. Tried to allocate 60.00 MiB. Device sim:{n} has a total "
                             "capacity of 100.00 MiB of which 40.00 MiB is free. Of the allocated memory 60.00 MiB is "
                             "allocated by vramkit, and 0 bytes is reserved by vramkit but unallocated.")
    assert (e.requested, e.segment_size, e.free, e.total) == (60 * MiB, 60 * MiB, 40 * MiB, 100 * MiB)
    assert (e.allocated, e.reserved, e.allowed, e.device) == (60 * MiB, 60 * MiB, None, dev)
    # PyTorch-style retry loops: a RuntimeError with one string argument containing " out of memory."
    assert isinstance(e, RuntimeError) and isinstance(e, MemoryError) and isinstance(e, vramkit.VramkitError)
    assert len(e.args) == 1 and " out of memory." in e.args[0]
    copy = pickle.loads(pickle.dumps(e))
    assert type(copy) is vramkit.OutOfMemoryError and str(copy) == str(e) and copy.free == e.free
    after = vramkit.memory_stats(dev)
    assert after["num_ooms"] == before["num_ooms"] + 1
    assert after["num_alloc_retries"] == before["num_alloc_retries"] + 1
    assert {k: v for k, v in after.items() if not k.startswith("num_")} == \
           {k: v for k, v in before.items() if not k.startswith("num_")}
    vramkit.pool_check(dev)
    vramkit.raw_free(keep)
    again = vramkit.raw_alloc(60 * MiB, dev)  # usable again, from the cache
    assert again == keep
    vramkit.raw_free(again)


def test_oom_releases_cache_before_failing():
    dev = vramkit.sim.create(100 * MiB)
    vramkit.raw_free(vramkit.raw_alloc(60 * MiB, dev))  # 60 MiB cached, too small for what follows
    p = vramkit.raw_alloc(70 * MiB, dev)
    stats = vramkit.memory_stats(dev)
    assert stats["num_alloc_retries"] == 1 and stats["num_ooms"] == 0 and stats["num_device_free"] == 1
    vramkit.raw_free(p)


def test_memory_limit_and_fraction(sim):
    vramkit.set_memory_limit(100 * MiB, sim)
    a = vramkit.raw_alloc(60 * MiB, sim)
    with pytest.raises(vramkit.OutOfMemoryError, match="100.00 MiB allowed; ") as info:
        vramkit.raw_alloc(60 * MiB, sim)
    assert info.value.allowed == 100 * MiB
    vramkit.set_memory_limit(None, sim)
    vramkit.set_per_process_memory_fraction(1 / 64, sim)  # 128 MiB of 8 GiB
    assert vramkit.get_settings(sim)["allowed_bytes"] == 128 * MiB
    with pytest.raises(vramkit.OutOfMemoryError, match="128.00 MiB allowed;"):
        vramkit.raw_alloc(70 * MiB, sim)
    with pytest.raises(TypeError, match="Invalid type for fraction argument"):
        vramkit.set_per_process_memory_fraction("0.5", sim)
    with pytest.raises(ValueError, match="Invalid fraction value: 1.5. Allowed range: 0~1"):
        vramkit.set_per_process_memory_fraction(1.5, sim)
    with pytest.raises(ValueError, match="absurd"):
        vramkit.set_memory_limit(1 << 62, sim)
    assert vramkit.get_settings(sim)["allowed_bytes"] == 128 * MiB  # rejected calls changed nothing
    vramkit.set_per_process_memory_fraction(1.0, sim)
    b = vramkit.raw_alloc(70 * MiB, sim)
    vramkit.raw_free(a)
    vramkit.raw_free(b)
    free, total = vramkit.mem_get_info(sim)
    assert total == 8 << 30 and free == total - vramkit.memory_reserved(sim)


def test_configure_applies_all_or_nothing(sim):
    settings = vramkit.configure(sim)
    assert settings["max_split_size"] is None and settings["garbage_collection_threshold"] == 0.0
    with pytest.raises(ValueError, match="unrecognized option 'nonsense'; allowed options: max_split_size_mb"):
        vramkit.configure(sim, max_split_size_mb=64, nonsense=1)
    with pytest.raises(ValueError, match="garbage_collection_threshold must be a number greater than 0.0"):
        vramkit.configure(sim, garbage_collection_threshold=1.5)
    with pytest.raises(ValueError, match="max_split_size_mb must be an integer > 20"):
        vramkit.configure(sim, max_split_size_mb=8)
    assert vramkit.configure(sim) == settings
    new = vramkit.configure(sim, max_split_size_mb=64, roundup_power2_divisions={256: 1, 512: 2, ">": 8},
                            garbage_collection_threshold=0.7, memory_limit_mb=512)
    assert new["max_split_size"] == 64 * MiB and new["garbage_collection_threshold"] == 0.7
    # As in PyTorch, ">" fills from the last listed interval on, overwriting 512's 2 with 8.
    assert new["roundup_power2_divisions"][7:10] == [1, 1, 8] and new["roundup_power2_divisions"][15] == 8
    assert new["allowed_bytes"] == 512 * MiB
    assert vramkit.memory_stats(sim)["max_split_size"] == 64 * MiB
    p = vramkit.raw_alloc(300 * MiB, sim)
    assert vramkit.memory_stats(sim)["oversize_allocations.current"] == 1
    vramkit.raw_free(p)
    reset = vramkit.configure(sim, max_split_size_mb=None, memory_limit_mb=None)
    assert reset["max_split_size"] is None and reset["allowed_bytes"] is None


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**subprocess_env(), **env}, timeout=120)


def test_alloc_conf_environment_variable():
    ok = _python("import vramkit; d = vramkit.sim.create(1 << 30); "
                 "print(vramkit.get_settings(d)['max_split_size'], vramkit.get_settings('cpu')['max_split_size'])",
                 VRAMKIT_ALLOC_CONF="max_split_size_mb:128,garbage_collection_threshold:0.8")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.split() == [str(128 * MiB)] * 2
    bad = _python("import vramkit; vramkit.memory_allocated('cpu')", VRAMKIT_ALLOC_CONF="max_split_size_mb:lots")
    assert bad.returncode != 0
    assert "ValueError: VRAMKIT_ALLOC_CONF: max_split_size_mb must be an integer > 20 (MiB) or None; got 'lots'" \
        in bad.stderr


def test_record_stream_defers_reuse_until_synchronize(sim):
    a = vramkit.raw_alloc(4096, sim, stream=1)
    vramkit.record_stream(a, 2)
    vramkit.raw_free(a)
    stats = vramkit.memory_stats(sim)
    assert stats["allocation.all.current"] == 0 and stats["active.all.current"] == 1
    b = vramkit.raw_alloc(4096, sim, stream=1)
    assert b != a  # stream 2 may still be using a
    vramkit.synchronize(sim, stream=2)
    assert vramkit.memory_stats(sim)["active.all.current"] == 1
    c = vramkit.raw_alloc(4096, sim, stream=1)
    assert c == a
    vramkit.raw_free(b)
    vramkit.raw_free(c)
    snap_states = [blk["state"] for seg in vramkit.memory_snapshot(sim)["segments"] for blk in seg["blocks"]]
    assert set(snap_states) == {"inactive"}


def test_record_stream_accepts_buffers_and_stream_objects(sim):
    class FakeTorchStream:  # torch.cuda.Stream exposes the raw handle as .cuda_stream
        cuda_stream = 7

    buf = vramkit.empty(1024, device=sim)
    vramkit.record_stream(buf, FakeTorchStream())
    ptr = buf.ptr
    del buf
    states = {b["address"]: b["state"] for s in vramkit.memory_snapshot(sim)["segments"] for b in s["blocks"]}
    assert states[ptr] == "active_pending_free"
    vramkit.synchronize(sim)
    states = {b["address"]: b["state"] for s in vramkit.memory_snapshot(sim)["segments"] for b in s["blocks"]}
    assert states[ptr] == "inactive"


def test_raw_free_finds_the_right_simulated_device():
    a, b = vramkit.sim.create(1 << 30), vramkit.sim.create(1 << 30)
    pa, pb = vramkit.raw_alloc(1024, a), vramkit.raw_alloc(1024, b)
    assert pa != pb  # simulated devices share one address range, so addresses identify devices
    vramkit.raw_free(pb)
    assert vramkit.memory_allocated(b) == 0 and vramkit.memory_allocated(a) == 1024
    vramkit.raw_free(pa)
    assert vramkit.memory_allocated(a) == 0


def test_exhausting_the_simulated_address_range_changes_nothing():
    huge = vramkit.sim.create((1 << 62) - 1)
    a = vramkit.raw_alloc(12 * MiB, huge)
    for _ in range(4):  # more address space than the simulated range has
        with pytest.raises(vramkit.VramkitError, match="simulated address range exhausted"):
            vramkit.raw_alloc((1 << 62) - 32 * MiB, huge)
    b = vramkit.raw_alloc(116 * MiB, huge)
    c = vramkit.raw_alloc(12 * MiB, huge)
    assert b >= 1 << 48 and len({a, b, c}) == 3  # refused requests consumed no addresses
    vramkit.pool_check(huge)
    for p in (a, b, c):
        vramkit.raw_free(p)


@pytest.mark.skipif(sys.platform != "linux" or vramkit.mem_get_info("cpu")[1] < 8 << 30,
                    reason="needs Linux and a host of 8 GiB (the requests must fit its capacity; they are never touched)")
def test_address_space_limit_is_named_in_the_oom_and_only_there():
    """Under RLIMIT_AS (`ulimit -v`) the classic cpu pool's mmap fails with ENOMEM while the host
    has memory free: the OutOfMemoryError names the limit, its value and what is in use, and
    its `free` is what the limit leaves. The backend's note of that refusal is for that OOM
    only: after a refusal that the OOM ladder then cured (releasing a cached segment made
    room), an OOM with another cause says nothing of RLIMIT_AS."""
    out = _python("""
import resource, vramkit
GiB, MiB = 1 << 30, 1 << 20
def vm_size():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()
limit = (vm_size() // GiB + 4) * GiB  # 3 to 4 GiB left
resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
try:
    vramkit.raw_alloc(4 * GiB, "cpu")
except vramkit.OutOfMemoryError as e:
    assert e.free < 4 * GiB and e.requested == 4 * GiB, (e.free, e.requested)
    print("REFUSED:", e)
size = (limit - vm_size() - 512 * MiB) // (2 * MiB) * 2 * MiB  # 2.5 to 3.5 GiB
cached = vramkit.raw_alloc(GiB, "cpu")
vramkit.raw_free(cached)  # stays cached, its address space with it: less than `size` is left
before = vramkit.memory_stats("cpu")
p = vramkit.raw_alloc(size, "cpu")  # refused at first; fits once the ladder has released the cached segment
after = vramkit.memory_stats("cpu")
assert vramkit.memory_reserved("cpu") == size
assert [after[k] - before[k] for k in ("num_alloc_retries", "num_device_free", "num_ooms")] == [1, 1, 0]
vramkit.set_memory_limit(size + 256 * MiB, "cpu")
try:
    vramkit.raw_alloc(512 * MiB, "cpu")
except vramkit.OutOfMemoryError as e:
    print("OTHER:", e)
vramkit.raw_free(p)
vramkit.pool_check("cpu")
print("BOUND=" + str(limit))
""", VRAMKIT_ALLOC_CONF="host_memory_check:False")
    assert out.returncode == 0, out.stdout + out.stderr
    limit = int(out.stdout.split("BOUND=")[1])
    refused = out.stdout.split("REFUSED: ")[1].splitlines()[0]
    assert refused.startswith("CPU out of memory. Tried to allocate 4.00 GiB. Device cpu has a total capacity of ")
    assert (f"vramkit could not map 4.00 GiB because of the address-space limit RLIMIT_AS (ulimit -v) of "
            f"{limit / (1 << 30):.2f} GiB, of which ") in refused, refused
    other = out.stdout.split("OTHER: ")[1].splitlines()[0]
    assert " allowed; Of the allocated memory" in other and "RLIMIT_AS" not in other, other
