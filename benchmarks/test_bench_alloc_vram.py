"""pytest-benchmark suite with memory beside time: vramkit's ``vram`` fixture.

Each benchmark takes pytest-benchmark's ``benchmark`` and vramkit's ``vram``: pytest-benchmark
prints its time table, vramkit's plugin a second one with each benchmark's peak allocated and
reserved bytes beside the times, and ``--benchmark-json`` has the figures in ``extra_info``::

    PYTHONPATH=python python -m pytest benchmarks/test_bench_alloc_vram.py

(``PYTHONPATH=python`` for the in-place build, as for the other benchmarks; it also makes pytest
load the source tree's plugin. ``python -m pytest`` without a path collects only ``tests/``.)

Groups:

* ``alloc+free #N: <size>``: one allocation and its free, three ways: ``raw_alloc``/``raw_free`` on
  vramkit's cpu pool; ``np.empty`` with NumPy's default allocator; ``np.empty`` with vramkit's
  NumPy handler. The timed calls use the allocator named; the memory figures for NumPy's
  default allocator come from the fixture's one extra untimed call with vramkit's handler (NumPy
  keeps no counters), so they show what the array needs, as the pool would hold it.
* ``temporaries``: the same arithmetic on 8 MiB float64 inputs written as one expression (NumPy
  reuses its temporaries: one 8 MiB buffer), with named intermediates (each kept alive to the
  end: three, 24 MiB) and in place into a preallocated output (512 B: the sum's result).

No assertions on time; tests/integration/test_pytest_benchmark_vram.py runs this file in a short
smoke mode and checks the memory figures.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest
from _common import use_source_tree

use_source_tree()

import vramkit  # noqa: E402
import vramkit.numpy as vnp  # noqa: E402

SIZES = {"4KiB": 4 << 10, "1MiB": 1 << 20, "16MiB": 16 << 20}
# pytest-benchmark orders groups by name: the number keeps them in size order
GROUPS = {size: f"alloc+free #{i}: {label}" for i, (label, size) in enumerate(SIZES.items(), 1)}
ELEMENTS = 1 << 20  # float64: 8 MiB per array


def _raw_pair(size: int) -> None:
    vramkit.raw_free(vramkit.raw_alloc(size, "cpu"))


@pytest.mark.parametrize("size", list(SIZES.values()), ids=list(SIZES))
def test_alloc_free_raw(benchmark: Any, vram: Any, size: int) -> None:
    benchmark.group = GROUPS[size]
    benchmark(_raw_pair, size)


@pytest.mark.parametrize("size", list(SIZES.values()), ids=list(SIZES))
def test_alloc_free_numpy_default(benchmark: Any, vram: Any, size: int) -> None:
    benchmark.group = GROUPS[size]
    assert not vnp.is_installed()
    benchmark(np.empty, size, np.uint8)


@pytest.mark.parametrize("size", list(SIZES.values()), ids=list(SIZES))
def test_alloc_free_numpy_vramkit(benchmark: Any, vram: Any, size: int) -> None:
    benchmark.group = GROUPS[size]
    with vnp.caching():
        benchmark(np.empty, size, np.uint8)


@pytest.fixture(scope="module")
def inputs() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1234)
    return rng.random(ELEMENTS), rng.random(ELEMENTS)


def _expression(a: np.ndarray, b: np.ndarray) -> float:
    return float(((a * 1.5 + b) ** 2).sum())


def _named(a: np.ndarray, b: np.ndarray) -> float:
    scaled = a * 1.5
    shifted = scaled + b
    squared = shifted ** 2
    return float(squared.sum())


def _in_place(out: np.ndarray) -> Callable[[np.ndarray, np.ndarray], float]:
    def run(a: np.ndarray, b: np.ndarray) -> float:
        np.multiply(a, 1.5, out=out)
        np.add(out, b, out=out)
        np.square(out, out=out)
        return float(out.sum())

    return run


@pytest.mark.benchmark(group="temporaries, 8 MiB float64")
@pytest.mark.parametrize("form", ["expression", "named", "in_place"])
def test_temporaries(benchmark: Any, vram: Any, inputs: tuple[np.ndarray, np.ndarray], form: str) -> None:
    a, b = inputs
    function = {"expression": _expression, "named": _named, "in_place": _in_place(np.empty_like(a))}[form]
    result = benchmark(function, a, b)
    assert result == pytest.approx(_expression(a, b), rel=1e-12)  # the three forms compute the same
