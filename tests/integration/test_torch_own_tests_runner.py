"""benchmarks/torch_own_tests.py, the runner of PyTorch's own tests against vramkit's names, on a
stand-in for PyTorch's test_utils.py written here (PyTorch's files are not in this repository):
one test that both implementations pass, and one that only torch passes (torch takes
use_reentrant="yes" as true; vramkit refuses it), which the runner must list as such."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from test_benchmarks_smoke import REPO, _env

pytest.importorskip("torch")
RUNNER = os.path.join(REPO, "benchmarks", "torch_own_tests.py")

STAND_IN = textwrap.dedent("""
    import unittest

    import torch
    from torch.utils.checkpoint import checkpoint


    class TestCheckpoint(unittest.TestCase):
        def test_context_fn_with_reentrant_is_refused(self):
            x = torch.ones(2, requires_grad=True)
            with self.assertRaisesRegex(ValueError, "only supported when use_reentrant=False"):
                checkpoint(torch.sin, x, use_reentrant=True, context_fn=lambda: (None, None))

        def test_truthy_use_reentrant(self):
            x = torch.ones(2, requires_grad=True)
            checkpoint(torch.sin, x, use_reentrant="yes").sum().backward()
            self.assertTrue(torch.equal(x.grad, torch.cos(x.detach())))
""")


def test_the_runner_counts_both_modes_and_lists_what_only_torch_passes(tmp_path):
    if not os.path.exists(RUNNER):
        pytest.skip("benchmarks/ is not part of this installation")
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "test_utils.py").write_text(STAND_IN)
    proc = subprocess.run([sys.executable, RUNNER, "--pytorch-src", str(tmp_path)], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=600, check=False)
    out = proc.stdout
    assert "test_utils.py::TestCheckpoint                            2         2           1        0           1" \
        in out, out + proc.stderr
    torch_only = out.split("Pass with torch, fail with vramkit:")[1].split("\n\n")[0]
    assert "test_truthy_use_reentrant" in torch_only
    assert "use_reentrant must be True, False or None" in torch_only
    assert "test_context_fn_with_reentrant_is_refused" not in torch_only
