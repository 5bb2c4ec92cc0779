"""The seeded mutation fuzzer over .vktrace files and snapshot pickles (tests/stress/fuzz_files.py).

CI runs a few thousand cases (VRAMKIT_FUZZ_CASES, default 5000, half traces and half
snapshots, with every tenth case also through `vramkit replay`); set it higher, and
VRAMKIT_FUZZ_SEED to another seed, for longer runs. Any outcome other than a successful load
(then replay, report and timeline) or a TraceFormatError fails the test, naming the seed and
the case, and the offending file is kept in the temporary directory.
"""

from __future__ import annotations

import os

import fuzz_files

CASES = int(os.environ.get("VRAMKIT_FUZZ_CASES", "5000"))
SEED = int(os.environ.get("VRAMKIT_FUZZ_SEED", "20261125"))


def test_every_mutated_file_loads_or_is_a_trace_format_error():
    counts = fuzz_files.run(CASES, SEED)
    assert sum(counts.values()) == CASES
    # The mutations must reach past the first checks: some files still load and replay, most are refused.
    assert counts["loaded"] >= CASES // 20, counts
    assert counts["refused"] >= CASES // 2, counts


def test_the_oracle_catches_an_escaping_exception(monkeypatch, tmp_path):
    """The fuzzer can fail: a reader that raises anything but TraceFormatError is reported."""
    import pytest

    from vramkit import trace as vt

    def broken_load(path):
        raise KeyError("length")

    monkeypatch.setattr(vt, "load", broken_load)
    path = tmp_path / "x.vktrace"
    path.write_bytes(b"VKTRACE\0")
    with pytest.raises(fuzz_files.Finding, match="load raised KeyError"):
        fuzz_files.check_file(str(path), str(tmp_path / "x.html"), run_cli=False)
