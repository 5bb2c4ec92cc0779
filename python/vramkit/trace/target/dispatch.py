"""``CudaChoices``: the dispatch choices a CUDA run on the target GPU makes and a meta run would
make differently (dropout's mask, the optimizer's foreach implementation, the attention
backend, cuDNN's convolution workspaces), and the architecture they depend on.

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
    arch: tuple[int, int] = (9, 0)  # compute capability of the target GPU (H100: 9.0)

    @classmethod
    def off(cls) -> "CudaChoices":
        """Meta as the CPU: a meta capture then equals a CPU capture event for event."""
        return cls(dropout=False, optimizer=False, attention=False, workspaces=False)

    def __post_init__(self) -> None:
        for name in ("dropout", "optimizer", "attention", "workspaces"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"CudaChoices.{name} must be True or False, got {getattr(self, name)!r}")
        arch = self.arch
        if (not isinstance(arch, tuple) or len(arch) != 2 or not all(isinstance(v, int) and 0 <= v < 100 for v in arch)):
            raise ValueError(f"CudaChoices.arch must be a compute capability (major, minor), e.g. (9, 0) for an "
                             f"H100 or (8, 0) for an A100, got {arch!r}")
