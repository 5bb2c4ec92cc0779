"""What keeps memory alive in a notebook, and letting go of it: the work behind ``%vram_free``.

Three kinds of holder, found through IPython's shell (``shell`` is an
``IPython.core.interactiveshell.InteractiveShell``; IPython is not imported here):

* **the last error**: ``sys.last_traceback`` / ``sys.last_value`` / ``sys.last_exc`` (set by
  IPython for ``%debug`` and ``%tb``), the traceback IPython's formatter keeps
  (``shell.InteractiveTB.tb``) and the previous cell's ``ExecutionResult.error_in_exec``. The
  traceback keeps every frame of the failed code, and with them its local variables: a training
  step that ran out of memory keeps its activations alive, so the next try runs out too.
* **the output history**: ``Out`` (``_oh``), the ``_N`` variables, ``_``, ``__``, ``___`` and
  IPython's own references behind them (the display hook's, the last ``ExecutionResult``'s).
* **the user's variables** (``%who``'s rule: names without a leading underscore that IPython did
  not put there): listed, never cleared.
"""

from __future__ import annotations

import builtins
import re
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Callable

from .notebook_reach import Reach, StorageKey

__all__ = ["Holder", "Survey", "clear_last_error", "clear_outputs", "find_outputs", "survey"]

_NUMBERED_OUTPUT = re.compile(r"_\d+")
_UNDERS = ("_", "__", "___")
_SYS_ERROR = ("last_exc", "last_value", "last_traceback")  # last_exc: Python 3.12 and later


@dataclass
class Holder:
    """One thing keeping memory alive: ``nbytes`` in the arrays, tensors and vramkit Buffers it
    reaches (each storage once), ``devices`` the same by device."""

    name: str
    kind: str  # "error", "output" (both cleared by %vram_free --clear) or "variable" (never)
    nbytes: int
    devices: dict[str, int]
    truncated: bool = False  # the walk stopped early: at least nbytes
    detail: str = ""  # for the error: the frames that hold the most

    @property
    def clearable(self) -> bool:
        return self.kind != "variable"


@dataclass
class Survey:
    """The holders found, largest first within each kind (error, outputs, variables)."""

    holders: list[Holder] = field(default_factory=list)
    freeable: int = 0  # bytes the clearable holders reach that no variable also reaches
    variables_not_listed: int = 0  # variables holding memory beyond the `top` listed


@dataclass
class Output:
    """An object in the output history and the names it goes by there."""

    value: Any
    names: list[str]

    def label(self) -> str:
        first, *others = self.names
        return f"{first} (also {', '.join(others)})" if others else first


def _output_hist(shell: Any) -> dict[int, Any]:
    out = shell.user_ns.get("_oh")
    return out if isinstance(out, dict) else shell.history_manager.output_hist


def skip_ids(shell: Any) -> set[int]:
    """Objects a walk must not enter: each reaches every holder (the namespace, the shell)."""
    objects = [shell, shell.user_ns, shell.user_global_ns, shell.user_ns_hidden, _output_hist(shell),
               getattr(shell, "displayhook", None), getattr(shell, "history_manager", None),
               sys.modules, builtins.__dict__]
    return {id(o) for o in objects if o is not None}


def find_outputs(shell: Any) -> list[Output]:
    """Every distinct object the output history refers to, with its names, oldest first."""
    found: dict[int, Output] = {}

    def note(value: Any, name: str) -> None:
        if value is None or (isinstance(value, str) and not value):
            return  # IPython's placeholders for an empty slot
        names = found.setdefault(id(value), Output(value, [])).names
        if name not in names:
            names.append(name)

    for n, value in sorted(_output_hist(shell).items()):
        note(value, f"Out[{n}]")
    # The display hook pushes _N and _ into the namespace "non-interactively", which also
    # records them in user_ns_hidden: a second reference that %reset out leaves behind.
    for ns in (shell.user_ns, shell.user_ns_hidden):
        for name in sorted((k for k in ns if _NUMBERED_OUTPUT.fullmatch(k)), key=lambda k: int(k[1:])):
            note(ns[name], name)
    hook = getattr(shell, "displayhook", None)
    for name in _UNDERS:
        note(getattr(hook, name, None), name)
    last = getattr(shell, "last_execution_result", None)
    note(getattr(last, "result", None), "the last cell's result")
    return list(found.values())


