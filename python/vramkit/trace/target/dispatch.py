"""``CudaChoices``: the dispatch choices a CUDA run on the target GPU makes and a meta run would
make differently (dropout's mask, the optimizer's foreach implementation, the attention
backend, how long NCCL holds DDP's buckets, cuDNN's convolution workspaces, RMSNorm's fused kernel), and the architecture
they depend on.

Plain data, without torch: a ``Target`` carries them (``Target.cuda_choices()``), and
``capturing/cuda_choices.py`` installs them for one capture (see its docstring for what each
choice does and where in PyTorch it is made).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CudaChoices"]


@dataclass(frozen=True)
class CudaChoices:
    """Which CUDA dispatch choices a meta capture makes, for which GPU architecture."""

    dropout: bool = True
    optimizer: bool = True
    attention: bool = True
    workspaces: bool = True  # cuDNN's convolution workspaces, modelled (capturing/conv_workspaces.py)
    rms_norm: bool = True  # RMSNorm as CUDA's fused kernel runs it (capturing/rms_norm_cuda.py)
    arch: tuple[int, int] = (9, 0)  # compute capability of the target GPU (H100: 9.0)
    # A bucket DDP all-reduced is held, at its free, until DDP's next all-reduce starts (or the
    # step ends). At DDP's bucket rebuild (the second step's forward) the old buckets then live
    # on through the forward, beside the new ones, as ProcessGroupNCCL's works keep the tensors
    # of collectives it has not yet seen complete. Calibrated on an H200 (a 1.3B GPT, world
    # size 1): it gives DDP with gradient_as_bucket_view its measured 34.03 GiB (5.3 GiB more
    # than without), and plain DDP its first run's 34.03 GiB; a second run measured 32.13, the
    # hold being a race with NCCL's watchdog thread. The safe side is taken.
    nccl: bool = True

    @classmethod
    def off(cls) -> "CudaChoices":
        """Meta as the CPU: a meta capture then equals a CPU capture event for event."""
        return cls(dropout=False, optimizer=False, attention=False, nccl=False, workspaces=False, rms_norm=False)

    def __post_init__(self) -> None:
        for name in ("dropout", "optimizer", "attention", "nccl", "workspaces", "rms_norm"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"CudaChoices.{name} must be True or False, got {getattr(self, name)!r}")
        arch = self.arch
        if (not isinstance(arch, tuple) or len(arch) != 2 or not all(isinstance(v, int) and 0 <= v < 100 for v in arch)):
            raise ValueError(f"CudaChoices.arch must be a compute capability (major, minor), e.g. (9, 0) for an "
                             f"H100 or (8, 0) for an A100, got {arch!r}")
