"""Run PyTorch's own tests for activation checkpointing and GradScaler twice: once against torch's
implementation, once with vramkit's drop-ins swapped in, and report which tests pass with torch
but fail with vramkit.

Usage (from the repository root)::

    PYTHONPATH=python python benchmarks/torch_own_tests.py --pytorch-src /tmp/pytorch-src [--json out.json]

``--pytorch-src`` is a directory holding PyTorch's ``test/test_utils.py``, ``test/test_autograd.py``
and ``test/test_torch.py`` (a missing file is reported and its group skipped). They are not part of
this repository: take them from a PyTorch checkout close to the installed torch. If they are
excerpts rather than whole files, put a ``test/SOURCES.json`` beside them saying which commit and
which parts they hold; it is printed with the results. Needs ``torch`` (with
``torch.testing._internal``) and ``expecttest`` (``pip install expecttest``), which torch's test
harness imports.

What runs (the selection rule):

- ``test_utils.py``: every test of ``TestCheckpoint``;
- ``test_autograd.py``: every test of a class whose name contains "Checkpoint"
  (``TestNestedCheckpoint``, ``TestSelectiveActivationCheckpoint``), plus, in any other class
  (``TestAutograd``, ``TestAutogradDeviceType`` instantiated for CPU, ...), every test whose name
  contains "checkpoint" or whose body refers to ``checkpoint``/``checkpoint_sequential``
  (found with ``ast``; e.g. ``test_custom_autograd_ac_early_stop`` calls
  ``torch.utils.checkpoint.checkpoint``). Parametrized and device variants are matched to the
  method they come from;
- ``test_torch.py``: the tests of ``TestTorchDeviceType`` instantiated for CPU whose name matches
  ``grad_scal``/``gradscaler`` (``test_grad_scaling_*``, ``test_grad_scale*``,
  ``test_pickle_gradscaler``) or whose body refers to ``GradScaler``.

Each mode runs in its own subprocess (``--worker``), so patches and global state cannot leak
between them. Both set ``PYTORCH_TESTING_DEVICE_ONLY_FOR=cpu`` (unless already set) and
``PYTORCH_TEST_WITH_SLOW=1`` (``@slowTest`` tests run too). In mode "vramkit":

- ``checkpoint``/``checkpoint_sequential``/``GradScaler`` names in each test module's globals that
  are torch's objects become ``vramkit.checkpoint.checkpoint``/``checkpoint_sequential`` and
  ``vramkit.amp.GradScaler``;
- ``torch.utils.checkpoint.checkpoint`` and ``checkpoint_sequential`` become vramkit's, installed
  in torch's place as a user installs them to reach a library's calls: every call through torch's
  name goes to vramkit, torch's own included (torch's ``checkpoint_sequential``, which vramkit's
  runs, calls ``checkpoint`` through that name). vramkit runs on torch's engine through the
  functions it bound when it was imported, so nothing recurses;
- ``torch.amp.GradScaler``, ``torch.amp.grad_scaler.GradScaler`` and ``torch.GradScaler`` become
  ``vramkit.amp.GradScaler`` (a subclass that only counts constructions); the deprecated aliases
  ``torch.cuda.amp.GradScaler`` and ``torch.cpu.amp.GradScaler`` become subclasses of it with the
  device preset to "cuda"/"cpu" (as torch's aliases preset it). Everything is restored after the run.

The output also counts the calls that went through vramkit (calls of vramkit's checkpoint and
checkpoint_sequential, GradScalers built), and lists tests that never reached vramkit, to show the
swap took effect.

Compatibility shims, applied in both modes alike and listed in the output: names a test file
imports from ``torch.testing._internal`` that the installed torch renamed or dropped
(``_SHIMS``).

Output: per group the tests run and how many pass with each implementation, the tests that pass
with torch but fail with vramkit (first line of the failure, and the reason class from
``KNOWN``: "private" = reads torch internals, "message" = compares exact texts, "behaviour" = a
real difference), skips with their reasons, and any other difference. ``--json`` writes it all.
"""

