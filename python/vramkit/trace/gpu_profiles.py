"""GPU profiles for predictions: capacity, what lies outside the allocator, and the architecture
that decides CUDA's dispatch choices (``--gpu H100-80GB``).

``total_memory`` is what ``torch.cuda.get_device_properties(i).total_memory`` reports
(``cudaDeviceProp.totalGlobalMem``), less than the marketing size and less than nvidia-smi's
total: it is the capacity PyTorch's allocator can reach. Where logs disagree by a few MiB
(driver and ECC settings), the profile takes the value quoted and says so; on the machine
itself, ``--gpu current`` reads the real figure.

* ``cuda_context``: memory the CUDA context, kernels and library handles take outside the
  allocator. With lazy module loading (CUDA 11.7+, PyTorch's default) it grows as cuBLAS,
  cuDNN and attention kernels load. Measured on an H200 (torch 2.11+cu130, driver 580):
  527 MiB after CUDA's initialization, 685 MiB after the first cuBLAS matmul; the Hopper
  profiles take 685 MiB. Reports for other GPUs run from 287 MB to 426 MiB; they keep 512 MiB.
* ``cublas_workspace``: ``CublasHandlePool.cpp`` allocates one workspace through the caching
  allocator per (handle, stream), at the first matmul: 4096 KiB x 8 = 32 MiB on compute
  capability 9.x (Hopper), 4096 KiB x 2 + 16 KiB x 8 = 8.125 MiB elsewhere. Handles are per
  thread, and the autograd engine runs a CUDA device's backward on its own thread, so a
  training step holds two: the forward's and the backward's. The H200 run showed both
  (one allocated under the first Linear's forward, one on autograd's thread) and a third,
  cuBLASLt's own 1 MiB, at the first float32 Linear with a bias; Hopper profiles count it as
  ``cublaslt_workspace``.
* ``nccl``: what NCCL takes outside the allocator per process once a process group has run a
  collective. Measured on the H200 (NCCL 2.28.9, one rank): 650 MiB. It grows with the number
  of peers and channels; sharded predictions take it as their default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["GpuOverheads", "GpuProfile", "NO_OVERHEADS", "PROFILES", "gpu_profile"]

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class GpuOverheads:
    """GPU memory a CPU or meta trace cannot see (see the module docstring for the figures).

    ``cuda_context`` and ``nccl`` are outside PyTorch's allocator: they reduce the capacity
    the replay may reserve. ``cublas_workspace`` and ``cudnn_workspace`` come from the
    allocator: they are allocations added at the start of the first step.
    """

    cuda_context: int = 512 * MiB
    cublas_workspace: int = 32 * MiB
    cudnn_workspace: int = 0
    nccl: int = 0
    cublaslt_workspace: int = 0

    def items(self) -> list[tuple[str, int, str]]:
        """(name, bytes, where) for each non-zero item; where is "outside" or "allocator"."""
        out = []
        for name, where in (("cuda_context", "outside"), ("nccl", "outside"), ("cublas_workspace", "allocator"),
                            ("cublaslt_workspace", "allocator"), ("cudnn_workspace", "allocator")):
            value = int(getattr(self, name))
            if value < 0:
                raise ValueError(f"GpuOverheads.{name} must be >= 0 bytes, got {value}")
            if value:
                out.append((name, value, where))
        return out

    @property
    def outside(self) -> int:
        return sum(b for _, b, where in self.items() if where == "outside")


NO_OVERHEADS = GpuOverheads(0, 0, 0, 0)
HOPPER_CONTEXT = 685 * MiB  # measured on an H200 after the first matmul (module docstring)
NCCL_DEFAULT = 650 * MiB  # measured on an H200, NCCL 2.28.9, one rank (module docstring)



@dataclass(frozen=True)
class GpuProfile:
    """One GPU model: what a prediction for it needs."""

    name: str
    total_memory: int
    compute_capability: tuple[int, int]
    cuda_context: int = 512 * MiB
    source: str = ""  # where total_memory comes from

    @property
    def bf16(self) -> bool:
        """``torch.cuda.is_bf16_supported()``: compute capability 8.0 or later."""
        return self.compute_capability >= (8, 0)

    @property
    def flash_attention(self) -> bool:
        """Whether torch's flash-attention kernel runs here (sm80 to sm121, fp16/bf16)."""
        return (8, 0) <= self.compute_capability < (13, 0)

    @property
    def cublas_workspace(self) -> int:
        """Two cuBLAS workspaces (the forward's thread and autograd's device thread)."""
        one = 4096 * 8 * 1024 if self.compute_capability[0] in (9, 10, 12) else 4096 * 1024 * 2 + 16 * 1024 * 8
        return 2 * one

    @property
    def cublaslt_workspace(self) -> int:
        """cuBLASLt's own workspace: 1 MiB on Hopper (measured on an H200); 0 elsewhere, unmeasured."""
        return MiB if self.compute_capability[0] == 9 else 0

    def overheads(self, **changes: Any) -> GpuOverheads:
        """This GPU's line items, with any field of ``GpuOverheads`` changed."""
        base = {"cuda_context": self.cuda_context, "cublas_workspace": self.cublas_workspace,
                "cublaslt_workspace": self.cublaslt_workspace}
        return GpuOverheads(**{**base, **changes})

    def cuda_choices(self) -> Any:
        """The dispatch choices a capture for this GPU makes (its architecture)."""
        from .cuda_choices import CudaChoices

        return CudaChoices(arch=self.compute_capability)

    def describe(self) -> str:
        cc = ".".join(map(str, self.compute_capability))
        return (f"{self.name}: {self.total_memory / (1 << 30):.2f} GiB usable by PyTorch, compute capability {cc}, "
                f"bf16 {'yes' if self.bf16 else 'no'}, flash attention {'yes' if self.flash_attention else 'no'}")


