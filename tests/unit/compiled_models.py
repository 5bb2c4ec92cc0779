"""Steps that call ``torch.compile``d models, and their real peaks (issue 33).

The reference is independent of vramkit: the same step really compiled by inductor for the
CPU and run on real CPU tensors, its peak read from torch.profiler's allocator events
(``peaks.profiler_peaks``). The prediction is a meta capture of the step (``peaks.step_peak``).

``python tests/unit/compiled_models.py`` prints the table of real eager, real compiled,
predicted eager and predicted compiled peaks for the models below (a few minutes: inductor
compiles each model for the CPU with the C++ compiler once; its cache keeps the kernels).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trace_models import GPT, GPTConfig, ResNet  # noqa: E402

Backend = str | None  # None: eager; else torch.compile's backend


def _compiled(model: nn.Module, backend: Backend, dynamic: bool | None = None) -> Callable[..., Any]:
    return model if backend is None else torch.compile(model, backend=backend, dynamic=dynamic)


def gpt_step(cfg: GPTConfig, backend: Backend) -> Callable[[int], Callable[[], None]]:
    def build(batch: int) -> Callable[[], None]:
        torch.manual_seed(0)
        model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        forward = _compiled(model, backend)
        idx = torch.randint(0, cfg.vocab, (batch, cfg.seq))
        tgt = torch.randint(0, cfg.vocab, (batch, cfg.seq))

        def step() -> None:
            logits = forward(idx)
            F.cross_entropy(logits.view(-1, cfg.vocab), tgt.view(-1)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    return build


class WithLoss(nn.Module):
    """A model and its loss in one module, so the compiled region holds the cross-entropy too
    (as a Hugging Face causal LM's forward does with ``labels=``)."""

    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        logits = self.model(idx)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), tgt.view(-1))


def gpt_loss_step(cfg: GPTConfig, backend: Backend, compile_optimizer: bool = False) -> Callable[[int], Callable[[], None]]:
    def build(batch: int) -> Callable[[], None]:
        torch.manual_seed(0)
        model = WithLoss(GPT(cfg))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        forward = _compiled(model, backend)
        opt_step = torch.compile(opt.step, backend=backend) if compile_optimizer and backend else opt.step
        idx = torch.randint(0, cfg.vocab, (batch, cfg.seq))
        tgt = torch.randint(0, cfg.vocab, (batch, cfg.seq))

        def step() -> None:
            forward(idx, tgt).backward()
            opt_step()
            opt.zero_grad(set_to_none=True)

        return step

    return build


class MLP(nn.Module):
    def __init__(self, d: int = 512, hidden: int = 2048, layers: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, hidden), nn.GELU(),
                                                  nn.Linear(hidden, d)) for _ in range(layers))
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _classifier_step(make: Callable[[], nn.Module], sample: tuple[int, ...], backend: Backend,
                     dynamic: bool | None = None) -> Callable[[int], Callable[[], None]]:
    """A 10-class classifier trained with SGD and momentum on random inputs of shape `sample`."""
    def build(batch: int) -> Callable[[], None]:
        torch.manual_seed(0)
        model = make()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        forward = _compiled(model, backend, dynamic)
        x = torch.randn(batch, *sample)
        y = torch.randint(0, 10, (batch,))

        def step() -> None:
            F.cross_entropy(forward(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    return build


def optimizer_step(optimizer: str, compile_step: bool, backend: str = "inductor") -> Callable[[int], Callable[[], None]]:
    """A step whose peak is the optimizer's (parameters dominate: 4 x 1 MiB), foreach as on a
    GPU, its ``optimizer.step`` compiled (or not)."""
    def build(batch: int) -> Callable[[], None]:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)])
        opt = getattr(torch.optim, optimizer)(model.parameters(), lr=1e-3, foreach=True)
        step_opt = torch.compile(opt.step, backend=backend) if compile_step else opt.step
        x = torch.randn(batch, 512)

        def step() -> None:
            model(x).sum().backward()
            step_opt()
            opt.zero_grad(set_to_none=True)

        return step

    return build


def mlp_step(backend: Backend, d: int = 512, dynamic: bool | None = None) -> Callable[[int], Callable[[], None]]:
    return _classifier_step(lambda: MLP(d), (d,), backend, dynamic)


def cnn_step(backend: Backend, size: int = 32) -> Callable[[int], Callable[[], None]]:
    return _classifier_step(ResNet, (3, size, size), backend)


