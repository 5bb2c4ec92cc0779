"""Llama-architecture models fine-tuned with FSDP2, for `vramkit fit --world-size` (docs/will-it-fit.md).

    python -m vramkit fit examples/llama_fsdp.py --world-size 8 --gpu H100-80GB --batch-size 1
    python -m vramkit fit examples/llama_fsdp.py --entry vramkit_step_70b --world-size 64 --gpu H100-80GB --batch-size 1

The model is Hugging Face's `LlamaForCausalLM` (needs `pip install transformers`) built from a
config with random weights: 8B as Llama 3 8B (hidden 4096, 32 layers, 32 heads over 8 key/value
heads, vocabulary 128256) and 70B as Llama 3 70B (hidden 8192, 80 layers, 64 heads over 8).
The model is made on meta, each decoder layer and the root are `fully_shard`ed with a bf16
`MixedPrecisionPolicy` (fp32 master weights and AdamW state, bf16 compute, fp32 gradient
reduction), then `to_empty` allocates only this rank's shards: the usual FSDP2 recipe.
The script calls `init_process_group` itself, as a torchrun script does; under `vramkit fit
--world-size` that call joins the capture's process group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

SEQ = 2048


def _builder(hidden: int, layers: int, heads: int, intermediate: int, checkpointed: bool = False):
    def build(batch_size: int):
        import transformers
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if not dist.is_initialized():
            dist.init_process_group("nccl")
        config = transformers.LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                          num_key_value_heads=8, intermediate_size=intermediate, vocab_size=128256,
                                          max_position_embeddings=SEQ, rope_theta=500000.0)
        device = torch.get_default_device()  # meta under vramkit fit; set it to cuda:LOCAL_RANK under torchrun
        with torch.device("meta"):  # FSDP2's recipe: shard first, then allocate only this rank's shards
            model = transformers.LlamaForCausalLM(config)
        if checkpointed:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        model.to_empty(device=device)
        with torch.no_grad():  # weights from the config's initializer (a checkpoint would be loaded here)
            model.apply(model._init_weights)
        model.model.rotary_emb.to(device)  # its inv_freq buffer is computed, not a parameter
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        ids = torch.randint(0, config.vocab_size, (batch_size, SEQ))

        def step() -> None:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step

    return build


vramkit_step = _builder(4096, 32, 32, 14336)                               # Llama 3 8B
vramkit_step_checkpointed = _builder(4096, 32, 32, 14336, checkpointed=True)
vramkit_step_70b = _builder(8192, 80, 64, 28672)                           # Llama 3 70B
vramkit_step_70b_checkpointed = _builder(8192, 80, 64, 28672, checkpointed=True)
