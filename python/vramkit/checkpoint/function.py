"""``vramkit.checkpoint.checkpoint``: torch's activation checkpointing, with vramkit's checks.

It runs on torch's own engine, ``torch.utils.checkpoint.checkpoint``, so nesting, early stop,
``torch.autograd.grad`` inside the function, ``GraphExecGroup``, ``context_fn``, selective
activation checkpointing and ``debug=True`` behave exactly as in the installed torch, and so do
the defaults. What vramkit adds before handing over:

- every argument is checked first, and a bad one is a TypeError or ValueError that names what is
  allowed (torch takes ``use_reentrant="no"`` as true, and finds a bad ``context_fn`` only when
  unpacking its result);
- with ``use_reentrant`` omitted, the installed torch's default and warning, read from torch on
  first use (not copied from one version), are reported at the caller's line instead of inside
  vramkit.

It can be installed in torch's place, ``torch.utils.checkpoint.checkpoint =
vramkit.checkpoint.checkpoint`` (and ``checkpoint_sequential`` likewise), so that code calling
torch's name (a library's model) gets vramkit's: torch's functions are bound here once, when
this module is imported, never looked up on ``torch.utils.checkpoint`` at call time.

vramkit's own executor runs only the planner's schedules (``sequential.py``): torch's checkpoint
reruns a function call, while the planner's schedules keep everything, only the input or nothing
per stage and per recomputation, in an order that is not a nesting of calls."""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.utils.checkpoint import noop_context_fn

__all__ = ["checkpoint", "noop_context_fn"]

# On each of vramkit's drop-ins: the torch function it calls.
TORCH_ORIGINAL = "_vramkit_torch_original"


def _torch_own(name: str) -> Callable[..., Any]:
    """torch.utils.checkpoint's `name` as torch defines it. If vramkit's drop-in is in its place
    already (this module imported again after a user installed the drop-in: a reload, or a test
    harness that drops vramkit's modules but keeps torch's), the torch function that drop-in
    calls: binding vramkit's own would make every call recurse until RecursionError."""
    found = getattr(torch_checkpoint, name)
    original: Callable[..., Any] = getattr(found, TORCH_ORIGINAL, found)
    return original


# Bound once: a user may put vramkit's functions in torch's place (to reach the calls a library
# makes through torch's name), and looking torch's up at call time would then find vramkit's.
torch_own_checkpoint = _torch_own("checkpoint")
torch_own_checkpoint_sequential = _torch_own("checkpoint_sequential")


# ---- torch's default for use_reentrant, read from torch --------------------------------------------