PROFILES: dict[str, GpuProfile] = {p.name: p for p in (
    GpuProfile("H100-80GB", 85_045_477_376, (9, 0), HOPPER_CONTEXT,
               source="deviceQuery, H100 80GB HBM3 SXM (torch repr 81082-81105 MB)"),
    GpuProfile("H200-141GB", 150_109_880_320, (9, 0), HOPPER_CONTEXT,
               source="torch.cuda.mem_get_info total on an H200 (driver 580.159.04)"),
    GpuProfile("A100-80GB", 85_167_243_264, (8, 0), source="totalGlobalMem 81221.8 MiB, A100-SXM4-80GB"),
    GpuProfile("A100-40GB", 42_505_273_344, (8, 0), source="deviceQuery, A100-PCIE-40GB (SXM4 repr 40536 MB agrees)"),
    GpuProfile("L4", 22_574 * MiB, (8, 9), source="deviceQuery 'Total global memory: 22574 MB'"),
    GpuProfile("RTX-4090", 24_563 * MiB, (8, 9), source="torch repr total_memory=24563MB"),
)}


def _current() -> GpuProfile:
    try:
        import torch
    except ImportError:
        raise ValueError("--gpu current reads the GPU of this machine through PyTorch, which is not installed") from None
    if not torch.cuda.is_available():
        raise ValueError("--gpu current: this machine has no CUDA device (torch.cuda.is_available() is False); name a "
                         f"profile instead: {', '.join(PROFILES)}")
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return GpuProfile(f"current ({props.name})", int(props.total_memory), (int(props.major), int(props.minor)),
                      source="torch.cuda.get_device_properties on this machine")


def gpu_profile(name: Any) -> GpuProfile:
    """The profile called `name` (case and separators ignored: "H100-80GB", "a100_40gb", "h100"
    where one size exists),
    "current" for this machine's GPU, or a ``GpuProfile`` itself."""
    if isinstance(name, GpuProfile):
        return name
    if not isinstance(name, str):
        raise TypeError(f"gpu must be a profile name or a GpuProfile, got {type(name).__name__}")
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    if key == "current":
        return _current()
    for profile in PROFILES.values():
        full = profile.name.lower()
        if key in (full, full.replace("-", "")):
            return profile
    family = [p.name for p in PROFILES.values() if p.name.lower().split("-")[0] == key]
    if len(family) == 1:
        return PROFILES[family[0]]
    if family:  # "a100": 40 or 80 GB; a guess would predict for twice (or half) the memory
        raise ValueError(f"GPU {name!r} comes in several sizes: say which, {' or '.join(family)}")
    raise ValueError(f"unknown GPU {name!r}: known profiles are {', '.join(PROFILES)} (or 'current' for this "
                     "machine's GPU); for another GPU give its memory with --device-memory")
