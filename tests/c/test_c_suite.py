"""Build and run the C tests in tests/c against the allocator core (csrc/util, alloc,
backends; no Python), once with -Werror optimisation and once under AddressSanitizer and
UndefinedBehaviorSanitizer; the thread test also runs under ThreadSanitizer where the
toolchain supports it. Each C test prints "N checks, 0 failures" and exits 0 on success."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
CORE = sorted(glob.glob(os.path.join(REPO, "csrc", d, "*.c")) for d in ("util", "alloc", "backends", "kernels", "checkpoint"))
CORE = sorted(p for group in CORE for p in group)
TESTS = sorted(os.path.basename(p)[:-2] for p in glob.glob(os.path.join(HERE, "test_*.c")))
CC = os.environ.get("CC", "gcc")
BASE_FLAGS = ["-std=c11", "-D_DEFAULT_SOURCE", "-Wall", "-Wextra", "-Werror", "-g",
              "-I" + os.path.join(REPO, "csrc", "include"), "-I" + HERE]
MODES = {
    "release": ["-O2"],
    "asan-ubsan": ["-O1", "-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=all"],
}

pytestmark = pytest.mark.skipif(shutil.which(CC) is None, reason=f"no C compiler ({CC}) on PATH")


def cuda_home() -> str | None:
    for root in filter(None, [os.environ.get("CUDA_HOME"), "/usr/local/cuda", "/opt/cuda"]):
        if os.path.exists(os.path.join(root, "include", "cuda_runtime_api.h")) and \
                os.path.exists(os.path.join(root, "lib64", "libcudart_static.a")):
            return root
    return None


def test_cuda_backend_links_and_degrades_without_a_driver(tmp_path):
    """Build the C API test with the real CUDA backend on the static runtime: it must link,
    and on a machine without a GPU report CUDA as unavailable instead of failing."""
    root = cuda_home()
    if root is None:
        pytest.skip("no CUDA toolkit (headers and libcudart_static.a) found")
    exe = str(tmp_path / "test_api_cuda")
    # The CUDA kernels' C wrappers need the nvcc-built objects, which this C-only build lacks.
    core = [p for p in CORE if os.path.basename(p) != "amp_cuda_api.c"]
    cmd = [CC, *BASE_FLAGS, "-O1", "-DVRAMKIT_WITH_CUDA", "-I" + os.path.join(root, "include"), *core,
           os.path.join(HERE, "test_api.c"), "-o", exe, os.path.join(root, "lib64", "libcudart_static.a"),
           "-lrt", "-ldl", "-lpthread", "-lstdc++", "-lm"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    out = run(exe)
    assert "ok   test_cuda_backend_degrades_without_a_gpu" in out


def build(tmp_path, test: str, flags: list[str]) -> str:
    exe = str(tmp_path / test)
    cmd = [CC, *BASE_FLAGS, *flags, *CORE, os.path.join(HERE, test + ".c"), "-o", exe, "-lpthread", "-lm", "-ldl"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, f"compiling {test} failed:\n{result.stderr}"
    return exe


def run(exe: str, *args: str) -> str:
    env = dict(os.environ, ASAN_OPTIONS="abort_on_error=0:detect_leaks=1", UBSAN_OPTIONS="print_stacktrace=1")
    result = subprocess.run([exe, *args], capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, f"{os.path.basename(exe)} failed:\n{result.stdout}\n{result.stderr}"
    assert " 0 failures" in result.stdout, result.stdout
    assert "FAIL" not in result.stdout, result.stdout
    return result.stdout


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("test", TESTS)
def test_c(tmp_path, test, mode):
    exe = build(tmp_path, test, MODES[mode])
    out = run(exe)
    if test == "test_random":
        # 100,000 random operations on a simulated device and 25,000 on the cpu pool, with
        # classic and with expandable segments, checked against the C model and
        # vram_pool_check after every one of them.
        assert out.count("100000 ops") == 2 and out.count("25000 ops") == 2, out
        assert "expandable segments:" in out and out.count(" 0 violations") == 4, out


@pytest.mark.parametrize("mode", sorted(MODES))
def test_torch_hooks_from_cpp(tmp_path, mode):
    """The hooks torch's CUDAPluggableAllocator calls, driven from C++ as torch drives them,
    routed to a simulated device: a failed allocation must throw std::runtime_error with
    vramkit's message (tests/c/test_torch_hooks.cpp)."""
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        pytest.skip(f"no C++ compiler ({cxx}) on PATH")
    c_sources = CORE + sorted(glob.glob(os.path.join(REPO, "csrc", "torch", "*.c")))
    objdir = tmp_path / "obj"
    objdir.mkdir()
    result = subprocess.run([CC, "-c", *BASE_FLAGS, *MODES[mode], *c_sources], cwd=objdir, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    exe = str(tmp_path / "test_torch_hooks")
    cmd = [cxx, "-std=c++17", "-Wall", "-Wextra", "-Werror", "-g", *MODES[mode], "-I" + os.path.join(REPO, "csrc", "include"),
           os.path.join(HERE, "test_torch_hooks.cpp"), os.path.join(REPO, "csrc", "torch", "malloc_shim.cpp"),
           *sorted(str(p) for p in objdir.glob("*.o")), "-o", exe, "-lpthread", "-ldl", "-lm"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    out = run(exe)
    assert "22 checks, 0 failures" in out


def _tsan_works(tmp_path) -> bool:
    src = tmp_path / "probe.c"
    src.write_text("int main(void) { return 0; }\n")
    exe = str(tmp_path / "probe")
    if subprocess.run([CC, "-fsanitize=thread", str(src), "-o", exe], capture_output=True).returncode != 0:
        return False
    return subprocess.run([exe], capture_output=True).returncode == 0


def test_threads_under_thread_sanitizer(tmp_path):
    if not _tsan_works(tmp_path):
        pytest.skip("ThreadSanitizer does not build or run with this toolchain")
    exe = build(tmp_path, "test_threads", ["-O1", "-fsanitize=thread"])
    env = dict(os.environ, TSAN_OPTIONS="halt_on_error=1")
    result = subprocess.run([exe], capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WARNING: ThreadSanitizer" not in result.stderr, result.stderr


AARCH64_CC = "aarch64-linux-gnu-gcc"
AARCH64_TESTS = ("test_amp", "test_amp_scale_rule", "test_alloc", "test_host")


def test_aarch64_cross_build(tmp_path):
    """Cross-compile the C core (kernels included: the x86 SIMD files must reduce to their
    unsupported stubs) and the kernel and allocator tests for aarch64 with -Werror, statically
    linked, and run them under qemu user-mode emulation: the portable path must be the one in
    use and every check must pass."""
    cc = shutil.which(AARCH64_CC)
    qemu = shutil.which("qemu-aarch64-static") or shutil.which("qemu-aarch64")
    if cc is None or qemu is None:
        pytest.skip(f"needs {AARCH64_CC} and qemu-aarch64(-static) on PATH "
                    "(Debian/Ubuntu: apt-get install gcc-aarch64-linux-gnu qemu-user-static)")
    probe = tmp_path / "probe.c"
    probe.write_text("#include <stdio.h>\nint main(void) { puts(\"ok\"); return 0; }\n")
    probe_exe = str(tmp_path / "probe")
    if subprocess.run([cc, "-static", str(probe), "-o", probe_exe], capture_output=True).returncode != 0:
        pytest.skip(f"{AARCH64_CC} cannot link static programs (install libc6-dev-arm64-cross)")
    env = dict(os.environ, QEMU_LD_PREFIX="/usr/aarch64-linux-gnu")
    for test in AARCH64_TESTS:
        exe = str(tmp_path / (test + "_aarch64"))
        cmd = [cc, *BASE_FLAGS, "-O2", "-static", *CORE, os.path.join(HERE, test + ".c"), "-o", exe,
               "-lpthread", "-lm", "-ldl"]
        result = subprocess.run(cmd, capture_output=True, text=True)
        assert result.returncode == 0, f"cross-compiling {test} for aarch64 failed:\n{result.stderr}"
        result = subprocess.run([qemu, exe], capture_output=True, text=True, env=env, timeout=900)
        assert result.returncode == 0, f"{test} (aarch64) failed:\n{result.stdout}\n{result.stderr}"
        assert " 0 failures" in result.stdout and "FAIL" not in result.stdout, result.stdout
        if test == "test_amp":
            assert "simd paths supported here: portable\n" in result.stdout, result.stdout
