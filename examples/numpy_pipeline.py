"""An image-batch pipeline feeding a small MLP trained with plain NumPy in mixed precision.

This is the workload `python -m vramkit run` profiles when given no script. It has the memory
shape of a real training loop: a resident dataset, weights and gradients that live for the
whole run, and per-step temporaries (decoded batches, padded crops, normalised copies,
activations) that come and go. Run it directly too: `python numpy_pipeline.py --steps 60`.

Mixed precision (the default, `--precision fp16`): activations and gradients are stored in
float16 (matrix products accumulate in float32, as tensor cores do), the weights stay float32,
and a vramkit.amp.GradScaler scales the loss so small gradients survive float16; it unscales
the float16 gradients in one fused pass, skips steps whose gradients overflowed and adapts
the scale. `--precision fp32` trains the same model without it.

Synthetic data: each of 10 classes is a smooth colour pattern; samples are the pattern plus
noise, stored as uint8 images like a decoded dataset would be. Seeded, so every run is the same.

When PyTorch is installed a second part follows (checkpointed_mlp.py): a 24-block residual MLP
trained with vramkit.checkpoint inside 30 % of its activation memory; it prints the plan, the
predicted and measured peaks and the step time against storing everything.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator

import numpy as np

from vramkit.amp import GradScaler

NUM_CLASSES = 10
IMAGE = (3, 64, 64)  # channels, height, width
PAD = 4  # pixels of reflection padding before the random crop


def make_dataset(rng: np.random.Generator, n: int, chunk: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """n uint8 images (n, 3, 64, 64) and their labels, "decoded" a chunk at a time."""
    c, h, w = IMAGE
    yy, xx = np.meshgrid(np.linspace(0, 1, h, dtype=np.float32), np.linspace(0, 1, w, dtype=np.float32),
                         indexing="ij")
    templates = np.empty((NUM_CLASSES, c, h, w), np.float32)
    for k in range(NUM_CLASSES):
        fy, fx, phase = rng.uniform(1, 4, size=(3, c)).astype(np.float32)
        for ch in range(c):
            templates[k, ch] = np.sin(2 * np.pi * (fy[ch] * yy + phase[ch])) * np.cos(2 * np.pi * fx[ch] * xx)
    labels = rng.integers(0, NUM_CLASSES, size=n)
    images = np.empty((n, c, h, w), np.uint8)
    for start in range(0, n, chunk):
        pixels = templates[labels[start:start + chunk]]
        pixels += rng.standard_normal(pixels.shape, dtype=np.float32) * 1.5
        images[start:start + chunk] = np.clip(128 + 60 * pixels, 0, 255)
    return images, labels


def batches(images: np.ndarray, labels: np.ndarray, batch_size: int,
            rng: np.random.Generator) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Shuffled batches, epoch after epoch (the indexing copies each batch, like a data loader)."""
    while True:
        order = rng.permutation(len(images))
        for start in range(0, len(order) - batch_size + 1, batch_size):
            idx = order[start:start + batch_size]
            yield images[idx], labels[idx]


