"""A Llama-architecture model fine-tuned with DDP, for `vramkit fit --world-size` (docs/will-it-fit.md).

    python -m vramkit fit examples/llama_ddp.py --world-size 8 --gpu L4 --batch-size 1

The model is Hugging Face's `LlamaForCausalLM` (needs `pip install transformers`) built from a
config with random weights, shaped as Llama 3.2 3B (hidden 3072, 28 layers, 24 heads over 8
key/value heads, vocabulary 128256), trained in fp32 with AdamW under DistributedDataParallel:
the script most people start from. DDP keeps a whole copy of the model, its gradients and its
optimizer state on every GPU, so adding GPUs does not make it fit; `vramkit fit` says so, and
tries FSDP2 (`fully_shard` on each decoder layer and the model) in its place.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

SEQ = 2048


def vramkit_step(batch_size: int):
    import transformers

    if not dist.is_initialized():
        dist.init_process_group("nccl")
    device = torch.get_default_device()  # meta under vramkit fit; cuda:LOCAL_RANK under torchrun
    config = transformers.LlamaConfig(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24,
                                      num_key_value_heads=8, intermediate_size=8192, vocab_size=128256,
                                      max_position_embeddings=SEQ, rope_theta=500000.0, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(config).to(device)
    model = DistributedDataParallel(model, device_ids=[int(os.environ.get("LOCAL_RANK", 0))]
                                    if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, config.vocab_size, (batch_size, SEQ))

    def step() -> None:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step
