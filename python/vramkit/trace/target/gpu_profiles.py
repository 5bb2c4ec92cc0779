"""The GPU a prediction is for: profiles (``--gpu H100-80GB``), the line items no trace sees, and
``resolve_target``, which turns what the caller said into one ``Target``.

Every entry point of ``vramkit.trace`` that predicts for a GPU (``replay``, ``fit``,
``predict_ranks``, ``smallest_world_size``) takes one GPU argument, `gpu`: a profile name,
``"current"``, a ``GpuProfile``, the GPU's memory (bytes, or a string such as ``"24GiB"``), or
a ``Target`` already resolved. Each resolves it once with ``resolve_target``, together with the
caller's `overheads`, `alloc_conf` and `world_size`, and passes the ``Target`` down; nothing
below looks at a profile or a size again. A missing or unknown GPU is a ``TargetError``
(a ``ValueError`` and a ``TypeError``) worded for the caller: ``gpu=`` from Python, the
command's flags from ``vramkit fit`` and ``vramkit replay`` (``Spelling``).

The figures:

``capacity`` is what ``torch.cuda.get_device_properties(i).total_memory`` reports
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

import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeAlias

from ..._core.sizes import GiB, MiB, format_size, parse_size
from .dispatch import DEFAULT_CUDNN, CudaChoices

if TYPE_CHECKING:
    from ..formats.file_format import Trace

__all__ = ["AllocConf", "CLI", "GpuOverheads", "GpuProfile", "GpuSpec", "NCCL_DEFAULT", "NO_OVERHEADS", "PROFILES",
           "PYTHON", "Spelling", "Target", "TargetError", "conf_text", "gpu_profile", "recorded_on_gpu", "resolve_target"]


class TargetError(ValueError, TypeError):
    """What the caller said does not name a GPU: nothing given, an unknown or ambiguous profile,
    ``"current"`` without a GPU, a malformed size, or line items that leave nothing to allocate.
    Both a ``ValueError`` and a ``TypeError``, so that code catching either still catches it."""


@dataclass(frozen=True)
class Spelling:
    """How the caller writes a GPU, for the messages of ``TargetError``: from Python
    (``PYTHON``: ``gpu=...``) or on the command line (``CLI``: ``--gpu``, ``--device-memory``)."""

    profile: str  # naming a profile
    memory: str  # giving the memory
    current: str  # asking for this machine's GPU
    gpu_arg: str  # the argument that names the GPU
    capacity_arg: str  # the argument that gives its memory instead of the profile's


PYTHON = Spelling(profile="gpu=NAME", memory="gpu=SIZE (e.g. gpu='80GiB')", current="gpu='current'", gpu_arg="gpu",
                  capacity_arg="capacity")
CLI = Spelling(profile="--gpu NAME", memory="--device-memory SIZE (e.g. 80GiB)", current="--gpu current",
               gpu_arg="--gpu", capacity_arg="--device-memory")


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
        for name, where in _WHERE.items():
            value = int(getattr(self, name))
            if value < 0:
                raise ValueError(f"GpuOverheads.{name} must be >= 0 bytes, got {value}")
            if value:
                out.append((name, value, where))
        return out

    @property
    def outside(self) -> int:
        return sum(b for _, b, where in self.items() if where == "outside")


# Each line item and where it lies (the order of the reports' rows).
_WHERE = {"cuda_context": "outside", "nccl": "outside", "cublas_workspace": "allocator",
          "cublaslt_workspace": "allocator", "cudnn_workspace": "allocator"}
NO_OVERHEADS = GpuOverheads(0, 0, 0, 0)
HOPPER_CONTEXT = 685 * MiB  # measured on an H200 after the first matmul (module docstring)
NCCL_DEFAULT = 650 * MiB  # measured on an H200, NCCL 2.28.9, one rank (module docstring)


@dataclass(frozen=True)
class GpuProfile:
    """One GPU model: what a prediction for it needs."""

    name: str
    capacity: int  # torch.cuda.get_device_properties(i).total_memory
    compute_capability: tuple[int, int]
    cuda_context: int = 512 * MiB
    source: str = ""  # where capacity comes from
    cudnn: int | None = DEFAULT_CUDNN  # the cuDNN torch runs there (torch.backends.cudnn.version())

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

    def cuda_choices(self) -> CudaChoices:
        """The dispatch choices a capture for this GPU makes (its architecture)."""
        return CudaChoices(arch=self.compute_capability, cudnn=self.cudnn)

    def describe(self) -> str:
        cc = ".".join(map(str, self.compute_capability))
        return (f"{self.name}: {self.capacity / GiB:.2f} GiB usable by PyTorch, compute capability {cc}, "
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


def _current(spelling: Spelling) -> GpuProfile:
    try:
        import torch
    except ImportError:
        raise TargetError(f"{spelling.current} reads the GPU of this machine through PyTorch, which is not "
                          "installed") from None
    if not torch.cuda.is_available():
        raise TargetError(f"{spelling.current}: this machine has no CUDA device (torch.cuda.is_available() is False); "
                          f"name a profile instead: {', '.join(PROFILES)}")
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return GpuProfile(f"current ({props.name})", int(props.total_memory), (int(props.major), int(props.minor)),
                      source="torch.cuda.get_device_properties on this machine", cudnn=torch.backends.cudnn.version())


def gpu_profile(name: str | GpuProfile, spelling: Spelling = PYTHON) -> GpuProfile:
    """The profile called `name` (case and separators ignored: "H100-80GB", "a100_40gb", "h100"
    where one size exists), "current" for this machine's GPU, or a ``GpuProfile`` itself.
    ``TargetError`` for any other name, worded with `spelling`."""
    if isinstance(name, GpuProfile):
        return name
    if not isinstance(name, str):
        raise TargetError(f"a GPU profile is a name or a GpuProfile, got {type(name).__name__}")
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    if key == "current":
        return _current(spelling)
    for profile in PROFILES.values():
        full = profile.name.lower()
        if key in (full, full.replace("-", "")):
            return profile
    family = [p.name for p in PROFILES.values() if p.name.lower().split("-")[0] == key]
    if len(family) == 1:
        return PROFILES[family[0]]
    if family:  # "a100": 40 or 80 GB; a guess would predict for twice (or half) the memory
        raise TargetError(f"GPU {name!r} comes in several sizes: say which, {' or '.join(family)}")
    raise TargetError(f"unknown GPU {name!r}: known profiles are {', '.join(PROFILES)} (or 'current' for this "
                      f"machine's GPU); for another GPU give its memory with {spelling.memory}")


def conf_text(alloc_conf: AllocConf) -> str | None:
    """Allocator options (PYTORCH_CUDA_ALLOC_CONF's form) as one string: a string as it is, a
    dict as "key:value,..." (booleans as True/False), None for PyTorch's defaults."""
    if alloc_conf is None:
        return None
    if isinstance(alloc_conf, str):
        return alloc_conf
    if isinstance(alloc_conf, Mapping):
        return ",".join(f"{k}:{('True' if v else 'False') if isinstance(v, bool) else v}"
                        for k, v in alloc_conf.items())
    raise TargetError(f"alloc_conf must be a PYTORCH_CUDA_ALLOC_CONF string or a dict, got {type(alloc_conf).__name__}")


def recorded_on_gpu(trace: Trace) -> bool:
    """Whether `trace` is a PyTorch snapshot recorded on a GPU: its allocations already include
    the cuBLAS and cuDNN workspaces (they come from the caching allocator), so a replay must not
    add them again. vramkit's own snapshots of cpu or simulated pools (meta "recorded_on")
    are not."""
    if trace.meta.get("source") != "torch-snapshot":
        return False
    return not str(trace.meta.get("recorded_on", "cuda")).startswith(("cpu", "sim"))


@dataclass(frozen=True)
class Target:
    """The GPU a prediction is for, resolved once (``resolve_target``): its memory, the line
    items outside and inside the allocator, the allocator's options, and the architecture
    whose CUDA dispatch choices a capture for it makes.

    `capacity` is what PyTorch's allocator could reach on an empty GPU
    (``torch.cuda.get_device_properties(i).total_memory``); `usable` is that less the line items
    outside the allocator. `arch` is None when only the memory was given: captures then make the
    choices of ``CudaChoices()``'s default architecture and bf16 counts as available.
    `given` names the line items the caller set: a trace recorded on a GPU keeps those
    (``for_trace``) and drops the allocator's workspaces otherwise."""

    name: str
    capacity: int
    overheads: GpuOverheads = field(default_factory=GpuOverheads)
    arch: tuple[int, int] | None = None
    alloc_conf: str | None = None
    given: frozenset[str] = frozenset()
    cudnn: int | None = DEFAULT_CUDNN  # the cuDNN torch runs on the target (CudaChoices.cudnn)

    @property
    def usable(self) -> int:
        """Bytes the allocator may reserve: the capacity less the line items outside it."""
        return self.capacity - self.overheads.outside

    @property
    def bf16(self) -> bool:
        """Whether the GPU has bf16 kernels (compute capability 8.0 or later; unknown counts as yes)."""
        return self.arch is None or self.arch >= (8, 0)

    def cuda_choices(self) -> CudaChoices:
        """The dispatch choices a meta capture for this GPU makes."""
        return CudaChoices(cudnn=self.cudnn) if self.arch is None else CudaChoices(arch=self.arch, cudnn=self.cudnn)

    def with_alloc_conf(self, alloc_conf: AllocConf) -> Target:
        """The same GPU with other allocator options (fit's suggestions try several)."""
        return replace(self, alloc_conf=conf_text(alloc_conf))

    def for_trace(self, trace: Trace) -> Target:
        """The target for replaying `trace`: without the allocator's workspaces the caller did
        not set, when the trace was recorded on a GPU (it holds them already)."""
        if not recorded_on_gpu(trace):
            return self
        dropped = {name: 0 for name, where in _WHERE.items() if where == "allocator" and name not in self.given}
        return replace(self, overheads=replace(self.overheads, **dropped))

    def describe(self) -> str:
        """"H100-80GB (79.21 GiB)", or the memory alone when no profile was named."""
        size = format_size(self.capacity)
        return size if self.name == size else f"{self.name} ({size})"


# What a caller may say to name a GPU (``resolve_target``), and the allocator options' forms.
GpuSpec: TypeAlias = "Target | GpuProfile | str | int"
AllocConf: TypeAlias = "str | Mapping[str, Any] | None"


def resolve_target(gpu: GpuSpec | None, *, capacity: str | int | None = None,
                   overheads: GpuOverheads | Mapping[str, int] | None = None, alloc_conf: AllocConf = None,
                   world_size: int | None = None, spelling: Spelling = PYTHON) -> Target:
    """What the caller said, as one ``Target``.

    `gpu`: a profile name (``"H100-80GB"``, ``"a100_40gb"``), ``"current"`` (this machine's GPU,
    through torch), a ``GpuProfile``, the GPU's memory (an int of bytes or a string such as
    ``"24GiB"``), or a ``Target`` (returned as it is, with the arguments below applied). None
    with no `capacity` is an error: there is no default GPU.
    `capacity`: the memory, instead of the profile's (a 40 GiB slice of an H100).
    `overheads`: a ``GpuOverheads`` (every line item as given), or a mapping of some of its
    fields to bytes (the others the profile's, else ``GpuOverheads()``'s).
    `alloc_conf`: allocator options as in PYTORCH_CUDA_ALLOC_CONF (a string or a dict).
    `world_size`: a distributed job, whose NCCL buffers lie outside the allocator
    (``NCCL_DEFAULT``) unless the caller set ``nccl``.
    Raises ``TargetError``, worded with `spelling`."""
    base: Target
    if isinstance(gpu, Target):
        if capacity is None and overheads is None and alloc_conf is None and world_size is None:
            return gpu  # resolved already, nothing to add
        base = gpu
    elif gpu is None and capacity is None:
        raise TargetError(f"say which GPU: {spelling.profile} ({', '.join(PROFILES)}, or current for this "
                          f"machine's GPU) or {spelling.memory}")
    elif gpu is None:
        size = _size(capacity, spelling.capacity_arg)
        base = Target(format_size(size), size)
    elif isinstance(gpu, numbers.Real) or (isinstance(gpu, str) and gpu.strip()[:1].isdigit()):
        size = _size(gpu, spelling.gpu_arg)
        base = Target(format_size(size), size)
    elif isinstance(gpu, (str, GpuProfile)):
        profile = gpu_profile(gpu, spelling)
        base = Target(profile.name, profile.capacity, profile.overheads(), profile.compute_capability,
                      cudnn=profile.cudnn)
    else:
        raise TargetError(f"gpu must be a profile name, 'current', a GpuProfile, a Target or the GPU's memory (bytes, "
                          f"or a string like '24GiB'), got {type(gpu).__name__}")
    if capacity is not None and gpu is not None:
        base = replace(base, capacity=_size(capacity, spelling.capacity_arg))
    items, given = base.overheads, set(base.given)
    if isinstance(overheads, GpuOverheads):
        items, given = overheads, set(_WHERE)
    elif overheads is not None:
        if not isinstance(overheads, Mapping) or not set(overheads) <= set(_WHERE):
            raise TargetError(f"overheads must be a GpuOverheads or a mapping of some of {', '.join(_WHERE)} to bytes, "
                              f"got {overheads!r}")
        items, given = replace(items, **dict(overheads)), given | set(overheads)
    if world_size is not None and "nccl" not in given:
        items = replace(items, nccl=NCCL_DEFAULT)
    try:
        items.items()  # every item >= 0
    except ValueError as exc:
        raise TargetError(str(exc)) from None
    target = replace(base, overheads=items, given=frozenset(given),
                     alloc_conf=conf_text(alloc_conf) if alloc_conf is not None else base.alloc_conf)
    if target.usable <= 0:
        raise TargetError(f"{target.describe()} leaves nothing once {format_size(items.outside)} of CUDA context and "
                          "other memory outside the allocator is taken")
    return target


def _size(value: Any, what: str) -> int:
    try:
        return parse_size(value, what)
    except (TypeError, ValueError) as exc:
        raise TargetError(str(exc)) from None
