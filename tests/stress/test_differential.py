"""Randomized differential test: 100,000 random operations on a simulated device and on the
real cpu pool, each with the classic policy and with expandable segments (alloc of 1 B to 64 MiB on three streams, free, record_stream on a fourth and
fifth stream, synchronize, empty_cache, limit changes and bad input), each checked against a
plain Python model and vramkit.pool_check(). Zero violations are allowed. A Hypothesis state
machine drives the same model with shrinking, so a failure comes with a minimal sequence.

VRAMKIT_DIFF_OPS overrides the operation count (CI runs the full count, also under ASan)."""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import vramkit
from allocator_model import AllocatorModel

OPS = int(os.environ.get("VRAMKIT_DIFF_OPS", "100000"))
MiB = 1 << 20
LIMITS = [None, 64 * MiB, 256 * MiB, 1024 * MiB]


def random_size(rng: random.Random) -> int:
    return 1 + rng.randrange(1 << rng.randrange(27))  # log-uniform from 1 B to 64 MiB


def run_random(model: AllocatorModel, ops: int, seed: int) -> None:
    rng = random.Random(seed)
    for op in range(ops):
        r = rng.random()
        if r < 0.45 and len(model.live) < 200:
            model.alloc(random_size(rng), rng.randrange(3))
        elif r < 0.85 and model.live:
            ptr = rng.choice(list(model.live))
            model.free(ptr, rng.choice([3, 4]) if rng.random() < 0.25 else None)
        elif r < 0.92:
            model.synchronize(rng.choice([3, 4]))
        elif r < 0.94:
            model.empty_cache()
        elif r < 0.97:
            model.bad_input(rng.randrange(100))
        else:
            vramkit.set_memory_limit(rng.choice(LIMITS), model.device)
        model.check(f"op {op}")
        assert not model.violations, model.violations[:5]
    vramkit.set_memory_limit(None, model.device)
    model.drain()
    assert not model.violations, model.violations[:5]


@pytest.mark.slow
@pytest.mark.parametrize("expandable", [False, True], ids=["classic", "expandable"])
def test_sim_differential(expandable):
    device = vramkit.sim.create(1536 * MiB)
    if expandable:
        vramkit.configure(device, expandable_segments=True)
    model = AllocatorModel(device, touch_memory=False, expandable=expandable)
    run_random(model, OPS, seed=20261122)
    assert model.ooms > 0  # the limits and capacity made the OOM path run too
    if expandable:  # pages were mapped and unmapped, never whole segments
        s = vramkit.memory_stats(device)
        assert s["num_device_free"] > 0 and s["segment.all.peak"] == 0, s


@pytest.mark.slow
@pytest.mark.parametrize("expandable", [False, True], ids=["classic", "expandable"])
def test_cpu_differential(expandable):
    # Exercise the oversize rules on real memory. The model is PyTorch's policy, which has no
    # host cache limit: lift it, so a machine with little RAM gives the same sequence. Pages
    # are still given back (64 MiB blocks; with expandable segments 8 MiB, unmapped) and
    # checked by pool_check after every step; the model checks the bytes of live blocks.
    before = vramkit.get_settings("cpu")
    vramkit.configure("cpu", max_split_size_mb=32, host_cache_limit_fraction=None)
    if expandable:
        vramkit.configure("cpu", expandable_segments=True, host_page_release_mb=8)
    try:
        model = AllocatorModel("cpu", touch_memory=True, max_split=32 * MiB, expandable=expandable)
        run_random(model, OPS, seed=7)
        if expandable:
            assert vramkit.memory_stats("cpu")["num_device_free"] > 0
    finally:
        vramkit.configure("cpu", max_split_size_mb=None, host_cache_limit_fraction=before["host_cache_limit_fraction"],
                          host_page_release_mb=before["host_page_release"] >> 20, expandable_segments=False)


class AllocatorMachine(RuleBasedStateMachine):
    """The same model, driven by Hypothesis so that failures shrink to a short sequence."""

    expandable = False

    def __init__(self):
        super().__init__()
        device = vramkit.sim.create(256 * MiB)
        if self.expandable:
            vramkit.configure(device, expandable_segments=True)
        self.model = AllocatorModel(device, touch_memory=False, expandable=self.expandable)

    @rule(nbytes=st.integers(1, 64 * MiB) | st.integers(1, 4096), stream=st.integers(0, 2))
    def alloc(self, nbytes, stream):
        self.model.alloc(nbytes, stream)

    @precondition(lambda self: self.model.live)
    @rule(data=st.data(), other=st.sampled_from([None, 3, 4]))
    def free(self, data, other):
        self.model.free(data.draw(st.sampled_from(sorted(self.model.live))), other)

    @rule(stream=st.sampled_from([3, 4]))
    def synchronize(self, stream):
        self.model.synchronize(stream)

    @rule()
    def empty_cache(self):
        self.model.empty_cache()

    @rule(limit=st.sampled_from(LIMITS))
    def limit(self, limit):
        vramkit.set_memory_limit(limit, self.model.device)

    @invariant()
    def consistent(self):
        self.model.check("invariant")
        assert not self.model.violations, self.model.violations[:5]

    def teardown(self):
        vramkit.set_memory_limit(None, self.model.device)
        self.model.drain()
        assert not self.model.violations, self.model.violations[:5]


class ExpandableAllocatorMachine(AllocatorMachine):
    expandable = True


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=40, stateful_step_count=60, deadline=None)
TestExpandableAllocatorMachine = ExpandableAllocatorMachine.TestCase
TestExpandableAllocatorMachine.settings = settings(max_examples=40, stateful_step_count=60, deadline=None)