def hf_lm_step(family: str, backend: Backend, seq: int = 256, hidden: int = 256,
               vocab: int = 8192) -> Callable[[int], Callable[[], None]]:
    """A Hugging Face causal LM (built from a config, nothing downloaded) with its loss in its
    forward (``labels=``), as the issue's 0.5B Qwen2-class model was trained; needs transformers."""
    import transformers as T

    def build(batch: int) -> Callable[[], None]:
        torch.manual_seed(0)
        if family == "qwen2":
            cfg: Any = T.Qwen2Config(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab)
            model: nn.Module = T.Qwen2ForCausalLM(cfg)
        elif family == "llama":  # grouped-query attention: 8 query heads share 2 key/value heads
            cfg = T.LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                                num_attention_heads=8, num_key_value_heads=2, vocab_size=vocab)
            model = T.LlamaForCausalLM(cfg)
        else:
            cfg = T.GPT2Config(n_embd=hidden, n_layer=2, n_head=4, vocab_size=vocab, n_positions=seq,
                               bos_token_id=0, eos_token_id=0)
            model = T.GPT2LMHeadModel(cfg)
        model.train()
        opt = torch.optim.AdamW(model.parameters())
        forward = _compiled(model, backend)
        ids = torch.randint(0, cfg.vocab_size, (batch, seq))

        def step() -> None:
            forward(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            opt.step()
            opt.zero_grad()

        return step

    return build


def hf_vit_step(backend: Backend, image: int = 64, hidden: int = 128) -> Callable[[int], Callable[[], None]]:
    """A Hugging Face ViT image classifier (from a config) with its loss in its forward."""
    import transformers as T

    def build(batch: int) -> Callable[[], None]:
        torch.manual_seed(0)
        cfg = T.ViTConfig(image_size=image, patch_size=8, hidden_size=hidden, num_hidden_layers=2,
                          num_attention_heads=4, intermediate_size=2 * hidden, num_labels=10)
        model = T.ViTForImageClassification(cfg)
        model.train()
        opt = torch.optim.AdamW(model.parameters())
        forward = _compiled(model, backend)
        x = torch.randn(batch, 3, image, image)
        y = torch.randint(0, 10, (batch,))

        def step() -> None:
            forward(pixel_values=x, labels=y).loss.backward()
            opt.step()
            opt.zero_grad()

        return step

    return build


GPT_SMALL = GPTConfig(vocab=512, seq=64, dim=64, heads=4, layers=2)
GPT_MEASURED = GPTConfig(vocab=1024, seq=256, dim=256, heads=4, layers=2)
GPT_LM = GPTConfig(vocab=8192, seq=256, dim=256, heads=4, layers=2)  # the loss's logits dominate

MODELS: dict[str, Callable[[Backend], Callable[[int], Callable[[], None]]]] = {
    "gpt-small": lambda b: gpt_step(GPT_SMALL, b),
    "gpt-d256-s256": lambda b: gpt_step(GPT_MEASURED, b),
    "gpt-lm-loss": lambda b: gpt_loss_step(GPT_LM, b),
    "gpt-lm-loss-opt": lambda b: gpt_loss_step(GPT_LM, b, compile_optimizer=True),
    "hf-qwen2": lambda b: hf_lm_step("qwen2", b),
    "hf-gpt2": lambda b: hf_lm_step("gpt2", b),
    "hf-llama-gqa": lambda b: hf_lm_step("llama", b),
    "hf-vit": hf_vit_step,
    "mlp": mlp_step,
    "adamw-step": lambda b: optimizer_step("AdamW", b is not None, b or "inductor"),
    "cnn": cnn_step,
}


def real_peak(build: Callable[[int], Callable[[], None]], batch: int) -> int:
    """Peak of a real CPU run's allocator events over two steps (the first compiles), with
    what each operator allocates and frees inside itself left out (``profiler_peaks``'
    netted figure: a CPU kernel's scratch, which the capture's op-level record never sees)."""
    from peaks import profiler_peaks

    import gc

    torch._dynamo.reset()  # a fresh compile per model: no recompile limit reached across models
    # Earlier runs' garbage collected first: a cycle holding real tensors, freed by a collection
    # during this run, would count as a negative allocation and lower its peak.
    gc.collect()
    step = build(batch)
    return profiler_peaks(step, steps=2)[1]


def predicted_peak(build: Callable[[int], Callable[[], None]], batch: int) -> tuple[int, Any]:
    """A meta capture's step peak, CUDA's dispatch choices off (the CPU's code paths), and
    the trace's compiled regions."""
    import vramkit.trace as vt
    from peaks import step_peak

    trace = vt.capture(build, batch, device="meta", steps=2, cuda=False)
    return step_peak(trace), trace.meta.get("compiled_regions")


def table(rows: list[tuple[str, int]], backend: str = "inductor") -> list[str]:
    import time

    lines = [f"{'model':<16}{'batch':>6}{'real eager':>13}{'real compiled':>15}{'pred eager':>13}"
             f"{'pred compiled':>15}{'pred/real compiled':>20}{'capture s':>11}"]
    for name, batch in rows:
        eager_real = real_peak(MODELS[name](None), batch)
        compiled_real = real_peak(MODELS[name](backend), batch)
        eager_pred, _ = predicted_peak(MODELS[name](None), batch)
        started = time.monotonic()
        compiled_pred, regions = predicted_peak(MODELS[name](backend), batch)
        seconds = time.monotonic() - started
        lines.append(f"{name:<16}{batch:>6}{eager_real:>13,}{compiled_real:>15,}{eager_pred:>13,}"
                     f"{compiled_pred:>15,}{compiled_pred / compiled_real:>20.6f}{seconds:>11.1f}")
        print(lines[-1], [(r["how"], r.get("fused")) for r in regions or []], flush=True)
    return lines


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--gc-off", action="store_true",
                        help="no garbage collection: a buffer held by a reference cycle (Hugging Face GPT-2's "
                             "logits) is freed when the collector runs, at moments that differ between a real run "
                             "and a capture (which makes more Python objects)")
    parser.add_argument("rows", nargs="*", help="model:batch (default: all)")
    ns = parser.parse_args()
    if ns.gc_off:
        import gc

        gc.disable()
    wanted = [(r.split(":")[0], int(r.split(":")[1])) for r in ns.rows] or \
        [("mlp", 64), ("cnn", 8), ("gpt-small", 4), ("gpt-d256-s256", 4), ("gpt-d256-s256", 8),
         ("gpt-lm-loss", 4), ("gpt-lm-loss", 8), ("gpt-lm-loss-opt", 4), ("hf-qwen2", 4), ("hf-gpt2", 4)]
    print("\n".join(table(wanted, ns.backend)))