def _last_error(shell: Any) -> tuple[BaseException | None, list[Any]]:
    """The exception to name, and every object through which the last error is held."""
    roots: list[Any] = [getattr(sys, name, None) for name in _SYS_ERROR]
    roots.append(getattr(getattr(shell, "InteractiveTB", None), "tb", None))
    last = getattr(shell, "last_execution_result", None)
    roots.append(getattr(last, "error_in_exec", None))
    roots = [r for r in roots if r is not None]
    exc = next((r for r in roots if isinstance(r, BaseException)), None)
    return exc, roots


def _describe(exc: BaseException | None) -> str:
    if exc is None:
        return "the last error's traceback"
    text = (str(exc).strip().splitlines() or [""])[0]
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"the last error ({type(exc).__name__}{': ' + text if text else ''})"


def _frames(roots: list[Any]) -> list[types.FrameType]:
    """The frames of the tracebacks among `roots` and of the exceptions' own, each once."""
    frames: dict[int, types.FrameType] = {}
    for first in _tracebacks(roots):
        tb: types.TracebackType | None = first
        while tb is not None:
            frames.setdefault(id(tb.tb_frame), tb.tb_frame)
            tb = tb.tb_next
    return list(frames.values())


def _chain(roots: list[Any]) -> list[Any]:
    """The exceptions and tracebacks in `roots`, with those of chained exceptions (raise ...
    from, or during handling of another), each once."""
    found: dict[int, Any] = {}
    pending = list(roots)
    while pending:
        item = pending.pop()
        if item is None or id(item) in found:
            continue
        found[id(item)] = item
        if isinstance(item, BaseException):
            pending += [item.__traceback__, item.__cause__, item.__context__]
    return list(found.values())


def _tracebacks(roots: list[Any]) -> list[types.TracebackType]:
    return [item for item in _chain(roots) if isinstance(item, types.TracebackType)]


def _frame_detail(roots: list[Any], skip: set[int], fmt: Callable[[int], str]) -> str:
    """The (at most two) frames whose local variables hold the most, with their largest locals."""
    frames = _frames(roots)
    # A local that refers back to the error (IPython's ExecutionResult in run_code, an
    # `except ... as e`) would be charged with every frame: the error itself is not followed.
    skip = skip | {id(item) for item in _chain(roots)} | {id(frame) for frame in frames}
    rows = []
    for frame in frames:
        local_vars = frame.f_locals
        if id(local_vars) in skip:
            continue  # module-level code: its "locals" are the notebook's variables, listed apart
        sizes = [(Reach(skip).add(value).nbytes, name) for name, value in local_vars.items()]
        sizes = sorted((s for s in sizes if s[0] > 0), reverse=True)
        if sizes:
            name = frame.f_code.co_name
            shown = ", ".join(f"{var} {fmt(n)}" for n, var in sizes[:3]) + (", ..." if len(sizes) > 3 else "")
            rows.append((sum(n for n, _ in sizes), f"{name}(): {shown}"))
    rows.sort(key=lambda r: -r[0])
    return "; ".join(text for _, text in rows[:2])


def _variables(shell: Any) -> list[tuple[str, Any]]:
    """The user's variables, by %who's rule."""
    hidden = shell.user_ns_hidden
    missing = object()
    return [(name, value) for name, value in list(shell.user_ns.items())
            if not name.startswith("_") and hidden.get(name, missing) is not value]


def _holder(name: str, kind: str, reach: Reach, detail: str = "") -> Holder:
    return Holder(name, kind, reach.nbytes, reach.by_device(), reach.truncated, detail)