from __future__ import annotations

import argparse
import ast
import collections
import functools
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import unittest

MODES = ("torch", "vramkit")
_MISSING = object()
CKPT_API = {"checkpoint", "checkpoint_sequential"}
SCALER_API = {"GradScaler"}

# (group label, file, rule); rule(class name, base test name, body refers to the API) -> bool
GROUPS = [
    ("test_utils.py::TestCheckpoint", "test_utils.py", CKPT_API,
     lambda cls, name, uses: cls == "TestCheckpoint"),
    ("test_autograd.py (checkpoint)", "test_autograd.py", CKPT_API,
     lambda cls, name, uses: "Checkpoint" in cls or "checkpoint" in name or uses),
    ("test_torch.py::TestTorchDeviceTypeCPU (GradScaler)", "test_torch.py", SCALER_API,
     lambda cls, name, uses: cls == "TestTorchDeviceType"
     and (re.search(r"grad_?scal", name) is not None or uses)),
]

# Names the test files import from torch.testing._internal that the installed torch renamed or
# dropped: (module, name) -> (replacement factory, note).
_SHIMS = {
    ("torch.testing._internal.common_utils", "skipIfMps"):
        (lambda m: m.skipIfMPS, "renamed skipIfMPS"),
    ("torch.testing._internal.common_cuda", "tf32_is_not_fp32"):
        (lambda m: (lambda: False), "dropped; False (no TF32 on CPU)"),
}

# Why a test that passes with torch fails with vramkit, for the ones read and understood:
# base test name -> (class, explanation). Classes: "private" (reads torch's private attributes or
# internals), "message" (compares exact exception/warning texts), "behaviour" (a real difference).
KNOWN: dict[str, tuple[str, str]] = {
    # None at present. test_checkpointing_without_reentrant_with_context_fn was "message" (vramkit
    # said "only supported with use_reentrant=False", the test matches torch's "when") until
    # vramkit's message took torch's wording.
}

# Tests that fail with torch too, for the ones understood: base test name -> explanation.
KNOWN_BOTH: dict[str, str] = {
    "test_policy_with_state": "the test file expects the SAC policy to be called again during recomputation; "
                              "the installed torch's _CachedTorchDispatchMode ignores policy_fn (test file and "
                              "torch versions differ)",
    "test_function_with_more_than_one_output": "same cause: it counts policy calls in forward and recomputation "
                                               "(expects 2, torch calls the policy once)",
}

COUNTS: collections.Counter = collections.Counter()  # calls that went through vramkit (worker, mode vramkit)


# ---- worker: one mode, in its own process -------------------------------------------------------------

def _counted(function, name: str):
    """vramkit's `function`, counting its calls."""
    @functools.wraps(function)
    def call(*args, **kwargs):
        COUNTS[name] += 1
        return function(*args, **kwargs)
    return call


def _preset_scaler(base: type, device: str | None, name: str) -> type:
    """vramkit's GradScaler, counting constructions; with ``device`` set, torch's deprecated
    device-specific alias (no device argument). Registered at module level, so it pickles."""
    if device is None:
        def __init__(self, *args, **kwargs):
            COUNTS["vramkit.amp.GradScaler()"] += 1
            base.__init__(self, *args, **kwargs)
    else:
        def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
                     enabled=True):
            COUNTS[f"vramkit.amp.GradScaler({device!r}) as torch.{device}.amp.GradScaler"] += 1
            base.__init__(self, device, init_scale=init_scale, growth_factor=growth_factor,
                          backoff_factor=backoff_factor, growth_interval=growth_interval, enabled=enabled)
    cls = type("GradScaler", (base,), {"__init__": __init__, "__module__": __name__, "__qualname__": name})
    setattr(sys.modules[__name__], name, cls)
    return cls


