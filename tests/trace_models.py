"""Models for the predict tests, written here: a GPT-style decoder and a ResNet-style CNN, with
builders in the form vramkit.trace.capture and fit take (build(batch_size) -> step)."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.utils.checkpoint
from torch import nn
from torch.nn import functional as F


@dataclass
class GPTConfig:
    vocab: int = 512
    seq: int = 64
    dim: int = 64
    heads: int = 4
    layers: int = 2
    mlp_ratio: int = 4
    sdpa: bool = True  # scaled_dot_product_attention, else attention written out with matmul/softmax
    checkpoint: bool = False  # torch.utils.checkpoint around each block (recomputed in the backward)

    @property
    def num_params(self) -> int:
        d = self.dim
        per_layer = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (self.mlp_ratio * d * d + self.mlp_ratio * d) + \
            (self.mlp_ratio * d * d + d)
        return self.vocab * d + self.seq * d + self.layers * per_layer + 2 * d + d * self.vocab


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.cfg.heads
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
        if self.cfg.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(d // h)
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
            y = att @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim), nn.GELU(),
                                 nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for layer in self.layers:
            if self.cfg.checkpoint:
                x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
        return self.head(self.ln_f(x))


def _amp(device_type: str | None):
    """The autocast region of a mixed-precision step (bfloat16), or none."""
    if device_type is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=torch.bfloat16)


def gpt_builder(cfg: GPTConfig, lr: float = 1e-3, amp: str | None = None, amp_loss: bool = True):
    def build(batch_size: int):
        torch.manual_seed(0)
        model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        idx = torch.randint(0, cfg.vocab, (batch_size, cfg.seq))
        tgt = torch.randint(0, cfg.vocab, (batch_size, cfg.seq))

        def step():
            with _amp(amp):
                logits = model(idx)
                if amp_loss:  # the loss inside the autocast region, as PyTorch's AMP recipe has it
                    loss = F.cross_entropy(logits.view(-1, cfg.vocab), tgt.view(-1))
            if not amp_loss:
                loss = F.cross_entropy(logits.view(-1, cfg.vocab), tgt.view(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    return build


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    def __init__(self, widths=(16, 32, 64), blocks=(1, 1, 1), classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU())
        stages, cin = [], widths[0]
        for i, (w, n) in enumerate(zip(widths, blocks)):
            layers = []
            for j in range(n):
                layers.append(BasicBlock(cin, w, 2 if (j == 0 and i > 0) else 1))
                cin = w
            stages.append(nn.Sequential(*layers))
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def resnet_builder(widths=(16, 32, 64), blocks=(1, 1, 1), image: int = 32, classes: int = 10,
                   amp: str | None = None):
    def build(batch_size: int):
        torch.manual_seed(0)
        model = ResNet(widths, blocks, classes)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        x = torch.randn(batch_size, 3, image, image)
        y = torch.randint(0, classes, (batch_size,))

        def step():
            with _amp(amp):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    return build
