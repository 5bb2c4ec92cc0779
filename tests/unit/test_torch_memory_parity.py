"""torch.cuda.memory's public names in vramkit (issue 13, part 3): the parity table, and each
name's behaviour against what torch's does.

The table test prints, for every name in torch.cuda.memory.__all__, whether vramkit has it,
whether the signature is compatible (every parameter torch has, with torch's name, kind, order
and default; extra vramkit parameters only after them and optional), or why it is absent or
different. It fails when a name regresses (listed as present but missing or incompatible) and
when torch gains a name nobody has looked at.
"""

from __future__ import annotations

import inspect
import warnings

import pytest

import vramkit

MiB = 1 << 20

# Names vramkit does not have, and why. A name moves to PRESENT when it is built.
ABSENT = {
    "CUDAPluggableAllocator": "vramkit is the allocator: vramkit.torch.use_as_cuda_allocator() plugs it into torch",
    "change_current_allocator": "vramkit is the allocator: vramkit.torch.use_as_cuda_allocator() plugs it into torch",
}
# Names vramkit has under torch's name on purpose with another signature, and why.
DIFFERENT = {
    "memory_snapshot": (["device"], "vramkit's returns one device's whole snapshot dict (segments and "
                        "device_traces, as torch.cuda.memory._snapshot()); torch's returns the segments list of "
                        "every device, selected by mempool_id"),
}


def compatible(torch_fn, vramkit_fn) -> tuple[bool, str]:
    """Whether vramkit_fn accepts every call torch_fn accepts, meaning the same: the same
    parameters, in the same order and kind, with the same defaults; extra ones optional, at the end."""
    try:
        t, v = inspect.signature(torch_fn), inspect.signature(vramkit_fn)
    except (TypeError, ValueError) as exc:
        return False, f"no signature: {exc}"
    tp, vp = list(t.parameters.values()), list(v.parameters.values())
    if len(vp) < len(tp):
        return False, f"{v} lacks parameters of {t}"
    for a, b in zip(tp, vp):
        if (a.name, a.kind) != (b.name, b.kind):
            return False, f"parameter {a.name!r} ({a.kind.description}) is {b.name!r} ({b.kind.description})"
        if a.default is not b.default and a.default != b.default:
            return False, f"parameter {a.name!r} defaults to {b.default!r}, torch's to {a.default!r}"
    for extra in vp[len(tp):]:
        if extra.default is inspect.Parameter.empty and extra.kind not in (extra.VAR_POSITIONAL, extra.VAR_KEYWORD):
            return False, f"extra parameter {extra.name!r} is required"
    return True, ""


def parity_table(memory) -> list[tuple[str, str, str]]:
    rows = []
    for name in sorted(memory.__all__):
        ours = getattr(vramkit, name, None)
        if ours is None:
            rows.append((name, "absent", ABSENT.get(name, "UNEXPLAINED")))
            continue
        ok, why = compatible(getattr(memory, name), ours)
        if ok:
            rows.append((name, "present, signature compatible", ""))
        elif name in DIFFERENT:
            rows.append((name, "present, signature differs", DIFFERENT[name][1]))
        else:
            rows.append((name, "present, signature INCOMPATIBLE", why))
    return rows


def test_parity_table():
    torch = pytest.importorskip("torch")
    memory = torch.cuda.memory
    rows = parity_table(memory)
    width = max(len(r[0]) for r in rows)
    print("\ntorch.cuda.memory name".ljust(width + 3) + "vramkit")
    for name, state, why in rows:
        print(f"  {name.ljust(width)}  {state}" + (f": {why}" if why else ""))
    problems = [r for r in rows if r[2] == "UNEXPLAINED" or "INCOMPATIBLE" in r[1]]
    assert not problems, problems
    present = {r[0] for r in rows if r[1].startswith("present")}
    assert present.isdisjoint(ABSENT), "a name listed as absent exists now: move it out of ABSENT"
    for name, (signature, _) in DIFFERENT.items():
        assert list(inspect.signature(getattr(vramkit, name)).parameters) == signature, f"{name}'s difference changed"
    # The names issue 13 asked for by name, each present and compatible:
    asked = {"MemPool", "use_mem_pool", "memory_stats_as_nested_dict", "reset_max_memory_allocated", "memory_cached", "max_memory_cached",
             "caching_allocator_alloc", "caching_allocator_delete", "get_per_process_memory_fraction",
             "list_gpu_processes", "host_memory_stats"}
    assert asked <= {r[0] for r in rows if r[1] == "present, signature compatible"}
    assert len(present) >= 30, f"{len(present)} of {len(rows)} names"


