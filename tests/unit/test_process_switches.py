"""Process-wide switches: caching_allocator_enable() is the process's default, and
caching_allocator_disabled() blocks, which may overlap across threads in any order, turn caching
off while at least one is active (a count, not a flag saved on entry and restored on exit)."""

from __future__ import annotations

import threading

import pytest

import vramkit
from vramkit import _C

MiB = 1 << 20


@pytest.fixture(autouse=True)
def caching_restored():
    """Leave the switch as the other tests expect it: on, no block active."""
    assert _C.caching_disabled_blocks() == 0
    yield
    vramkit.caching_allocator_enable(True)
    assert _C.caching_disabled_blocks() == 0 and _C.caching_enabled()


class Stepper:
    """One thread per block, each entering and leaving caching_allocator_disabled() only when
    told, so the test fixes the interleaving across threads exactly."""

    def __init__(self, count: int) -> None:
        self.go = [threading.Event() for _ in range(2 * count)]  # [i]: enter; [count + i]: exit
        self.done = [threading.Event() for _ in range(2 * count)]
        self.errors: list[BaseException] = []
        self.count = count
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(count)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        try:
            assert self.go[i].wait(30)
            with vramkit.caching_allocator_disabled():
                self.done[i].set()
                assert self.go[self.count + i].wait(30)
        except BaseException as exc:  # reported by the test thread
            self.errors.append(exc)
        finally:
            self.done[i].set()
            self.done[self.count + i].set()

    def step(self, i: int, exit: bool) -> None:
        k = self.count * exit + i
        self.go[k].set()
        assert self.done[k].wait(30), f"thread {i} did not {'exit' if exit else 'enter'}"

    def join(self) -> None:
        for t in self.threads:
            t.join(30)
        assert not self.errors, self.errors


def test_overlapping_blocks_on_eight_threads(sim):
    """The issue's case, widened: blocks entered and left by 8 threads in an interleaved order
    (A enters, B enters, A exits, ...). A flag saved on entry and restored on exit turns caching
    back on while blocks are still active, and leaves it off for good at the end; the count
    keeps it off exactly while any block is active. Each step is checked by what a free does:
    inside a block it gives its segment back at once, after the last one it is cached."""
    order = [("enter", 0), ("enter", 1), ("exit", 0), ("enter", 2), ("enter", 3), ("exit", 2),
             ("enter", 4), ("exit", 1), ("enter", 5), ("enter", 6), ("exit", 4), ("exit", 6),
             ("enter", 7), ("exit", 3), ("exit", 7), ("exit", 5)]
    stepper = Stepper(8)
    active: set[int] = set()
    try:
        for action, i in order:
            stepper.step(i, action == "exit")
            (active.discard if action == "exit" else active.add)(i)
            assert _C.caching_disabled_blocks() == len(active)
            assert _C.caching_enabled() == (not active), (action, i, sorted(active))
            p = vramkit.raw_alloc(30 * MiB, sim)
            vramkit.raw_free(p)
            assert vramkit.memory_reserved(sim) == (0 if active else 30 * MiB), (action, i, sorted(active))
            vramkit.empty_cache(sim)
    finally:
        for k in range(16):  # let every thread finish even if a check failed
            stepper.go[k].set()
        stepper.join()
    assert _C.caching_enabled() and _C.caching_disabled_blocks() == 0
    vramkit.pool_check(sim)


def test_enable_sets_the_default_that_blocks_override(sim):
    """caching_allocator_enable() inside a block changes the default, which applies when the
    last block ends; off before a block stays off after it."""
    with vramkit.caching_allocator_disabled():
        vramkit.caching_allocator_enable(True)
        assert not _C.caching_enabled()  # the block still wins
        with vramkit.caching_allocator_disabled():  # nesting on one thread
            assert _C.caching_disabled_blocks() == 2
        assert not _C.caching_enabled()
    assert _C.caching_enabled()

    vramkit.caching_allocator_enable(False)
    with vramkit.caching_allocator_disabled():
        assert not _C.caching_enabled()
    assert not _C.caching_enabled()  # the user's off, not the block's, is what remains
    p = vramkit.raw_alloc(30 * MiB, sim)
    vramkit.raw_free(p)
    assert vramkit.memory_reserved(sim) == 0
    vramkit.caching_allocator_enable(True)
    assert _C.caching_enabled()


def test_a_block_ends_on_an_exception():
    with pytest.raises(KeyError):
        with vramkit.caching_allocator_disabled():
            assert not _C.caching_enabled()
            raise KeyError("x")
    assert _C.caching_enabled() and _C.caching_disabled_blocks() == 0


def test_an_unmatched_exit_is_an_error_and_changes_nothing():
    with pytest.raises(RuntimeError, match="no caching-disabled block is active: each exit must match an earlier "
                                           r"enter \(caching_allocator_disabled\(\) does both\)"):
        _C.caching_disable_exit()
    assert _C.caching_disabled_blocks() == 0 and _C.caching_enabled()
    _C.caching_disable_enter()
    _C.caching_disable_exit()
    assert _C.caching_enabled()


def test_many_threads_entering_and_leaving_at_once(sim):
    """8 threads × 300 blocks (some nested), freeing inside them, with no ordering: inside
    any block caching is off, and after all of them it is on with nothing counted."""
    failures: list[str] = []
    barrier = threading.Barrier(8)

    def work(n: int) -> None:
        barrier.wait()
        for i in range(300):
            with vramkit.caching_allocator_disabled():
                if _C.caching_enabled():
                    failures.append(f"thread {n}: caching on inside a block")
                if (i + n) % 3 == 0:
                    with vramkit.caching_allocator_disabled():
                        p = vramkit.raw_alloc(MiB, sim)
                        vramkit.raw_free(p)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not failures, failures[:5]
    assert _C.caching_enabled() and _C.caching_disabled_blocks() == 0
    assert vramkit.memory_reserved(sim) == 0  # every free ran inside a block
    vramkit.pool_check(sim)
