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

__all__ = ["CudaChoices", "DEFAULT_CUDNN"]

# The cuDNN that torch's CUDA 13.0 wheels of 2.11 load (torch.backends.cudnn.version(), seen on an
# H100 and an H200): what a named profile assumes. It decides whether torch prefers cuDNN's
# attention (above 9.15.0 on sm90/sm10x) and cuDNN's head-size limits.
DEFAULT_CUDNN = 91900


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
    # The cuDNN version torch runs on the target (torch.backends.cudnn.version(), e.g. 91900 for
    # 9.19.0), None for none. With cuDNN above 9.15.0 on sm90/sm10x torch tries cuDNN's attention
    # before flash and memory-efficient (sdp_utils.cpp check_prefer_cudnn_attention) unless
    # TORCH_CUDNN_SDPA_DEPRIORITIZED is set; seen on an H200 with torch 2.11 and cuDNN 9.19.
    cudnn: int | None = DEFAULT_CUDNN

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
        cudnn = self.cudnn
        if cudnn is not None and (isinstance(cudnn, bool) or not isinstance(cudnn, int) or not 0 < cudnn < 10**6):
            raise ValueError(f"CudaChoices.cudnn must be a cuDNN version as torch.backends.cudnn.version() gives it "
                             f"(e.g. 91900 for 9.19.0) or None for no cuDNN, got {cudnn!r}")
