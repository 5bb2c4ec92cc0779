"""Whether the captures running now compile a step's graphs for one batch size or for any
(``batch_sizes_vary``: ``fit``'s search). Read by ``module_tags`` (the hooks' keys, which dynamo
guards) and ``inductor_on_meta`` (dynamo's automatic dynamic shapes); imports nothing of
vramkit's, so both can."""

from __future__ import annotations

import contextlib
from typing import Iterator

__all__ = ["batch_sizes_vary", "batch_sizes_varying"]

_BATCH_SIZES_VARY = False  # see batch_sizes_vary


@contextlib.contextmanager
def batch_sizes_vary() -> Iterator[None]:
    """Captures inside (``fit``'s search, at many batch sizes) reuse the graphs compiled by
    earlier captures inside, and compile as dynamo does when a step's shapes change: the first
    graph static, and at the first other batch size one with the changed sizes symbolic, which
    later captures reuse unless one of its guards fails (a range it assumed). A capture alone
    compiles its graphs afresh, static, as a run's first step at one batch size does. The
    figures differ where inductor plans symbolic sizes otherwise (Hugging Face GPT-2: by 1-3 %)
    and where compiling holds tensors longer (``module_tags``), so ``fit`` confirms its answer
    with captures made outside."""
    global _BATCH_SIZES_VARY
    previous, _BATCH_SIZES_VARY = _BATCH_SIZES_VARY, True
    try:
        yield
    finally:
        _BATCH_SIZES_VARY = previous


def batch_sizes_varying() -> bool:
    """Whether captures now run under ``batch_sizes_vary``."""
    return _BATCH_SIZES_VARY
