"""Values of small meta tensors during a capture (vramkit.trace.capturing.meta_values): data-dependent
Python on ids, positions and masks runs as on a real device; what cannot be known is refused
with a message that says why."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import vramkit.trace as vt  # noqa: E402
from vramkit.trace.capturing.meta_values import DataDependentError  # noqa: E402

COLUMNS = ("kind", "id", "size", "alloc_dtype", "alloc_op", "alloc_module")


def assert_same(a: vt.Trace, b: vt.Trace) -> None:
    for col in COLUMNS:
        np.testing.assert_array_equal(getattr(a, col), getattr(b, col), err_msg=col)
    assert (a.dtypes, a.ops) == (b.dtypes, b.ops)


def data_dependent_builder():
    """A step whose allocations depend on values: a count from .item(), a branch on .all(),
    a nonzero() (output shape from values), a boolean-mask index and .tolist()."""
    def build():
        model = nn.Linear(16, 16)
        labels = torch.arange(40) % 7 - 1  # -1 marks ignored positions, as -100 does in HF
        positions = torch.arange(40).view(2, 20)

        def step():
            valid = int((labels >= 0).sum().item())
            scratch = torch.empty(valid, 16)  # sized by a value
            if ((positions[:, 1:] - positions[:, :-1]) == 1).all():  # HF's packed-sequence check
                scratch = scratch * 2
            keep = (labels % 3 == 0).nonzero()  # shape from values
            picked = labels[labels > 2]  # boolean-mask index
            sizes = picked.tolist()
            out = model(scratch[: len(sizes)] + keep.shape[0])
            out.sum().backward()

        return step

    return build


def test_data_dependent_steps_run_on_meta_as_on_cpu():
    meta = vt.capture(data_dependent_builder(), device="meta", steps=2, cuda=False)
    cpu = vt.capture(data_dependent_builder(), device="cpu", steps=2)
    assert_same(meta, cpu)
    # The value-sized allocation is there with its real size: 40 labels, 40 // 7 * 1 + ... ignored.
    valid = int(((torch.arange(40) % 7 - 1) >= 0).sum())
    assert valid * 16 * 4 in meta.alloc_size.tolist()


def test_values_from_the_weights_are_refused_with_the_reason():
    def build():
        model = nn.Linear(16, 16)
        x = torch.randn(4, 16)

        def step():
            if model(x).sum() > 0:  # a question about activations: no value on meta
                pass

        return step

    with pytest.raises(vt.CaptureError) as info:
        vt.capture(build, device="meta")
    cause = info.value.__cause__
    assert isinstance(cause, DataDependentError)
    assert "computed from tensors without values" in str(cause) and "device='cpu'" in str(cause)
    assert "made by aten::gt" in str(cause)  # which op made the tensor asked about


def test_large_tensors_keep_no_values():
    def build():
        big = torch.ones(5 << 20)  # 20 MiB of float32: above the 16 MiB kept

        def step():
            return int(big.sum().item() > 0)

        return step

    with pytest.raises(vt.CaptureError) as info:
        vt.capture(build, device="meta")
    assert "16 MiB" in str(info.value.__cause__) or "without values" in str(info.value.__cause__)


def test_writes_from_tensors_without_values_drop_the_value_of_every_view():
    def build():
        model = nn.Linear(4, 4)
        counts = torch.zeros(8, dtype=torch.long)
        view = counts[:4]

        def step():
            assert int(view.sum()) == 0  # known: zeros
            counts.add_(model.weight.sum().long())  # written from the weights: unknown now
            return int(view.sum())  # asked through a view of the written storage

        return step

    with pytest.raises(vt.CaptureError) as info:
        vt.capture(build, device="meta")
    assert isinstance(info.value.__cause__, DataDependentError)


def test_in_place_updates_from_known_values_are_followed():
    seen = []

    def build():
        counts = torch.zeros(4, dtype=torch.long)

        def step():
            counts.add_(torch.arange(4))
            seen.append(counts.tolist())

        return step

    vt.capture(build, device="meta", steps=3)
    assert seen == [[0, 1, 2, 3], [0, 2, 4, 6], [0, 3, 6, 9]]


def test_random_inputs_draw_in_range_without_touching_the_users_rng():
    drawn = []

    def build():
        ids = torch.randint(3, 50, (4, 32))

        def step():
            drawn.append((int(ids.min()), int(ids.max())))

        return step

    state = torch.random.get_rng_state()
    vt.capture(build, device="meta")
    assert torch.equal(state, torch.random.get_rng_state())
    lo, hi = drawn[0]
    assert 3 <= lo <= hi < 50


def test_python_data_has_values():
    seen = []

    def build():
        labels = torch.tensor([3, -100, 5, -100])

        def step():
            seen.append((torch.tensor(5).item(), labels.tolist(), int((labels != -100).sum())))

        return step

    vt.capture(build, device="meta")
    assert seen == [(5, [3, -100, 5, -100], 2)]


def test_cpu_copies_of_known_values_are_real_cpu_tensors():
    out = []

    def build():
        ids = torch.arange(6)

        def step():
            host = ids.cpu()  # what a GPU run gets: data on the host
            out.append((host.device.type, host.numpy().tolist()))

        return step

    vt.capture(build, device="meta")
    assert out == [("cpu", [0, 1, 2, 3, 4, 5])]


def test_the_users_generators_are_untouched():
    g = torch.Generator().manual_seed(1)
    before_g, before_cpu = g.get_state(), torch.random.get_rng_state()

    def build():
        x = torch.randint(0, 10, (4,), generator=g)

        def step():
            return x.tolist()

        return step

    vt.capture(build, device="meta")
    assert torch.equal(g.get_state(), before_g) and torch.equal(torch.random.get_rng_state(), before_cpu)


def test_in_place_foreach_ops_keep_values():
    seen = []

    def build():
        tensors = [torch.arange(3).float(), torch.arange(2).float()]

        def step():
            torch._foreach_mul_(tensors, 2.0)
            seen.append(tensors[0].tolist())

        return step

    vt.capture(build, device="meta")
    assert seen == [[0.0, 2.0, 4.0]]
