"""The CUDA loss-scaling kernels on a real GPU: bit-exact against vramkit's CPU kernel (itself
checked against NumPy and torch in test_amp_kernels.py) and against torch's CUDA kernel.
Marked `cuda`: skipped without a GPU."""

from __future__ import annotations

import pytest

from vramkit import amp

pytestmark = pytest.mark.cuda
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():  # pragma: no cover - the marker already skips these
    pytest.skip("torch has no CUDA device", allow_module_level=True)

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def random_list(gen, sizes, dtype, poison=0.0, misalign=False):
    out = []
    for n in sizes:
        t = torch.randn(n + misalign, generator=gen, dtype=torch.float64)
        t *= 2.0 ** torch.randint(-18, 12, (n + misalign,), generator=gen)
        if poison and n and torch.rand((), generator=gen).item() < poison:
            t[torch.randint(0, n + misalign, (1,), generator=gen)] = float("inf")
        t = t.to(dtype)
        out.append(t[1:] if misalign else t)
    return out


def same(a, b):
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()], b[~b.isnan()])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("misalign", [False, True])
@pytest.mark.parametrize("inv", [0.5, 2.0 ** -16, 1.0, 3.0])
def test_cuda_matches_cpu_kernel_bit_for_bit(dtype, misalign, inv):
    gen = torch.Generator().manual_seed(1)
    sizes = [0, 1, 7, 8, 9, 4095, 65535, 65536, 65537, 1_000_003] + [int(x) for x in torch.randint(1, 5000, (300,),
                                                                                                   generator=gen)]
    cpu = random_list(gen, sizes, dtype, poison=0.01, misalign=misalign)
    gpu = [t.cuda() for t in cpu]
    found_cpu = amp.unscale_(cpu, inv)
    found = torch.zeros((), device="cuda")
    amp.non_finite_check_and_unscale_(gpu, found, torch.full((), inv, device="cuda"))
    assert bool(found.item()) == found_cpu
    for i, (a, b) in enumerate(zip(cpu, gpu)):
        assert same(a, b.cpu()), f"tensor {i} (numel {a.numel()})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64], ids=str)
def test_cuda_matches_torch_cuda_kernel(dtype):
    gen = torch.Generator().manual_seed(2)
    ours = [t.cuda() for t in random_list(gen, [3, 1000, 70_000, 25_000_000], dtype, poison=0.5)]
    theirs = [t.clone() for t in ours]
    f_ours, f_theirs = torch.zeros((), device="cuda"), torch.zeros((), device="cuda")
    inv = torch.full((), 1 / 1024, device="cuda")
    amp.non_finite_check_and_unscale_(ours, f_ours, inv)
    torch._amp_foreach_non_finite_check_and_unscale_(theirs, f_theirs, inv)
    assert f_ours.item() == f_theirs.item()
    for a, b in zip(ours, theirs):
        assert same(a, b)


def test_bf16_on_cuda_which_torch_lacks():
    g = torch.linspace(-8, 8, 100_001, device="cuda", dtype=torch.bfloat16)
    want = (g.float() * 0.25).bfloat16()
    assert amp.unscale_([g], 0.25) is False
    assert torch.equal(g, want)


def test_norm_and_clip_match_cpu_and_torch():
    gen = torch.Generator().manual_seed(3)
    cpu = random_list(gen, [10, 300_000, 5_000_000], torch.float32)
    gpu = [t.cuda() for t in cpu]
    found_c, norm_c = amp.unscale_and_norm_(cpu, 0.5)
    found_g, norm_g = amp.unscale_and_norm_(gpu, 0.5)
    assert found_c == found_g is False
    assert norm_g == pytest.approx(norm_c, rel=1e-6)
    params = [torch.nn.Parameter(torch.zeros_like(t)) for t in gpu]
    for p, t in zip(params, gpu):
        p.grad = t.clone()
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = amp.GradScaler("cuda", init_scale=1.0)
    scaler.scale(torch.ones((), device="cuda"))
    norm = scaler.unscale_and_clip_(opt, max_norm=1.0)
    assert float(norm) == pytest.approx(norm_g, rel=1e-6)
    ref_params = [torch.nn.Parameter(torch.zeros_like(t)) for t in gpu]
    for p, t in zip(ref_params, gpu):
        p.grad = t.clone()
    torch.nn.utils.clip_grad_norm_(ref_params, 1.0)
    for p, q in zip(params, ref_params):
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-6, atol=0)


def test_update_scale_on_device_matches_host_rule():
    gen = torch.Generator().manual_seed(4)
    for hysteresis, lo, hi in ((1, None, None), (3, 1.0, 2.0 ** 20)):
        s_d = torch.full((), 2.0 ** 16, device="cuda")
        g_d = torch.zeros((), dtype=torch.int32, device="cuda")
        h_d = torch.full((), hysteresis, dtype=torch.int32, device="cuda")
        s_h, g_h, h_h = s_d.cpu(), g_d.cpu(), h_d.cpu()
        for _ in range(3000):
            f = float(torch.rand((), generator=gen).item() < 0.2)
            kw = dict(hysteresis=hysteresis, min_scale=lo, max_scale=hi)
            amp.update_scale_(s_d, g_d, torch.full((), f, device="cuda"), 2.0, 0.5, 5, hysteresis_tracker=h_d, **kw)
            amp.update_scale_(s_h, g_h, torch.full((), f), 2.0, 0.5, 5, hysteresis_tracker=h_h, **kw)
        assert s_d.item() == s_h.item() and g_d.item() == g_h.item() and h_d.item() == h_h.item()


def test_gradscaler_on_cuda_follows_torch_gradscaler():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).cuda()
    twin = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).cuda()
    twin.load_state_dict(model.state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in (model, twin)]
    ours, theirs = amp.GradScaler("cuda", growth_interval=3), torch.amp.GradScaler("cuda", growth_interval=3)
    for step in range(200):
        x = torch.randn(32, 64, device="cuda")
        for m, opt, scaler in ((model, opts[0], ours), (twin, opts[1], theirs)):
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = m(x).square().mean()
            scaler.scale(loss).backward()
            if step % 17 == 5:
                next(m.parameters()).grad[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
        assert ours.get_scale() == theirs.get_scale(), step
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


def test_cupy_arrays():
    cupy = pytest.importorskip("cupy")
    a = cupy.linspace(-4, 4, 10_001, dtype=cupy.float16)
    want = (a.astype(cupy.float32) * cupy.float32(0.125)).astype(cupy.float16)
    assert amp.unscale_([a], 0.125) is False
    assert bool((a == want).all())
    a[3] = cupy.inf
    assert amp.unscale_([a], 0.5) is True
