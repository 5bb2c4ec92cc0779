"""`vramkit fit` and `vramkit replay`: will a training step fit on a GPU of a given size?

    vramkit fit SCRIPT --gpu H100-80GB | --device-memory 24GiB [--batch-size N] [--entry NAME | module:function] ...
    vramkit fit SCRIPT --world-size 8 --gpu H100-80GB [--batch-size N] [--rank R] ...   (per rank, sharded)
    vramkit replay TRACE --gpu A100-40GB | --device-memory 40GiB [--alloc-conf OPTIONS] ...

`fit` loads SCRIPT without running its `__main__` block (run_name "__vramkit_fit__"), takes
its builder (`vramkit_step(batch_size)` by default: build the model, optimizer and a batch,
return the step function), captures it on the meta device and replays it on a simulated GPU.
`replay` replays a `.vktrace` file or a PyTorch memory snapshot pickle.

Exit status: 0 it fits, 3 it does not, 2 bad usage or input (a file that cannot be read or
written, a malformed trace), 1 the script failed, 130 interrupted (Ctrl-C). Errors are one
line, "vramkit fit: error: ...", with no traceback, except the script's own failures, which
are shown as python would show them. Like every module of vramkit.commands, it prints; no other part of vramkit does.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import runpy
import sys
import time
from typing import TYPE_CHECKING, Any, Callable

from ..trace.formats.file_format import MAGIC, describe_value
from .common import _non_negative_int, _positive_int

if TYPE_CHECKING:
    from ..trace.target.gpu_profiles import Target

__all__ = ["add_commands", "cmd_fit", "cmd_replay"]

ENTRY = "vramkit_step"
FITS, DOES_NOT_FIT, BAD_INPUT, FAILED = 0, 3, 2, 1


_MAX_MIB = 1 << 30  # 1 PiB: more than any GPU has, far below where sizes stop being exact


def _mib(text: str) -> int:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of MiB >= 0, got {text!r}") from None
    if not math.isfinite(value) or not 0 <= value <= _MAX_MIB:
        raise argparse.ArgumentTypeError(f"expected a number of MiB from 0 to {_MAX_MIB:,} (1 PiB), got {text!r}")
    return int(value * (1 << 20))


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu", default=None, metavar="NAME",
                   help="a GPU profile: H100-80GB, H200-141GB, A100-80GB, A100-40GB, L4, RTX-4090, or 'current' (this machine's "
                        "GPU): its memory, CUDA context, cuBLAS workspaces and architecture (attention backend, bf16)")
    p.add_argument("--device-memory", dest="capacity", default=None, metavar="SIZE",
                   help="the GPU's memory, e.g. 24GiB, 40GiB, 80GiB (binary units); overrides --gpu's")
    p.add_argument("--alloc-conf", default=None, metavar="OPTIONS",
                   help="allocator options as in PYTORCH_CUDA_ALLOC_CONF, e.g. max_split_size_mb:128")
    p.add_argument("--cuda-context-mib", type=_mib, default=None, metavar="MIB",
                   help="GPU memory outside the allocator: CUDA context and libraries (default 512)")
    p.add_argument("--cublas-workspace-mib", type=_mib, default=None, metavar="MIB",
                   help="cuBLAS workspace allocated at the first matmul (default 32; 0 for a recorded GPU trace)")
    p.add_argument("--nccl-mib", type=_mib, default=None, metavar="MIB",
                   help="NCCL's memory outside the allocator per GPU (default 650 with --world-size, else 0)")
    p.add_argument("--html", default="vramkit-predict.html", metavar="PATH",
                   help="where to write the HTML timeline of the replay (default: %(default)s)")
    p.add_argument("--top", type=_non_negative_int, default=5, metavar="N",
                   help="modules listed at the peak (default: %(default)s)")


def add_commands(commands: Any) -> None:
    fit = commands.add_parser(
        "fit", help="predict whether a training step fits a GPU, and the largest batch size that does",
        description="Capture SCRIPT's training step on the meta device (no GPU, no memory) and replay it on a "
                    "simulated GPU with PyTorch's allocator policy. SCRIPT defines vramkit_step(batch_size), "
                    "which builds the model, optimizer and a batch and returns the step function.")
    fit.add_argument("script", metavar="SCRIPT", help="the Python file that defines the builder")
    _common(fit)
    fit.add_argument("--batch-size", type=_positive_int, default=None, metavar="N",
                     help="the batch size to predict; if it does not fit, what would make it fit is tried")
    fit.add_argument("--entry", default=ENTRY, metavar="NAME",
                     help="the builder: a function name in SCRIPT, or module:function (default: %(default)s)")
    fit.add_argument("--steps", type=_positive_int, default=2, metavar="N",
                     help="training steps captured (default: %(default)s; the second has the optimizer state)")
    fit.add_argument("--max-batch-size", type=_positive_int, default=1 << 16, metavar="N",
                     help="the largest batch size the search tries (default: %(default)s)")
    fit.add_argument("--no-search", action="store_true",
                     help="only predict --batch-size; do not search the largest batch size")
    fit.add_argument("--world-size", type=_positive_int, default=None, metavar="N",
                     help="predict one GPU of an N-GPU torch.distributed job (DDP, FSDP2, ZeroRedundancyOptimizer): "
                          "the script's step runs as each rank in turn, batch sizes are per rank")
    fit.add_argument("--rank", type=_non_negative_int, default=None, metavar="R",
                     help="with --world-size: only this rank (default: the ranks whose shards differ)")
    fit.add_argument("--max-world-size", type=_positive_int, default=1024, metavar="N",
                     help="with --world-size and --batch-size: the largest world size the search for the fewest GPUs "
                          "that fit the batch tries (default: %(default)s; 1 turns the search off)")
    fit.add_argument("--trace", default=None, metavar="PATH",
                     help="also save the trace (of --batch-size, else of the largest size that fits) as .vktrace")
    replay = commands.add_parser(
        "replay", help="replay a .vktrace file or a PyTorch memory snapshot pickle on a simulated GPU",
        description="Replay an allocation trace (.vktrace, or a pickle from torch.cuda.memory._dump_snapshot) "
                    "on a simulated GPU of --device-memory with PyTorch's allocator policy.")
    replay.add_argument("trace", metavar="TRACE", help="a .vktrace file or a snapshot pickle (read as plain data: "
                                                       "nothing in the file runs)")
    _common(replay)
    replay.add_argument("--device", type=_non_negative_int, default=None, metavar="N",
                        help="which device's trace in a snapshot with several (default: the only one)")


def _target(ns: argparse.Namespace, command: str) -> Target | None:
    """The GPU the flags name, resolved once (``resolve_target``, worded with the flags); None
    (and a message) when they name none."""
    from ..trace.target.gpu_profiles import CLI, TargetError, resolve_target

    items = {name: value for name, value in (("cuda_context", ns.cuda_context_mib),
                                             ("cublas_workspace", ns.cublas_workspace_mib), ("nccl", ns.nccl_mib))
             if value is not None}
    try:
        return resolve_target(ns.gpu, capacity=ns.capacity, overheads=items, alloc_conf=ns.alloc_conf,
                              world_size=getattr(ns, "world_size", None), spelling=CLI)
    except TargetError as exc:
        _error(command, str(exc))
        return None


def _error(command: str, message: str) -> None:
    print(f"vramkit {command}: error: {message}", file=sys.stderr)


def _load_builder(script: str, entry: str) -> Callable[..., Any]:
    """The builder named by --entry: a function defined by SCRIPT (loaded without running its
    __main__ block), or module:function. Raises LookupError with what to do."""
    if ":" in entry:
        module_name, _, func = entry.partition(":")
        if not module_name or not func:
            raise LookupError(f"--entry {entry!r}: expected a function name, or module:function")
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            # The module --entry names (or its package) is missing: bad input. A module that
            # exists but imports something missing is the script's failure, shown as such.
            if exc.name is None or not (module_name == exc.name or module_name.startswith(exc.name + ".")):
                raise
            raise LookupError(f"--entry {entry!r}: no module named {exc.name!r} (looked in "
                              f"{os.path.dirname(os.path.abspath(script))} and on sys.path)") from None
        finally:
            sys.path.pop(0)
        names = vars(module)
        where = f"module {module_name}"
    else:
        func = entry
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        try:
            names = runpy.run_path(script, run_name="__vramkit_fit__")
        finally:
            sys.path.pop(0)
        where = os.path.basename(script)
    builder: Callable[..., Any] | None = names.get(func)
    if builder is None or not callable(builder):
        raise LookupError(f"{where} defines no function {func}(batch_size): define one that builds the model, "
                          "optimizer and a batch of that size and returns the step function (see docs/will-it-fit.md), "
                          "or name another with --entry")
    return builder


def _output_problem(path: str, option: str) -> str | None:
    """Why `path` cannot be written (checked before the work, so that a long fit does not end
    in an error), or None."""
    full = os.path.abspath(path)
    directory = os.path.dirname(full)
    if os.path.isdir(full):
        return f"{option} {path!r} is a directory; give a file name"
    if not os.path.isdir(directory):
        return f"{option} {path!r}: the directory {directory} does not exist"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"{option} {path!r}: the directory {directory} is not writable"
    return None


def _write_html(command: str, path: str, trace: Any, prediction: Any, title: str) -> str | None:
    from ..trace.replaying.as_snapshot import prediction_snapshot
    from ..report.timeline import write_html

    try:
        return write_html(os.path.abspath(path), prediction_snapshot(trace, prediction), title=title)
    except OSError as exc:
        _error(command, f"cannot write the timeline {path!r}: {exc.strerror or exc}")
        return None


def _script_problem(script: str, shown: str, entry: str) -> str | None:
    if os.path.isdir(script):
        return f"{shown!r} is a directory; SCRIPT is a Python file that defines {entry}(batch_size)"
    if not os.path.isfile(script):
        return f"script {shown!r} not found (SCRIPT is a Python file that defines {entry}(batch_size))"
    return None


def _exit_code_text(code: Any) -> str:
    return f"sys.exit({describe_value(code) if not isinstance(code, str) else repr(code[:80])})"


def cmd_fit(ns: argparse.Namespace) -> int:
    script = os.path.abspath(ns.script)
    problem = _script_problem(script, ns.script, ns.entry) or _output_problem(ns.html, "--html")
    if problem is None and ns.trace:
        problem = _output_problem(ns.trace, "--trace")
    if problem:
        _error("fit", problem)
        return BAD_INPUT
    try:
        import torch  # noqa: F401
    except ImportError:
        _error("fit", "PyTorch is not installed; vramkit fit captures a torch training step")
        return BAD_INPUT
    from .. import trace as vt

    try:
        builder = _load_builder(script, ns.entry)
    except LookupError as exc:
        _error("fit", str(exc))
        return BAD_INPUT
    except SystemExit as exc:
        _error("fit", f"loading {ns.script} called {_exit_code_text(exc.code)}: SCRIPT is loaded without running "
                      "its __main__ block; keep the training loop under `if __name__ == \"__main__\":`")
        return FAILED
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 -- the script's own failure, reported as python would
        import traceback

        traceback.print_exception(type(exc), exc, exc.__traceback__)
        _error("fit", f"loading {ns.script} raised {type(exc).__name__}")
        return FAILED
    if ns.no_search and ns.batch_size is None:
        _error("fit", "--no-search needs --batch-size")
        return BAD_INPUT
    target = _target(ns, "fit")
    if target is None:
        return BAD_INPUT
    if ns.rank is not None and (ns.world_size is None or ns.rank >= ns.world_size):
        _error("fit", f"--rank {ns.rank} needs --world-size N with N > {ns.rank} (ranks are 0 to N-1)")
        return BAD_INPUT

    def progress(line: str) -> None:
        print(f"  {line}", file=sys.stderr, flush=True)

    print(f"capturing {os.path.basename(script)}:{ns.entry} on meta and replaying on {target.describe()} ...",
          file=sys.stderr, flush=True)
    start = time.perf_counter()
    ranks = None
    try:
        sharded: dict[str, Any] = {}
        if ns.world_size is not None:
            # Which ranks differ, at the batch size asked (or 1): the search then runs on the highest.
            ranks = vt.predict_ranks(builder, ns.batch_size or 1, world_size=ns.world_size, gpu=target,
                                     ranks=None if ns.rank is None else [ns.rank], steps=ns.steps, progress=progress)
            sharded = {"world_size": ns.world_size, "rank": ranks.worst_rank,
                       "captured": {ns.batch_size or 1: ranks.traces[ranks.worst_rank]}}
        report = vt.fit(builder, target, batch_size=ns.batch_size, max_batch_size=ns.max_batch_size, steps=ns.steps,
                        search=not ns.no_search, progress=progress, **sharded)
        if ranks is not None and ns.batch_size is None and report.max_batch_size and report.max_batch_size != 1:
            ranks = vt.predict_ranks(builder, report.max_batch_size, world_size=ns.world_size, gpu=target,
                                     ranks=sorted(ranks.predictions), steps=ns.steps, progress=progress)
        fewest = None
        if ranks is not None and ns.batch_size is not None and ns.rank is None and ns.max_world_size > 1:
            fewest = vt.smallest_world_size(builder, ns.batch_size, gpu=target, known=ranks,
                                            limit=max(ns.max_world_size, ns.world_size), steps=ns.steps,
                                            progress=progress)
    except vt.CaptureError as exc:
        if exc.__cause__ is not None:  # the step's own failure: show where, as python would
            import traceback

            cause = exc.__cause__
            traceback.print_exception(type(cause), cause, cause.__traceback__)
        _error("fit", str(exc))
        return FAILED
    except (TypeError, ValueError) as exc:
        _error("fit", str(exc))
        return BAD_INPUT
    except SystemExit as exc:
        _error("fit", f"the builder {ns.entry}() called {_exit_code_text(exc.code)}; it must build the model, "
                      "optimizer and a batch and return the step function")
        return FAILED
    print(report.table(top=ns.top))
    if ranks is not None:
        print()
        print(ranks.table())
    if fewest is not None:
        print(fewest.line())
    chosen = ns.batch_size or report.max_batch_size or 1  # nothing fits: show batch 1, where it fails
    if chosen:
        try:
            # The fit replayed this batch size already (its trace captured or derived): draw and
            # save that trace instead of capturing the step once more.
            trace = report.trace(chosen)
        except KeyError:  # a size the fit did not probe (none today): capture it as the fit would
            trace = vt.capture(builder, chosen, device="meta", steps=ns.steps, meta={"batch_size": chosen},
                               cuda=target.cuda_choices(),
                               **({"world_size": ns.world_size, "rank": ranks.worst_rank} if ranks is not None else {}))
        pred = vt.replay(trace, target, curves=True)
        page = _write_html("fit", ns.html, trace, pred, f"vramkit fit: {os.path.basename(script)}, batch size "
                                                         f"{chosen}, {target.describe()}")
        if page is None:
            return BAD_INPUT
        print()
        print(f"Timeline (batch size {chosen}): {page}")
        if ns.trace:
            try:
                saved = trace.save(ns.trace)
                print(f"Trace (batch size {chosen}): {saved}  (explore it by category and module: vramkit view {saved})")
            except OSError as exc:
                _error("fit", f"cannot write the trace to {ns.trace!r}: {exc.strerror or exc}")
                return BAD_INPUT
    print(f"({time.perf_counter() - start:.1f} s)", file=sys.stderr)
    return FITS if report.fits else DOES_NOT_FIT


def cmd_replay(ns: argparse.Namespace) -> int:
    from .. import trace as vt
    problem = _output_problem(ns.html, "--html")
    target = _target(ns, "replay")
    if target is None:
        return BAD_INPUT
    if problem:
        _error("replay", problem)
        return BAD_INPUT
    try:
        if ns.device is not None:
            with open(ns.trace, "rb") as f:
                is_vktrace = f.read(len(MAGIC)) == MAGIC
            if is_vktrace:
                _error("replay", f"--device picks one device of a snapshot pickle; {ns.trace!r} is a .vktrace file, "
                                 "which holds one device's trace: leave --device out")
                return BAD_INPUT
            trace = vt.from_torch_snapshot(ns.trace, ns.device)
        else:
            trace = vt.load(ns.trace)
    except FileNotFoundError:
        _error("replay", f"{ns.trace!r} not found")
        return BAD_INPUT
    except IsADirectoryError:
        _error("replay", f"{ns.trace!r} is a directory; TRACE is a .vktrace file or a snapshot pickle")
        return BAD_INPUT
    except OSError as exc:
        _error("replay", f"cannot read {ns.trace!r}: {exc.strerror or exc}")
        return BAD_INPUT
    except (vt.TraceFormatError, ValueError) as exc:
        _error("replay", str(exc))
        return BAD_INPUT
    recorded = trace.meta.get("source") == "torch-snapshot"
    try:
        pred = vt.replay(trace, target, top=ns.top,
                         curves=True)
    except (TypeError, ValueError) as exc:
        _error("replay", str(exc))
        return BAD_INPUT
    print(pred.table(top=ns.top))
    if recorded and "recorded_peak_reserved" in trace.meta:
        print()
        where = trace.meta.get("recorded_on") or "the GPU"
        print(f"recorded on {where}: peak allocated {vt.format_size(trace.meta.get('recorded_peak_allocated', 0))}, "
              f"peak reserved {vt.format_size(trace.meta['recorded_peak_reserved'])}")
    page = _write_html("replay", ns.html, trace, pred, f"vramkit replay: {os.path.basename(ns.trace)} on "
                                                        f"{target.describe()}")
    if page is None:
        return BAD_INPUT
    print(f"\nTimeline: {page}")
    return FITS if pred.fits else DOES_NOT_FIT
