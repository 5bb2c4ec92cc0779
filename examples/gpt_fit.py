"""A GPT-style decoder (1.3B parameters) for `vramkit fit` (docs/will-it-fit.md).

    python -m vramkit fit "$(python -c 'import vramkit.examples, os; print(os.path.dirname(vramkit.examples.__file__))')/gpt_fit.py" \\
        --device-memory 24GiB --batch-size 8

`vramkit fit` loads this file without running its __main__ block and calls a builder:
`vramkit_step(batch_size)` builds the model, the optimizer and one batch (on the meta device
under vramkit, so nothing is allocated) and returns the training step. The other builders are
the same step with one memory technique applied; pick one with --entry.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

VOCAB, SEQ, DIM, HEADS, LAYERS = 50304, 1024, 2048, 16, 24


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.fc, self.out = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, HEADS, -1).transpose(1, 2) for z in self.qkv(self.ln1(x)).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, DIM)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        self.checkpointed = checkpointed
        self.tok, self.pos = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return self.head(self.ln(x))


def _builder(dtype: torch.dtype = torch.float32, checkpointed: bool = False, amp: bool = False):
    def build(batch_size: int):
        model = GPT(checkpointed).to(dtype)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
        idx = torch.randint(0, VOCAB, (batch_size, SEQ))

        def step() -> None:
            # Mixed precision as PyTorch's AMP recipe writes it; vramkit emulates it on meta.
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
                logits = model(idx)
                loss = F.cross_entropy(logits.view(-1, VOCAB).float(), idx.view(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step

    return build


vramkit_step = _builder()                                   # float32 weights, AdamW
vramkit_step_amp = _builder(amp=True)                       # torch.autocast bf16 forward, float32 weights
vramkit_step_bf16 = _builder(torch.bfloat16)                 # bfloat16 weights, gradients and AdamW state
vramkit_step_checkpointed = _builder(checkpointed=True)      # every block recomputed in the backward
vramkit_step_bf16_checkpointed = _builder(torch.bfloat16, checkpointed=True)


if __name__ == "__main__":
    with torch.device("meta"):
        n = sum(p.numel() for p in GPT().parameters())
    print(f"{n / 1e9:.2f}B parameters; "
          "run it through `python -m vramkit fit` (see docs/will-it-fit.md)")