@functools.cache
def torch_default(which: str) -> tuple[bool, tuple[tuple[str, type[Warning]], ...]] | None:
    """What the installed torch does when ``use_reentrant`` is omitted from ``checkpoint`` or
    ``checkpoint_sequential``: (whether it then runs reentrant, the warnings it gives), found by
    running it once on a one-element tensor; None if torch refuses the omission (then vramkit
    passes the omission through and torch raises)."""
    runs_under_grad: list[bool] = []

    def probe(t: torch.Tensor) -> torch.Tensor:
        runs_under_grad.append(torch.is_grad_enabled())  # the reentrant variant runs it under no_grad
        return t * 2

    x = torch.ones(1, requires_grad=True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if which == "checkpoint":
                torch_own_checkpoint(probe, x)
            else:
                torch_own_checkpoint_sequential([probe, probe], 2, x)
    except Exception:  # noqa: BLE001 -- a torch that requires the argument: it will say so itself
        return None
    return not runs_under_grad[0], tuple((str(w.message), w.category) for w in caught)


def resolve_use_reentrant(use_reentrant: Any, which: str) -> bool | None:
    """``use_reentrant`` checked; when None, torch's default with torch's warnings, attributed to
    the line that called vramkit (two frames up)."""
    if use_reentrant is not None and not isinstance(use_reentrant, bool):
        raise TypeError(f"{which}: use_reentrant must be True, False or None (torch's default, with its warning), "
                        f"got {use_reentrant!r}")
    if use_reentrant is not None:
        return use_reentrant
    default = torch_default(which)
    if default is None:
        return None
    reentrant, caught = default
    for message, category in caught:
        warnings.warn(message, category, stacklevel=3)
    return reentrant


# ---- checkpoint -------------------------------------------------------------------------------------

def _checked_context_fn(context_fn: Callable[[], Any]) -> Callable[[], Any]:
    if not callable(context_fn):
        raise TypeError(f"checkpoint: context_fn must be a callable returning two context managers, got "
                        f"{type(context_fn).__name__}")
    if context_fn is noop_context_fn:
        return context_fn  # torch's reentrant variant recognises its own no-op by identity

    def checked() -> Any:
        pair = context_fn()
        if not (isinstance(pair, tuple) and len(pair) == 2
                and all(hasattr(c, "__enter__") and hasattr(c, "__exit__") for c in pair)):
            raise TypeError("context_fn must return a tuple of two context managers (forward, recomputation), "
                            f"got {type(pair).__name__}")
        return pair

    return checked


def _determinism_checks() -> list[str]:
    return list(getattr(torch_checkpoint, "_allowed_determinism_checks_to_fns", {"default": None, "none": None}))


def checkpoint(function: Callable[..., Any], *args: Any, use_reentrant: bool | None = None,
               context_fn: Callable[[], Any] = noop_context_fn, determinism_check: str = "default", debug: bool = False,
               early_stop: bool = True, preserve_rng_state: bool = True, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` without keeping its intermediate activations: they are
    recomputed during backward, by ``torch.utils.checkpoint.checkpoint`` (same arguments, same
    defaults, same behaviour). The arguments are checked first: ``use_reentrant``,
    ``preserve_rng_state``, ``debug`` and ``early_stop`` must be bools (``use_reentrant`` may be
    None: torch's default, with torch's warning at your line), ``determinism_check`` one of
    torch's modes, ``context_fn`` a callable returning two context managers, and keyword
    arguments for ``function`` need ``use_reentrant=False``.
    """
    if not callable(function):
        raise TypeError(f"checkpoint: function must be callable (a module or function), got "
                        f"{type(function).__name__}")
    for name, v in (("preserve_rng_state", preserve_rng_state), ("debug", debug), ("early_stop", early_stop)):
        if not isinstance(v, bool):
            raise TypeError(f"checkpoint: {name} must be True or False, got {v!r}")
    allowed = _determinism_checks()
    if determinism_check not in allowed:
        raise ValueError(f"checkpoint: determinism_check must be one of {allowed}, got {determinism_check!r}")
    checked_context_fn = _checked_context_fn(context_fn)
    reentrant = resolve_use_reentrant(use_reentrant, "checkpoint")
    if reentrant and (context_fn is not noop_context_fn or debug):
        raise ValueError("checkpoint: context_fn and debug are only supported when use_reentrant=False")
    if reentrant and kwargs:
        raise ValueError(f"checkpoint: unexpected keyword arguments with use_reentrant=True: "
                         f"{', '.join(kwargs)} (keyword arguments to the function need use_reentrant=False)")
    return torch_own_checkpoint(function, *args, use_reentrant=reentrant, context_fn=checked_context_fn,
                                determinism_check=determinism_check, debug=debug, early_stop=early_stop,
                                preserve_rng_state=preserve_rng_state, **kwargs)


setattr(checkpoint, TORCH_ORIGINAL, torch_own_checkpoint)


def _order_error(functions: Any, segments: Any, input: Any, budget: Any) -> TypeError:
    what = "budget=" + repr(budget) if budget is not None else "budget=0.5"
    return TypeError(
        f"checkpoint_sequential: segments must be an int (or None with budget=), got a {type(segments).__name__}. "
        "The argument order changed to torch's: checkpoint_sequential(functions, segments, input, "
        f"use_reentrant=None, *, budget=None, ...); call checkpoint_sequential(model, None, x, {what}) for a "
        "planned schedule, or checkpoint_sequential(model, 4, x) for torch's equal segments")
