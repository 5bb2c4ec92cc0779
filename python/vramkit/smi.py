"""``vramkit.smi``: GPUs and the processes holding their memory, under the import path the docs
show. The code lives in ``vramkit.survive.smi``."""

from __future__ import annotations

from .survive.smi import (
    GPU,
    GPUProcess,
    KillOutcome,
    NVMLUnavailableError,
    devices,
    format_table,
    kill_stale,
    list_gpu_processes,
    nested_pid_namespace,
    processes,
    stale,
)

__all__ = ["GPU", "GPUProcess", "KillOutcome", "NVMLUnavailableError", "devices", "processes", "stale",
           "kill_stale", "format_table", "list_gpu_processes", "nested_pid_namespace"]