def test_compatible_rejects_what_would_break_a_call():
    def torch_fn(size, device=None, stream=None): ...
    def renamed(size, dev=None, stream=None): ...
    def reordered(size, stream=None, device=None): ...
    def other_default(size, device="cpu", stream=None): ...
    def required_extra(size, device=None, stream=None, *, pool): ...
    def optional_extra(size, device=None, stream=None, pool=None): ...
    assert not compatible(torch_fn, renamed)[0] and not compatible(torch_fn, reordered)[0]
    assert not compatible(torch_fn, other_default)[0] and not compatible(torch_fn, required_extra)[0]
    assert compatible(torch_fn, optional_extra) == (True, "")


def flatten(nested, prefix=""):
    """torch's own rule for memory_stats(): nested keys joined with '.'."""
    out = {}
    for k, v in nested.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


@pytest.fixture
def gpu():
    device = vramkit.sim.create(1 << 30)
    yield device
    vramkit.pool_check(device)


def test_nested_dict_flattens_to_memory_stats(gpu):
    p = vramkit.raw_alloc(3 * MiB, gpu)
    nested = vramkit.memory_stats_as_nested_dict(gpu)
    assert nested["allocated_bytes"]["all"]["current"] == 3 * MiB
    assert nested["segment"]["large_pool"]["current"] == 1
    assert flatten(nested) == dict(vramkit.memory_stats(gpu))
    vramkit.raw_free(p)


@pytest.mark.parametrize("name, target", [("memory_cached", "memory_reserved"),
                                          ("max_memory_cached", "max_memory_reserved")])
def test_deprecated_aliases_warn_and_agree(gpu, name, target):
    p = vramkit.raw_alloc(5 * MiB, gpu)
    with pytest.warns(FutureWarning, match=f"renamed to `vramkit.{target}`"):
        value = getattr(vramkit, name)(gpu)
    assert value == getattr(vramkit, target)(gpu) == 20 * MiB  # one 20 MiB segment, as PyTorch carves it
    vramkit.raw_free(p)


@pytest.mark.parametrize("name", ["reset_max_memory_allocated", "reset_max_memory_cached"])
def test_deprecated_resets_reset_every_peak(gpu, name):
    p = vramkit.raw_alloc(30 * MiB, gpu)
    vramkit.raw_free(p)
    vramkit.empty_cache(gpu)
    assert vramkit.max_memory_allocated(gpu) == 30 * MiB and vramkit.max_memory_reserved(gpu) == 30 * MiB
    with pytest.warns(FutureWarning, match="resets /all/ peak memory stats"):
        getattr(vramkit, name)(gpu)
    assert vramkit.max_memory_allocated(gpu) == 0 and vramkit.max_memory_reserved(gpu) == 0


def test_caching_allocator_alloc_and_delete(gpu):
    class Stream:  # torch.cuda.Stream's attribute
        cuda_stream = 7

    a = vramkit.caching_allocator_alloc(1000, gpu)
    b = vramkit.caching_allocator_alloc(2000, gpu, Stream())
    c = vramkit.caching_allocator_alloc(3000, device=gpu, stream=9)
    assert vramkit._C.block_info(b)["stream"] == 7 and vramkit._C.block_info(c)["stream"] == 9
    assert vramkit._C.block_info(a)["stream"] == 0
    assert vramkit.memory_allocated(gpu) == 1024 + 2048 + 3072
    for p in (a, b, c):
        vramkit.caching_allocator_delete(p)
    assert vramkit.memory_allocated(gpu) == 0
    before = vramkit.memory_stats(gpu)
    with pytest.raises(TypeError, match="Invalid type for stream argument"):
        vramkit.caching_allocator_alloc(10, gpu, "stream")
    assert vramkit.memory_stats(gpu) == before


