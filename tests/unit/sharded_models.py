"""Small models and sharded training steps for the distributed tests: a GPT-style decoder and a
CNN, wrapped with DDP, FSDP2 (reshard after forward or not; bf16 parameters with checkpointed
blocks, the GPT's; deferred initialization: built on meta, sharded, then ``to_empty``) or
ZeroRedundancyOptimizer. A builder makes the model, the wrapper, AdamW and one batch
on the current default device, using whatever default process group is initialized, and
returns the step (two lines, as a training loop writes them)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

VOCAB, DIM, LAYERS, SEQ, HEADS = 1003, 96, 3, 32, 4  # 1003: parameters not divisible by the world size
STRATEGIES = ["ddp", "fsdp2", "fsdp2-no-reshard", "fsdp2-bf16-checkpointed", "fsdp2-deferred", "zero"]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.fc, self.out = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)
        self.checkpointed = False

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, HEADS, -1).transpose(1, 2) for z in self.qkv(self.ln1(x)).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, DIM)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # GroupNorm, not BatchNorm: FSDP2 casts parameters to bf16 but not buffers, and the CPU's
        # batch norm refuses bf16 inputs with fp32 running statistics (CUDA's accepts them).
        self.blocks = nn.ModuleList(nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.GroupNorm(4, c_out), nn.ReLU())
                                    for c_in, c_out in ((3, 24), (24, 48), (48, 48)))
        self.head = nn.Linear(48, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = F.max_pool2d(block(x), 2)
        return self.head(x.mean((2, 3)))


def builder(model_name: str, strategy: str, batch: int = 4):
    """A builder of `strategy` training steps for model `model_name` ("gpt" or "cnn")."""
    if strategy not in STRATEGIES:
        raise ValueError(strategy)

    def build():
        torch.manual_seed(0)
        device = torch.get_default_device()
        with torch.device("meta" if strategy == "fsdp2-deferred" else device):  # FSDP2's shard-then-allocate recipe
            model = GPT() if model_name == "gpt" else CNN()
        if strategy == "fsdp2-bf16-checkpointed" and model_name == "gpt":
            for block in model.blocks:
                block.checkpointed = True
        if strategy == "ddp":
            model = nn.parallel.DistributedDataParallel(model)
        elif strategy.startswith("fsdp2"):
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
                if "bf16" in strategy else MixedPrecisionPolicy()
            reshard = strategy != "fsdp2-no-reshard"
            for block in model.blocks:
                fully_shard(block, reshard_after_forward=reshard, mp_policy=mp)
            fully_shard(model, reshard_after_forward=reshard, mp_policy=mp)
            if strategy == "fsdp2-deferred":
                model.to_empty(device=device)
                with torch.no_grad():
                    for module in model.modules():
                        if hasattr(module, "reset_parameters"):
                            module.reset_parameters()
        if strategy == "zero":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return training_step(model_name, model, opt, batch)

    return build


def training_step(model_name: str, model: nn.Module, opt: torch.optim.Optimizer, batch: int):
    """One batch on the current default device, and the step over it (two lines, as a training
    loop writes them)."""
    if model_name == "gpt":
        x = torch.randint(0, VOCAB, (batch, SEQ))
        loss_of = lambda: F.cross_entropy(model(x).view(-1, VOCAB).float(), x.view(-1))  # noqa: E731
    else:
        x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
        loss_of = lambda: F.cross_entropy(model(x), y)  # noqa: E731

    def step() -> None:
        loss_of().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def measure_rank(rank: int, world_size: int, store_file: str, configs: list[tuple[str, str]], out_dir: str,
                 repeats: int = 3) -> None:
    """One rank of a real gloo job (torch.multiprocessing.spawn's target). The ranks meet through
    a FileStore at `store_file`, a path no earlier job used, as PyTorch's own multi-process tests
    do: no port to choose (a port found free and closed again can be taken by another process
    before the store binds it). For each (model, strategy): build and run two steps under
    torch.profiler `repeats` times, and write rank<r>.json with, per figure of
    ``peaks.allocator_peaks`` (the allocator's own accounting, nothing of vramkit's), the
    smallest over the runs and every run's value ("<figure>_runs"): a gloo work keeps its
    tensors until its worker thread lets go of it, at its own pace, so a buffer FSDP2 has
    dropped outlives it now and then, in some runs."""
    import gc
    import json
    import os

    import torch.distributed as dist

    from peaks import profiler_total_peak

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, store=dist.FileStore(store_file, world_size))
    results = {}
    try:
        for model, strategy in configs:
            runs = []
            for _ in range(repeats):
                gc.collect()
                runs.append(profiler_total_peak(builder(model, strategy), steps=2))
            row = {k: min(r[k] for r in runs) for k in runs[0]}
            row.update({f"{k}_runs": [r[k] for r in runs] for k in runs[0]})
            results[f"{model}/{strategy}"] = row
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()