def patch_vramkit(modules: list) -> list:
    """Swap vramkit's names in; returns the undo list."""
    import torch
    import torch.amp.grad_scaler
    import torch.cpu.amp
    import torch.cuda.amp
    import torch.utils.checkpoint as tuc
    import vramkit.amp
    import vramkit.checkpoint
    undo: list = []

    def put(obj, name, value):
        undo.append((obj, name, getattr(obj, name, _MISSING)))
        setattr(obj, name, value)

    vk = vramkit.amp.GradScaler
    swap = {tuc.checkpoint: _counted(vramkit.checkpoint.checkpoint, "vramkit.checkpoint.checkpoint"),
            tuc.checkpoint_sequential: _counted(vramkit.checkpoint.checkpoint_sequential,
                                                "vramkit.checkpoint.checkpoint_sequential"),
            torch.amp.GradScaler: _preset_scaler(vk, None, "VramkitGradScaler"),
            torch.cuda.amp.GradScaler: _preset_scaler(vk, "cuda", "VramkitCudaAmpGradScaler"),
            torch.cpu.amp.GradScaler: _preset_scaler(vk, "cpu", "VramkitCpuAmpGradScaler")}
    for m in modules:  # names the tests imported: replaced outright
        for name, value in list(vars(m).items()):
            try:
                if value in swap:
                    put(m, name, swap[value])
            except TypeError:  # unhashable
                pass
    put(tuc, "checkpoint", swap[tuc.checkpoint])  # in torch's place, as users install it
    put(tuc, "checkpoint_sequential", swap[tuc.checkpoint_sequential])
    for mod in (torch.cuda.amp, sys.modules.get("torch.cuda.amp.grad_scaler"), torch.cpu.amp,
                sys.modules.get("torch.cpu.amp.grad_scaler"), torch.amp, torch.amp.grad_scaler, torch):
        if mod is not None and getattr(mod, "GradScaler", None) in swap:
            put(mod, "GradScaler", swap[mod.GradScaler])
    return undo


