"""cuDNN convolution workspaces in a meta capture (capturing/conv_workspaces.py, issue 34).

The GPU reference is a real H100 history of torchvision's ResNet-50 (batch 64, fp32, SGD with
Nesterov momentum, two steps): ../shared/gpu-histories/h100-2026-11-27/. The model is written
here, layer for layer as torchvision's ``resnet50`` (its v1.5 bottleneck: the stride on the 3x3
convolution), so the test needs no torchvision; only the history's absence skips it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import vramkit.trace as vt
from vramkit.trace import CudaChoices
from vramkit.trace.capturing.conv_workspaces import ESTIMATE, OP_NAME, SPLIT_K, WGRAD_PARTIALS, workspace_bytes
from vramkit.trace.formats.file_format import ALLOC, CATEGORIES, FREE

# torch.cuda.max_memory_allocated() / max_memory_reserved() of the recorded run, from the
# history's README (H100 80GB HBM3, torch 2.11.0+cu130, torchvision 0.26.0).
GPU_MAX_ALLOCATED = 5_855_334_912
GPU_MAX_RESERVED = 7_014_973_440
HISTORY = "gpu-histories/h100-2026-11-27/resnet50_fp32_b64_sgd.pickle"
H100 = (9, 0)


def _history() -> Path | None:
    repo = Path(__file__).resolve().parents[2]
    for shared in (repo.parent / "shared", Path("/work/shared")):
        if (shared / HISTORY).is_file():
            return shared / HISTORY
    return None


class Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, width * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(width * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != width * 4:
            self.downsample = nn.Sequential(nn.Conv2d(cin, width * 4, 1, stride, bias=False),
                                            nn.BatchNorm2d(width * 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += x if self.downsample is None else self.downsample(x)  # torchvision's order
        return self.relu(out)


class ResNet50(nn.Module):
    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        cin, layers = 64, []
        for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            stage = []
            for j in range(blocks):
                stage.append(Bottleneck(cin, width, stride if j == 0 else 1))
                cin = width * 4
            layers.append(nn.Sequential(*stage))
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2048, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet50_step():
    """The history's builder (its README), with this file's ResNet-50."""
    torch.manual_seed(0)
    model = ResNet50()
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    x, y = torch.randn(64, 3, 224, 224), torch.randint(0, 1000, (64,))

    def step():
        loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def test_resnet50_reserved_within_2_percent_of_the_h100():
    if _history() is None:
        pytest.skip(f"the H100 history is not here ({HISTORY})")
    profile = vt.gpu_profile("H100-80GB")
    trace = vt.capture(resnet50_step, device="meta", steps=2, cuda=profile.cuda_choices())
    pred = vt.replay(trace, profile)
    assert abs(pred.peak_reserved / GPU_MAX_RESERVED - 1) < 0.02, pred.peak_reserved
    assert abs(pred.peak_allocated / GPU_MAX_ALLOCATED - 1) < 0.01, pred.peak_allocated
    assert "cudnn_workspaces" in trace.meta["estimated_bytes"]
    # the history's own replay sees the same reserved peak (its workspaces are real ones)
    from vramkit.trace.formats.snapshot_import import from_torch_snapshot
    real = vt.replay(from_torch_snapshot(str(_history())), profile)
    assert abs(real.peak_reserved / GPU_MAX_RESERVED - 1) < 0.01


def _conv_step(bias: bool = False):
    def build():
        conv = nn.Conv2d(8, 16, 3, 1, 1, bias=bias)
        x = torch.randn(2, 8, 10, 10, requires_grad=True)

        def step():
            conv(x).sum().backward()

        return step

    return build


def _events(trace):
    """(kind, op name, size) of the allocations and frees, in order."""
    out = []
    for e in range(trace.num_events):
        kind = int(trace.kind[e])
        if kind in (ALLOC, FREE):
            a = int(trace.id[e])
            out.append((kind, trace.ops[trace.alloc_op[a]], int(trace.size[e]), a))
    return out


def test_workspace_sizes_follow_the_model_on_a_small_conv():
    # Conv2d(8 -> 16, 3x3, pad 1) on a 2x8x10x10 fp32 input, H100 (TF32 engines, NCHW copies):
    # input 2*8*10*10*4 = 6,400 B, output 2*16*10*10*4 = 12,800 B, weight 16*8*3*3*4 = 4,608 B.
    forward = 6_400 + 12_800 + 4_608
    data = 6_400 + 12_800 + 4_608
    weight = 6_400 + 12_800 + 4_608 + WGRAD_PARTIALS * 4_608  # + 15 fp32 weight gradients
    shapes = dict(input_shape=(2, 8, 10, 10), weight_shape=(16, 8, 3, 3), output_shape=(2, 16, 10, 10),
                  stride=(1, 1), padding=(1, 1), groups=1, transposed=False, dtype=torch.float32, arch=H100)
    assert workspace_bytes("forward", **shapes) == forward
    assert workspace_bytes("backward_data", **shapes) == data
    assert workspace_bytes("backward_weight", **shapes) == weight
    # a 1x1 convolution over 12x12 = 144 positions runs as a GEMM: only backward-weight, 64
    # fp32 copies of the weight gradient (16*8*4 = 512 B): 32,768 B
    pointwise = dict(shapes, weight_shape=(16, 8, 1, 1), input_shape=(2, 8, 12, 12), output_shape=(2, 16, 12, 12),
                     padding=(0, 0))
    assert workspace_bytes("forward", **pointwise) == 0
    assert workspace_bytes("backward_weight", **pointwise) == SPLIT_K * 512 == 32_768
    # channels_last needs no layout copies; fp32 depthwise is PyTorch's own kernel
    assert workspace_bytes("forward", **shapes, channels_last=True) == 0
    depthwise = dict(shapes, weight_shape=(8, 1, 3, 3), output_shape=(2, 8, 10, 10), groups=8)
    assert workspace_bytes("forward", **depthwise) == 0

    trace = vt.capture(_conv_step(), device="meta", steps=1, cuda=CudaChoices(arch=H100))
    ev = _events(trace)
    ws = [(i, e) for i, e in enumerate(ev) if e[1] == OP_NAME and e[0] == ALLOC]
    assert [e[2] for _, e in ws] == [forward, data, weight]
    for i, (_, _, size, a) in ws:
        assert ev[i + 1] == (FREE, OP_NAME, size, a)  # freed at once
        assert CATEGORIES[int(trace.alloc_category[a])] == "workspace"
    # each right after its op's output: the forward's, grad_input's, grad_weight's
    outs = [e for e in ev if e[0] == ALLOC and e[1] in ("aten::convolution", "aten::convolution_backward")]
    assert [e[2] for e in outs] == [12_800, 6_400, 4_608]
    assert [ev[i - 1][2] for i, _ in ws] == [12_800, 6_400, 4_608]
    assert trace.meta["estimated_bytes"] == {"cudnn_workspaces": ESTIMATE}


def test_workspaces_off_removes_them_and_meta_equals_cpu():
    on = vt.capture(_conv_step(bias=True), device="meta", steps=1, cuda=CudaChoices(arch=H100))
    off = vt.capture(_conv_step(bias=True), device="meta", steps=1, cuda=CudaChoices(arch=H100, workspaces=False))
    cpu = vt.capture(_conv_step(bias=True), device="cpu", steps=1)
    assert any(e[1] == OP_NAME for e in _events(on))
    assert not any(e[1] == OP_NAME for e in _events(off))
    assert "estimated_bytes" not in off.meta
    assert CudaChoices.off().workspaces is False
    # with the workspaces taken out, the split backward makes the same allocations
    assert [e[1:3] for e in _events(on) if e[1] != OP_NAME] == [e[1:3] for e in _events(off)]
    meta_off = vt.capture(_conv_step(bias=True), device="meta", steps=1, cuda=CudaChoices.off())
    assert [e[:3] for e in _events(meta_off)] == [e[:3] for e in _events(cpu)]


def test_workspace_switch_is_checked():
    with pytest.raises(TypeError):
        CudaChoices(workspaces=1)  # type: ignore[arg-type]


def test_a_prediction_says_how_much_of_its_peak_is_estimated():
    """Issue 34 part 2: the report says how much of the peak is modelled rather than seen."""
    MiB = 1 << 20
    # a (4 MiB, seen), b (2 MiB, estimated), both live at the peak; then c (1 MiB, estimated) alone
    kind, ids, size = [0, 0, 1, 1, 0, 1], [0, 1, 0, 1, 2, 2], [4 * MiB, 2 * MiB, 4 * MiB, 2 * MiB, MiB, MiB]
    meta = {"estimated_bytes": {"cudnn_workspaces": "modelled"}}
    trace = vt.Trace.from_columns(kind=kind, id=ids, size=size, alloc_op=[0, 1, 1], ops=["aten::mm", "ws (estimated)"],
                                  meta=meta)
    p = vt.replay(trace, "1GiB", overheads=vt.NO_OVERHEADS)
    assert p.peak_allocated == 6 * MiB and p.estimated_at_peak == 2 * MiB
    assert p.estimates == {"cudnn_workspaces": "modelled"}
    assert "estimated sizes" in p.table() and "2.00 MiB of what is allocated at the peak" in p.table()
    # at an OOM: what was live when the failing request came
    oom = vt.replay(trace, 5 * MiB, overheads=vt.NO_OVERHEADS)
    assert not oom.fits and oom.estimated_at_peak == 0  # b (estimated) is the request that failed
    # nothing estimated, or meta from a file that is not well-formed: no line
    plain = vt.Trace.from_columns(kind=kind, id=ids, size=size, meta={"estimated_bytes": ["not", "a", "dict"]})
    p = vt.replay(plain, "1GiB", overheads=vt.NO_OVERHEADS)
    assert p.estimates == {} and p.estimated_at_peak == 0 and "estimated sizes" not in p.table()