def survey(shell: Any, outputs: list[Output], top: int, fmt: Callable[[int], str]) -> Survey:
    """What holds memory: the last error, the outputs that reach any, and the `top` variables
    that reach the most. `fmt` formats a byte count for the error's frame detail."""
    skip = skip_ids(shell)
    result = Survey()
    clearable: dict[StorageKey, int] = {}
    exc, roots = _last_error(shell)
    if roots:
        reach = Reach(skip).add(*roots)
        if reach.nbytes:
            result.holders.append(_holder(_describe(exc), "error", reach, _frame_detail(roots, skip, fmt)))
            clearable.update(reach.storages)
    found = []
    for out in outputs:
        reach = Reach(skip).add(out.value)
        if reach.nbytes:
            found.append(_holder(out.label(), "output", reach))
            clearable.update(reach.storages)
    result.holders += sorted(found, key=lambda h: -h.nbytes)
    kept: dict[StorageKey, int] = {}
    variables = []
    for name, value in _variables(shell):
        reach = Reach(skip).add(value)
        if reach.nbytes:
            variables.append(_holder(f"variable {name}", "variable", reach))
            kept.update(reach.storages)
    variables.sort(key=lambda h: -h.nbytes)
    result.holders += variables[:top]
    result.variables_not_listed = max(0, len(variables) - top)
    result.freeable = sum(n for key, n in clearable.items() if key not in kept)
    return result


def clear_outputs(shell: Any, outputs: list[Output]) -> None:
    """Drop `outputs` from every place the output history keeps them (what ``%reset out`` does,
    for these objects only)."""
    doomed = {id(out.value) for out in outputs}  # `outputs` keeps them alive until we are done
    history = _output_hist(shell)
    for n in [n for n, value in history.items() if id(value) in doomed]:
        del history[n]
    for ns in (shell.user_ns, shell.user_ns_hidden):
        for name in [k for k in ns if _NUMBERED_OUTPUT.fullmatch(k) and id(ns[k]) in doomed]:
            del ns[name]
    hook = getattr(shell, "displayhook", None)
    for name in _UNDERS:
        value = getattr(hook, name, None)
        if value is not None and id(value) in doomed:
            for ns in (shell.user_ns, shell.user_ns_hidden):
                if ns.get(name) is value:
                    ns[name] = ""  # what IPython puts there when it flushes its output cache
            setattr(hook, name, "")
    last = getattr(shell, "last_execution_result", None)
    if last is not None and id(last.result) in doomed:
        last.result = None


def _clear_frame(frame: types.FrameType) -> None:
    """Drop a finished frame's local variables."""
    try:
        frame.clear()
    except RuntimeError:
        return  # still running (a caller of this code): leave it alone
    # Python 3.11 and 3.12 keep a snapshot dict of the locals once f_locals has been read (the
    # traceback's formatter and the survey read it), and clear() leaves that dict as it was:
    # reading f_locals again syncs it with the frame, now empty.
    _ = frame.f_locals


def clear_last_error(shell: Any) -> bool:
    """Let go of the last error everywhere IPython and Python keep it; returns whether there
    was one. The frames of its tracebacks are cleared too (their local variables dropped, as
    ``traceback.clear_frames`` does), so its memory comes back even where something this does
    not know of still refers to the traceback; ``%debug`` and ``%tb`` have nothing left to show."""
    _, roots = _last_error(shell)
    for frame in _frames(roots):
        _clear_frame(frame)
    for name in ("last_type", *_SYS_ERROR):
        if hasattr(sys, name):
            delattr(sys, name)
    formatter = getattr(shell, "InteractiveTB", None)
    if formatter is not None and getattr(formatter, "tb", None) is not None:
        formatter.tb = None
    last = getattr(shell, "last_execution_result", None)
    if last is not None and getattr(last, "error_in_exec", None) is not None:
        last.error_in_exec = None
    return bool(roots)