def unpatch(undo: list) -> None:
    for obj, name, old in reversed(undo):
        if old is _MISSING:
            delattr(obj, name)
        else:
            setattr(obj, name, old)


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def apply_shims(path: str) -> list[str]:
    """Provide the names a test file imports from torch.testing._internal that torch lacks."""
    applied = []
    for node in ast.walk(ast.parse(_read(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.testing._internal"):
            mod = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(mod, alias.name) and (node.module, alias.name) in _SHIMS:
                    make, note = _SHIMS[(node.module, alias.name)]
                    setattr(mod, alias.name, make(mod))
                    applied.append(f"{node.module}.{alias.name}: {note}")
    return applied


def body_uses(path: str, api: set[str]) -> dict[str, dict[str, bool]]:
    """{class: {method: whether its body refers to a name in api}} from the file's source."""
    out: dict[str, dict[str, bool]] = {}
    for cls in ast.parse(_read(path)).body:
        if isinstance(cls, ast.ClassDef):
            out[cls.name] = {
                fn.name: any((isinstance(n, ast.Name) and n.id in api) or (isinstance(n, ast.Attribute) and n.attr in api)
                             for n in ast.walk(fn))
                for fn in cls.body if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return out


def base_of(cls_name: str, test_name: str, classes: dict) -> tuple[str, str]:
    """The source class and method a generated test comes from (device and parameter suffixes)."""
    src_cls = cls_name
    if src_cls not in classes:
        for suffix in ("CPU", "CUDA", "Meta", "MPS", "XPU"):
            if src_cls.endswith(suffix) and src_cls[: -len(suffix)] in classes:
                src_cls = src_cls[: -len(suffix)]
    methods = classes.get(src_cls, {})
    cands = [m for m in methods if test_name == m or test_name.startswith(m + "_")]
    return src_cls, max(cands, key=len) if cands else test_name


class Recorder(unittest.TestResult):
    """Per test: pass / fail / error / skip, with the first line of the failure."""

    def __init__(self, files: set[str]):
        super().__init__()
        self.files = files
        self.status = "pass"
        self.detail = ""

    def _first_line(self, err) -> str:
        etype, value, tb = err
        where = ""
        for fs in traceback.extract_tb(tb):
            if os.path.basename(fs.filename) in self.files:
                where = f" [{os.path.basename(fs.filename)}:{fs.lineno}]"
        lines = [s for s in str(value).strip().splitlines() if s.strip()]
        return f"{etype.__name__}: {lines[0][:300] if lines else ''}{where}"

    def _bad(self, status, err, prefix=""):
        if self.status not in ("fail", "error"):
            self.status, self.detail = status, prefix + self._first_line(err)

    def addFailure(self, test, err):
        self._bad("fail", err)

    def addError(self, test, err):
        self._bad("error", err)

    def addSubTest(self, test, subtest, err):
        if err is not None:
            is_fail = issubclass(err[0], AssertionError)
            self._bad("fail" if is_fail else "error", err, f"subtest {subtest._subDescription()}: ")

    def addSkip(self, test, reason):
        self.status, self.detail = "skip", str(reason).splitlines()[0] if reason else ""

    def addExpectedFailure(self, test, err):
        self.status, self.detail = "xfail", self._first_line(err)

    def addUnexpectedSuccess(self, test):
        self.status, self.detail = "fail", "unexpected success of an expectedFailure test"


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout("test ran past the per-test time limit")


def worker(src: str, mode: str, out: str, per_test: int) -> None:
    os.environ.setdefault("PYTORCH_TESTING_DEVICE_ONLY_FOR", "cpu")
    os.environ["PYTORCH_TEST_WITH_SLOW"] = "1"
    sys.argv = [sys.argv[0]]  # torch's harness parses the command line on import
    test_dir = os.path.join(src, "test")
    sys.path.insert(0, test_dir)
    import torch
    report = {"mode": mode, "torch": torch.__version__, "shims": [], "import_errors": {}, "tests": {}}
    try:
        import vramkit
        report["vramkit"] = getattr(vramkit, "__version__", "?")
    except Exception as e:  # noqa: BLE001
        report["vramkit"] = f"import failed: {e}"
    loaded = []
    for label, fname, api, rule in GROUPS:
        path = os.path.join(test_dir, fname)
        if not os.path.exists(path):
            report["import_errors"][label] = f"{path} not found"
            continue
        try:
            report["shims"] += [s for s in apply_shims(path) if s not in report["shims"]]
            spec = importlib.util.spec_from_file_location(fname[:-3], path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[fname[:-3]] = module
            spec.loader.exec_module(module)
        except Exception as e:  # noqa: BLE001
            report["import_errors"][label] = f"{type(e).__name__}: {e}"
            continue
        loaded.append((label, fname, api, rule, path, module))
    undo = patch_vramkit([m for *_, m in loaded]) if mode == "vramkit" else []
    signal.signal(signal.SIGALRM, _alarm)
    loader = unittest.TestLoader()
    try:
        for label, fname, api, rule, path, module in loaded:
            classes = body_uses(path, api)
            for cls_name, cls in sorted(vars(module).items()):
                if not (isinstance(cls, type) and issubclass(cls, unittest.TestCase)
                        and cls.__module__ == module.__name__):
                    continue
                for test_name in loader.getTestCaseNames(cls):
                    src_cls, base = base_of(cls_name, test_name, classes)
                    uses = classes.get(src_cls, {}).get(base, False)
                    if src_cls not in classes or not rule(src_cls, base, uses):
                        continue
                    rec = Recorder({os.path.basename(path)})
                    before = sum(COUNTS.values())
                    t0 = time.time()
                    signal.alarm(per_test)
                    try:
                        cls(test_name).run(rec)
                    except _Timeout as e:
                        rec.status, rec.detail = "error", f"timeout: {e}"
                    finally:
                        signal.alarm(0)
                    report["tests"][f"{fname}::{cls_name}::{test_name}"] = {
                        "group": label, "base": base, "status": rec.status, "detail": rec.detail,
                        "seconds": round(time.time() - t0, 2), "vramkit_calls": sum(COUNTS.values()) - before}
    finally:
        unpatch(undo)
    report["vramkit_calls"] = dict(COUNTS)
    with open(out, "w") as f:
        json.dump(report, f)


# ---- parent: run both modes, compare, report --------------------------------------------------------

def run_mode(src: str, mode: str, per_test: int, timeout: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, f"{mode}.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--pytorch-src", src, "--worker", mode,
               "--worker-out", out, "--per-test-timeout", str(per_test)]
        t0 = time.time()
        try:
            proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"mode": mode, "crashed": f"timed out after {timeout} s", "tests": {}}
        if not os.path.exists(out):
            tail = (proc.stdout + proc.stderr)[-3000:]
            return {"mode": mode, "crashed": f"exit code {proc.returncode}; output tail:\n{tail}", "tests": {}}
        with open(out) as f:
            report = json.load(f)
        report["seconds"] = round(time.time() - t0, 1)
        return report


def passed(status: str | None) -> bool:
    return status in ("pass", "xfail")


def compare(reports: dict) -> dict:
    t, v = reports["torch"]["tests"], reports["vramkit"]["tests"]
    groups = collections.OrderedDict((g[0], collections.Counter()) for g in GROUPS)
    regressions, other, skips = [], [], collections.defaultdict(list)
    for tid in sorted(set(t) | set(v)):
        a, b = t.get(tid, {}), v.get(tid, {})
        g = groups[(a or b)["group"]]
        g["run"] += 1
        g["torch"] += passed(a.get("status"))
        g["vramkit"] += passed(b.get("status"))
        if a.get("status") == "skip" and b.get("status") == "skip":
            g["skipped"] += 1
            skips[a["detail"]].append(tid)
        elif passed(a.get("status")) and not passed(b.get("status")):
            g["regressed"] += 1
            base = (a or b)["base"]
            cls, why = KNOWN.get(base, ("unclassified", ""))
            regressions.append({"test": tid, "group": (a or b)["group"], "vramkit": b.get("status", "missing"),
                                "first_line": b.get("detail", ""), "class": cls, "why": why})
        elif a.get("status") != b.get("status"):
            other.append({"test": tid, "torch": a.get("status", "missing"), "torch_detail": a.get("detail", ""),
                          "vramkit": b.get("status", "missing"), "vramkit_detail": b.get("detail", "")})
    untouched = [tid for tid, r in v.items() if r["status"] not in ("skip",) and not r.get("vramkit_calls")]
    both_fail = [tid for tid in t if not passed(t[tid]["status"]) and t[tid]["status"] != "skip"
                 and tid in v and not passed(v[tid]["status"]) and v[tid]["status"] != "skip"]
    return {"groups": {k: dict(c) for k, c in groups.items()}, "regressions": regressions,
            "skips": dict(skips), "other_differences": other,
            "fail_with_both": {tid: (t[tid]["detail"], KNOWN_BOTH.get(t[tid]["base"], "")) for tid in both_fail},
            "vramkit_not_reached": untouched}


def print_report(src: str, reports: dict, result: dict, sources: dict | None) -> None:
    r_t, r_v = reports["torch"], reports["vramkit"]
    print(f"PyTorch tests from {src}/test; torch {r_t.get('torch', '?')}, vramkit {r_v.get('vramkit', '?')}")
    if sources:
        for fname, info in sources.items():
            if isinstance(info, dict):
                whole = "whole file" if info.get("complete") else "EXCERPTS ONLY"
                print(f"  {fname}: commit {info.get('commit', '?')}, {whole}")
                if not info.get("complete"):
                    for part in info.get("parts", []):
                        print(f"      has: {part}")
                    if info.get("omitted"):
                        print(f"      lacks: {info['omitted']}")
                    if info.get("scanned"):
                        print(f"      read: {info['scanned']}")
    else:
        print("  (no test/SOURCES.json: commit and completeness of the files not recorded)")
    for r in (r_t, r_v):
        if r.get("crashed"):
            print(f"\n!! mode {r['mode']} crashed: {r['crashed']}")
        for label, err in r.get("import_errors", {}).items():
            print(f"!! mode {r['mode']}: {label} not run: {err}")
    shims = r_t.get("shims", [])
    if shims:
        print("  compatibility shims (both modes): " + "; ".join(shims))
    print(f"\n{'group':52} {'run':>5} {'torch ok':>9} {'vramkit ok':>11} {'skipped':>8} {'torch-only':>11}")
    tot = collections.Counter()
    for label, c in result["groups"].items():
        print(f"{label:52} {c.get('run', 0):5} {c.get('torch', 0):9} {c.get('vramkit', 0):11} "
              f"{c.get('skipped', 0):8} {c.get('regressed', 0):11}")
        tot.update(c)
    print(f"{'total':52} {tot['run']:5} {tot['torch']:9} {tot['vramkit']:11} {tot['skipped']:8} {tot['regressed']:11}")
    print(f"(seconds: torch {r_t.get('seconds', '?')}, vramkit {r_v.get('seconds', '?')})")
    print("\nPass with torch, fail with vramkit:" + ("" if result["regressions"] else " none"))
    for reg in result["regressions"]:
        print(f"  - {reg['test']}  [{reg['vramkit']}; {reg['class']}]")
        print(f"      {reg['first_line']}")
        if reg["why"]:
            print(f"      why: {reg['why']}")
    if result["other_differences"]:
        print("\nOther differences (not torch-pass/vramkit-fail):")
        for d in result["other_differences"]:
            print(f"  - {d['test']}: torch {d['torch']}, vramkit {d['vramkit']}  {d['vramkit_detail'] or d['torch_detail']}")
    if result["fail_with_both"]:
        print("\nFail with both (not counted against vramkit):")
        for tid, (detail, why) in result["fail_with_both"].items():
            print(f"  - {tid}: {detail}")
            if why:
                print(f"      why: {why}")
    calls = r_v.get("vramkit_calls", {})
    print("\nCalls that went through vramkit in mode vramkit: "
          + (", ".join(f"{k}: {n}" for k, n in sorted(calls.items())) or "none"))
    if result["vramkit_not_reached"]:
        print("Tests run in mode vramkit with no call of vramkit's checkpoint or checkpoint_sequential and no vramkit "
              "GradScaler built (they use only other torch APIs):")
        for tid in result["vramkit_not_reached"]:
            print(f"  - {tid}")
    if result["skips"]:
        print("\nSkipped in both modes:")
        for reason, tids in sorted(result["skips"].items(), key=lambda kv: -len(kv[1])):
            print(f"  {len(tids):3} x {reason}")
            for tid in tids:
                print(f"        {tid}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pytorch-src", required=True, help="directory with test/test_utils.py, test_autograd.py, test_torch.py")
    ap.add_argument("--json", help="write the full results here")
    ap.add_argument("--per-test-timeout", type=int, default=600, help="seconds per test (default 600)")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per mode (default 3600)")
    ap.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    src = os.path.abspath(args.pytorch_src)
    if args.worker:
        worker(src, args.worker, args.worker_out, args.per_test_timeout)
        return 0
    reports = {mode: run_mode(src, mode, args.per_test_timeout, args.timeout) for mode in MODES}
    result = compare(reports)
    sources_path = os.path.join(src, "test", "SOURCES.json")
    sources = json.loads(_read(sources_path)) if os.path.exists(sources_path) else None
    print_report(src, reports, result, sources)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sources": sources, "reports": reports, "comparison": result}, f, indent=1)
    return 1 if any(r.get("crashed") for r in reports.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
