"""The capture's cache of op output shapes (``trace.meta_shapes``): a capture with it equals
one without it event for event, and it is used only where an op's outputs are fresh storages."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import vramkit.trace as vt  # noqa: E402
from vramkit.trace.capturing import meta_shapes  # noqa: E402
from vramkit.trace.capturing.meta_shapes import ShapeCache  # noqa: E402

COLUMNS = ("kind", "id", "size", "alloc_dtype", "alloc_category", "alloc_op", "alloc_module")


def assert_same(a: vt.Trace, b: vt.Trace) -> None:
    for col in COLUMNS:
        np.testing.assert_array_equal(getattr(a, col), getattr(b, col), err_msg=col)
    assert (a.dtypes, a.ops, a.modules) == (b.dtypes, b.ops, b.modules)


def _uncached(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ShapeCache, "run", lambda self, func, args, kwargs: func(*args, **kwargs))


def gpt_builder(batch: int = 3):
    import sharded_models as sm

    def build():
        torch.manual_seed(0)
        model = sm.GPT()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return sm.training_step("gpt", model, opt, batch)

    return build


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_a_capture_with_the_cache_equals_one_without(monkeypatch, autocast):
    fresh = ShapeCache()
    monkeypatch.setattr(meta_shapes, "SHAPES", fresh)
    monkeypatch.setattr("vramkit.trace.capturing.meta_values.SHAPES", fresh)
    cached = [vt.capture(gpt_builder(), device="meta", steps=2, cuda=False, autocast=autocast) for _ in range(2)]
    assert fresh.hits > fresh.misses > 0  # three identical blocks and two steps: mostly hits
    with monkeypatch.context() as m:
        _uncached(m)
        plain = vt.capture(gpt_builder(), device="meta", steps=2, cuda=False, autocast=autocast)
    assert_same(cached[0], plain)
    assert_same(cached[1], plain)


def test_a_hugging_face_model_with_the_cache_equals_one_without(monkeypatch):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)

    def build():
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.randint(0, 500, (2, 32))

        def step():
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    fresh = ShapeCache()
    monkeypatch.setattr("vramkit.trace.capturing.meta_values.SHAPES", fresh)
    cached = vt.capture(build, device="meta", steps=2)
    assert fresh.hits > 0
    _uncached(monkeypatch)
    assert_same(cached, vt.capture(build, device="meta", steps=2))


def test_outputs_that_are_not_fresh_storages_are_never_cached():
    """An op whose result shares its input's storage (as FSDP2's all_gather_copy_in returns a
    view of its other output, with no aliasing in its schema) is run every time."""
    cache = ShapeCache()
    x = torch.empty(4, 6, device="meta")

    def same_storage(t):  # stands in for an op returning (a view of) its input
        return t.view(6, 4)

    same_storage._schema = torch.ops.aten.mm.default._schema  # a schema without aliasing
    for _ in range(3):
        out = cache.run(same_storage, (x,), {})
        assert out.untyped_storage()._cdata == x.untyped_storage()._cdata
    assert cache.hits == 0 and len(cache.entries) == 1


def test_views_and_in_place_ops_are_not_cached_and_outputs_are_rebuilt_fresh():
    cache = ShapeCache()
    a, b = torch.empty(8, 16, device="meta"), torch.empty(16, 4, device="meta")
    first = cache.run(torch.ops.aten.mm.default, (a, b), {})
    again = cache.run(torch.ops.aten.mm.default, (a, b), {})
    assert cache.hits == 1
    assert (again.shape, again.stride(), again.dtype) == (first.shape, first.stride(), first.dtype)
    assert again.untyped_storage()._cdata != first.untyped_storage()._cdata
    assert again.untyped_storage().nbytes() == 8 * 4 * 4
    for op, args in ((torch.ops.aten.view.default, (a, [16, 8])), (torch.ops.aten.add_.Tensor, (a, a))):
        assert cache.run(op, args, {}).untyped_storage()._cdata == a.untyped_storage()._cdata
        assert cache.run(op, args, {}).untyped_storage()._cdata == a.untyped_storage()._cdata
        assert cache.ops_ok[op] is False
    # An op that fails on meta fails through the cache too, every time (nothing is remembered).
    for _ in range(2):
        with pytest.raises(NotImplementedError):
            cache.run(torch.ops.aten._to_copy.default, (a,), {"device": torch.device("cpu")})
    assert cache.hits == 1


def test_the_key_tells_apart_what_changes_an_output():
    """Strides, dtypes, True against 1, and the default dtype (an integer tensor divided by a
    number comes out in it) each give another entry."""
    cache = ShapeCache()
    div = torch.ops.aten.div.Tensor
    ints = torch.empty(3, 5, dtype=torch.int64, device="meta")
    two = torch.empty((), dtype=torch.int64, device="meta")
    assert cache.run(div, (ints, two), {}).dtype == torch.float32
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert cache.run(div, (ints, two), {}).dtype == torch.float64
    finally:
        torch.set_default_dtype(old)
    t = torch.empty(4, 6, device="meta").t()
    out = cache.run(torch.ops.aten.clone.default, (t,), {})
    assert out.stride() == t.stride()  # preserve_format keeps the transposed strides
    c = cache.run(torch.ops.aten.clone.default, (torch.empty(6, 4, device="meta"),), {})
    assert c.stride() == (4, 1)
    s1 = cache.run(torch.ops.aten.sum.dim_IntList, (torch.empty(4, 6, device="meta"), [1], True), {})
    s2 = cache.run(torch.ops.aten.sum.dim_IntList, (torch.empty(4, 6, device="meta"), [1], 1), {})
    assert s1.shape == s2.shape == (4, 1)
    assert cache.hits == 0  # every call above was a new key


def test_the_cache_is_bounded():
    cache = ShapeCache(max_entries=4)
    for n in range(1, 10):
        cache.run(torch.ops.aten.mm.default, (torch.empty(n, 2, device="meta"), torch.empty(2, 3, device="meta")), {})
    assert len(cache.entries) <= 4