def augment(batch: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """uint8 (B, 3, H, W) -> float32 in [0, 1] with random flips, padded random crops and brightness."""
    x = batch.astype(np.float32) / 255.0
    flip = rng.random(len(x)) < 0.5
    x[flip] = x[flip][..., ::-1]
    padded = np.pad(x, ((0, 0), (0, 0), (PAD, PAD), (PAD, PAD)), mode="reflect")
    dy, dx = rng.integers(0, 2 * PAD + 1, size=2)
    h, w = IMAGE[1:]
    x = padded[:, :, dy:dy + h, dx:dx + w].copy()
    x *= rng.uniform(0.8, 1.2, size=(len(x), 1, 1, 1)).astype(np.float32)
    return x


def normalize(x: np.ndarray) -> np.ndarray:
    """Per-channel standardisation, flattened to (B, 3*H*W) for the MLP."""
    mean = x.mean(axis=(0, 2, 3), keepdims=True)
    std = x.std(axis=(0, 2, 3), keepdims=True) + 1e-5
    return ((x - mean) / std).reshape(len(x), -1)


class MLP:
    """Two dense layers with ReLU, softmax cross-entropy, manual backward and SGD with momentum."""

    def __init__(self, rng: np.random.Generator, n_in: int, n_hidden: int, n_out: int) -> None:
        self.w1 = (rng.standard_normal((n_in, n_hidden)) * np.sqrt(2.0 / n_in)).astype(np.float32)
        self.b1 = np.zeros(n_hidden, np.float32)
        self.w2 = (rng.standard_normal((n_hidden, n_out)) * np.sqrt(1.0 / n_hidden)).astype(np.float32)
        self.b2 = np.zeros(n_out, np.float32)
        self.velocity = [np.zeros_like(p) for p in self.params()]

    def params(self) -> list[np.ndarray]:
        return [self.w1, self.b1, self.w2, self.b2]

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        h = np.maximum(x @ self.w1 + self.b1, 0.0)
        return h, h @ self.w2 + self.b2

    def loss_and_grads(self, x: np.ndarray, y: np.ndarray, dtype: type = np.float32,
                       loss_scale: float = 1.0) -> tuple[float, float, list[np.ndarray]]:
        """Loss, accuracy and the gradients of loss * loss_scale, stored in `dtype`."""

        def mm(a: np.ndarray, b: np.ndarray) -> np.ndarray:  # `dtype` storage, float32 accumulation
            return (a.astype(np.float32, copy=False) @ b.astype(np.float32, copy=False)).astype(dtype, copy=False)

        x = x.astype(dtype, copy=False)
        h = np.maximum(mm(x, self.w1) + self.b1.astype(dtype), 0)
        logits = mm(h, self.w2).astype(np.float32) + self.b2
        logits -= logits.max(axis=1, keepdims=True)
        p = np.exp(logits)
        p /= p.sum(axis=1, keepdims=True)
        n = len(y)
        loss = float(-np.log(p[np.arange(n), y] + 1e-12).mean())
        accuracy = float((p.argmax(axis=1) == y).mean())
        dlogits = p
        dlogits[np.arange(n), y] -= 1.0
        dlogits *= loss_scale / n
        dlogits = dlogits.astype(dtype)
        dw2 = mm(h.T, dlogits)
        dh = mm(dlogits, self.w2.T)
        dh[h <= 0] = 0
        dw1 = mm(x.T, dh)
        return loss, accuracy, [dw1, dh.sum(axis=0, dtype=np.float32).astype(dtype), dw2,
                                dlogits.sum(axis=0, dtype=np.float32).astype(dtype)]

    def sgd_step(self, grads: list[np.ndarray], lr: float, momentum: float = 0.9) -> None:
        for p, v, g in zip(self.params(), self.velocity, grads):
            v *= momentum
            v += g  # float16 gradients are widened here; the weights stay float32
            p -= lr * v


def train(steps: int, batch_size: int, seed: int, precision: str = "fp16") -> list[float]:
    """Train for `steps` batches; returns the loss of every step."""
    rng = np.random.default_rng(seed)
    images, labels = make_dataset(rng, n=16 * batch_size)
    model = MLP(rng, n_in=int(np.prod(IMAGE)), n_hidden=128, n_out=NUM_CLASSES)
    mixed = precision == "fp16"
    scaler = GradScaler("cpu", init_scale=2.0 ** 24, enabled=mixed, growth_interval=20)
    first_scale, skipped = scaler.get_scale(), 0
    losses: list[float] = []
    window: list[tuple[float, float]] = []  # (loss, accuracy) since the last printed line
    for step, (raw, y) in enumerate(batches(images, labels, batch_size, rng), 1):
        x = normalize(augment(raw, rng))
        # A float16 gradient overflowing is expected now and then: the scaler finds it and skips the step.
        with np.errstate(over="ignore", invalid="ignore"):
            loss, accuracy, grads = model.loss_and_grads(x, y, np.float16 if mixed else np.float32,
                                                         loss_scale=scaler.scale(1.0))
        _, found_inf = scaler.step(grads, step_fn=lambda: model.sgd_step(grads, lr=0.002), return_found_inf=True)
        scaler.update()
        skipped += found_inf
        losses.append(loss)
        window.append((loss, accuracy))
        if step % 10 == 0 or step == steps:
            mean_loss, mean_accuracy = np.mean(window, axis=0)
            print(f"step {step:3d}  loss {mean_loss:.3f}  train accuracy {mean_accuracy:.2f}"
                  + (f"  loss scale {scaler.get_scale():g}" if mixed else ""))
            window.clear()
        if step == steps:
            if mixed:
                print(f"mixed precision: loss scale {first_scale:g} -> {scaler.get_scale():g}, {skipped} of {steps} "
                      f"steps skipped for inf/NaN gradients (vramkit.amp.GradScaler, {scaler_path()} kernel)")
            return losses
    raise AssertionError("unreachable: batches() never ends")


def scaler_path() -> str:
    from vramkit.amp import simd_path

    return simd_path()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    parser.add_argument("--batch-size", type=int, default=64, help="images per batch (default 64)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--precision", choices=("fp16", "fp32"), default="fp16",
                        help="fp16: float16 activations and gradients with loss scaling (default); fp32: plain")
    parser.add_argument("--no-checkpoint", action="store_true",
                        help="skip the second part (a PyTorch model trained with a planned checkpoint schedule)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    losses = train(args.steps, args.batch_size, args.seed, args.precision)
    print(f"trained {args.steps} steps of {args.batch_size} images {IMAGE} in "
          f"{time.perf_counter() - start:.1f} s: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    if not args.no_checkpoint:
        checkpoint_part()


def checkpoint_part() -> None:
    """With PyTorch installed: a 24-block MLP trained within 30 % of its activation memory
    (checkpointed_mlp.py, next to this file)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        print("\n(activation checkpointing part skipped: PyTorch is not installed)")
        return
    import checkpointed_mlp  # this script's directory is on sys.path, as for `python SCRIPT`

    checkpointed_mlp.run()


if __name__ == "__main__":
    main()