def test_per_process_memory_fraction_round_trip(gpu):
    assert vramkit.get_per_process_memory_fraction(gpu) == 1.0
    vramkit.set_per_process_memory_fraction(0.25, gpu)
    assert vramkit.get_per_process_memory_fraction(gpu) == 0.25
    vramkit.set_memory_limit(256 * MiB, gpu)  # an absolute cap: the fraction of 1 GiB it is
    assert vramkit.get_per_process_memory_fraction(gpu) == 0.25
    vramkit.set_memory_limit(None, gpu)
    vramkit.set_per_process_memory_fraction(1.0, gpu)
    assert vramkit.get_per_process_memory_fraction(gpu) == 1.0


def test_host_memory_stats_are_the_host_pools_in_torchs_names():
    vramkit.empty_cache("cpu")
    vramkit.reset_peak_host_memory_stats()
    vramkit.reset_accumulated_host_memory_stats()
    before = vramkit.host_memory_stats()
    assert before["num_host_alloc"] == 0 and before["allocated_bytes.allocated"] == 0
    p = vramkit.raw_alloc(3 * MiB, "cpu")  # a 3 MiB block in a fresh 20 MiB host segment
    s = vramkit.host_memory_stats()
    assert s["active_requests.current"] == before["active_requests.current"] + 1
    assert s["active_bytes.current"] == before["active_bytes.current"] + 3 * MiB
    assert s["allocations.current"] == before["allocations.current"] + 1 and s["num_host_alloc"] == 1
    assert s["allocated_bytes.current"] == before["allocated_bytes.current"] + 20 * MiB
    vramkit.raw_free(p)
    vramkit.empty_cache("cpu")
    s = vramkit.host_memory_stats()
    assert s["num_host_free"] == 1 and s["allocated_bytes.current"] == before["allocated_bytes.current"]
    assert s["allocated_bytes.peak"] >= 20 * MiB
    assert flatten(vramkit.host_memory_stats_as_nested_dict()) == dict(s)
    torch = pytest.importorskip("torch")
    if hasattr(torch.cuda.memory, "host_memory_stats"):  # torch's documented keys, from its docstring
        doc = torch.cuda.memory.host_memory_stats.__doc__
        for key in ("allocations", "allocated_bytes", "active_requests", "active_bytes", "num_host_alloc",
                    "num_host_free"):
            assert f'"{key}' in doc


def test_allocator_backend_names_the_policy():
    assert vramkit.get_allocator_backend() == "native"


def test_list_gpu_processes_without_nvml(monkeypatch, tmp_path):
    monkeypatch.setenv("VRAMKIT_NVML_LIBRARY", str(tmp_path / "missing.so"))
    vramkit._C.nvml_close()
    try:
        text = vramkit.list_gpu_processes()
    finally:
        vramkit._C.nvml_close()
    assert text.startswith("NVML could not be loaded (") and "is the NVIDIA driver installed?" in text


@pytest.mark.parametrize("expandable", [False, True])
def test_caching_disabled_gives_freed_segments_back_at_once(gpu, expandable):
    vramkit.configure(gpu, expandable_segments=expandable)
    try:
        assert vramkit._C.caching_enabled()
        kept = vramkit.raw_alloc(3 * MiB, gpu)
        cached = vramkit.raw_alloc(30 * MiB, gpu)
        vramkit.raw_free(cached)
        assert vramkit.memory_reserved(gpu) > vramkit.memory_allocated(gpu)  # cached, as usual
        with vramkit.caching_allocator_disabled():
            assert not vramkit._C.caching_enabled()
            p = vramkit.raw_alloc(40 * MiB, gpu)
            vramkit.raw_free(p)  # this free gives back every wholly free segment (or page), the old one too
            page = 20 * MiB if expandable else 0  # an expandable pool keeps whole pages mapped
            live_rounded = 20 * MiB if not expandable else page  # the 3 MiB block pins its segment (page)
            assert vramkit.memory_reserved(gpu) == live_rounded
            vramkit.pool_check(gpu)
        assert vramkit._C.caching_enabled()  # restored
        p = vramkit.raw_alloc(40 * MiB, gpu)
        vramkit.raw_free(p)
        assert vramkit.memory_reserved(gpu) >= 40 * MiB  # cached again
        vramkit.raw_free(kept)
    finally:
        vramkit.caching_allocator_enable(True)
        vramkit.empty_cache(gpu)
        vramkit.configure(gpu, expandable_segments=False)


def test_caching_enable_is_restored_after_an_exception(gpu):
    with pytest.raises(KeyError):
        with vramkit.caching_allocator_disabled():
            raise KeyError("x")
    assert vramkit._C.caching_enabled()
