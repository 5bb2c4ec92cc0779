"""Build vramkit._C from csrc/.

Switches (environment variables):
  VRAMKIT_CUDA=auto|0|1     build the CUDA backend and kernels (auto: when nvcc is found)
  CUDA_HOME                 where the CUDA toolkit lives (else derived from nvcc on PATH)
  VRAMKIT_CUDA_ARCHS="80;90"  compute capabilities to build for (default Ampere and Hopper)
  VRAMKIT_WERROR=1          treat C warnings as errors (CI sets this)
  VRAMKIT_SANITIZE=address,undefined   build with sanitizers (run with libasan preloaded)
  VRAMKIT_DEBUG=1           -O0 -g
  VRAMKIT_LTO=auto|0|1      link-time optimisation (auto: when the compiler can link with it)
"""

import glob
import os
import shutil
import subprocess

import numpy
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


def env_flag(name, default="0"):
    return os.environ.get(name, default).strip().lower() in ("1", "true", "yes", "on")


def find_cuda():
    """Return CUDA_HOME if CUDA sources should be built, else None."""
    mode = os.environ.get("VRAMKIT_CUDA", "auto").strip().lower()
    if mode in ("0", "off", "false", "no"):
        return None
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidates = [home] if home else []
    nvcc = shutil.which("nvcc")
    if nvcc and not home:
        # nvcc on PATH may be a wrapper script; look for the toolkit beside it and in the usual places.
        candidates += [os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "/usr/local/cuda", "/opt/cuda"]
    for root in candidates:
        if os.path.exists(os.path.join(root, "bin", "nvcc")) and os.path.exists(
                os.path.join(root, "include", "cuda_runtime_api.h")):
            return root
    if mode in ("1", "on", "true", "yes"):
        raise RuntimeError("VRAMKIT_CUDA=1 but no CUDA toolkit was found (set CUDA_HOME or put nvcc on PATH)")
    return None


def lto_links():
    """Whether the compiler Python builds with can link a shared object with -flto=auto
    (VRAMKIT_LTO=0|1|auto). Some toolchains pair a gcc with a linker that cannot run its
    lto-wrapper (seen on the GPU machine: /opt/gcc's gcc with /usr/bin/ld); build without LTO there."""
    choice = os.environ.get("VRAMKIT_LTO", "auto")
    if choice in ("0", "1"):
        return choice == "1"
    import sysconfig
    import tempfile

    cc = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.c")
        with open(src, "w") as f:
            f.write("int vramkit_lto_probe(int x) { return x + 1; }\n")
        cmd = cc + ["-shared", "-fPIC", "-O2", "-flto=auto", src, "-o", os.path.join(tmp, "probe.so")]
        try:
            return subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0
        except OSError:
            return False


def sources(*patterns):
    return sorted(p for pattern in patterns for p in glob.glob(os.path.join("csrc", pattern)))


CUDA_HOME = find_cuda()
SANITIZE = os.environ.get("VRAMKIT_SANITIZE", "").strip()

compile_args = ["-std=c11", "-D_DEFAULT_SOURCE", "-Wall", "-Wextra", "-fvisibility=hidden"]
# NVML is dlopen'd (backends/nvml.c; glibc before 2.34 keeps dlopen in libdl); the torch
# allocator hook (torch/malloc_shim.cpp) is C++ and needs its runtime.
link_args = ["-ldl", "-lstdc++"]
if env_flag("VRAMKIT_WERROR"):
    compile_args.append("-Werror")
if SANITIZE:
    compile_args += [f"-fsanitize={SANITIZE}", "-fno-omit-frame-pointer", "-g", "-O1"]
    link_args += [f"-fsanitize={SANITIZE}"]
elif env_flag("VRAMKIT_DEBUG"):
    compile_args += ["-O0", "-g"]
else:
    compile_args += ["-O2"]
    # Link-time optimisation lets the free index, pointer map and rounding inline into malloc/free.
    if lto_links():
        compile_args += ["-flto=auto"]
        link_args += ["-flto=auto"]

define_macros = [("VRAMKIT_BUILD", "1")]
extra_objects = []
if CUDA_HOME:
    define_macros.append(("VRAMKIT_WITH_CUDA", "1"))
    # The static runtime lets the module import where no CUDA runtime library is installed;
    # without a driver CUDA calls fail and vramkit reports no CUDA devices.
    link_args += [os.path.join(CUDA_HOME, "lib64", "libcudart_static.a"), "-lrt", "-ldl", "-lpthread", "-lstdc++"]

ext = Extension(
    "vramkit._C",
    sources=sources("util/*.c", "alloc/*.c", "backends/*.c", "kernels/*.c", "checkpoint/*.c", "view/*.c", "torch/*.c", "python/*.c"),
    include_dirs=["csrc/include", numpy.get_include()] + ([os.path.join(CUDA_HOME, "include")] if CUDA_HOME else []),
    define_macros=define_macros,
    extra_compile_args=compile_args,
    extra_link_args=link_args,
    extra_objects=extra_objects,
    depends=sources("include/*.h", "util/*.h", "alloc/*.h", "backends/*.h", "python/*.h", "kernels/*.h", "checkpoint/*.h",
                    "torch/*"),
)


class BuildExt(build_ext):
    """Compile csrc/kernels/*.cu with nvcc and csrc/torch/*.cpp with the C++ compiler to objects,
    and link them into the extension."""

    def build_cpp(self):
        cxx = os.environ.get("CXX", "g++")
        out_dir = os.path.join(self.build_temp, "cpp")
        os.makedirs(out_dir, exist_ok=True)
        flags = ["-std=c++17", "-fPIC", "-fvisibility=hidden", "-Wall", "-Wextra", "-DVRAMKIT_BUILD=1", "-Icsrc/include"]
        if env_flag("VRAMKIT_WERROR"):
            flags.append("-Werror")
        flags += [f"-fsanitize={SANITIZE}", "-g", "-O1"] if SANITIZE else ["-O2"]
        for src in sources("torch/*.cpp"):
            obj = os.path.join(out_dir, os.path.basename(src) + ".o")
            deps = sources("torch/*", "include/*.h")
            if not os.path.exists(obj) or os.path.getmtime(obj) < max(os.path.getmtime(p) for p in deps):
                cmd = [cxx, "-c", src, "-o", obj] + flags
                self.announce(" ".join(cmd), level=2)
                subprocess.check_call(cmd, cwd=ROOT)
            for e in self.extensions:
                e.extra_objects.append(obj)

    def build_extensions(self):
        self.build_cpp()
        if CUDA_HOME:
            nvcc = os.path.join(CUDA_HOME, "bin", "nvcc")
            archs = [a.strip() for a in os.environ.get("VRAMKIT_CUDA_ARCHS", "80;90").replace(",", ";").split(";") if a.strip()]
            gencode = []
            for arch in archs:
                gencode += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
            gencode += ["-gencode", f"arch=compute_{archs[-1]},code=compute_{archs[-1]}"]  # PTX for newer GPUs
            out_dir = os.path.join(self.build_temp, "cuda")
            os.makedirs(out_dir, exist_ok=True)
            for src in sources("kernels/*.cu"):
                obj = os.path.join(out_dir, os.path.basename(src) + ".o")
                if not os.path.exists(obj) or os.path.getmtime(obj) < max(os.path.getmtime(p) for p in sources("kernels/*")):
                    cmd = [nvcc, "-c", src, "-o", obj, "-O2", "-std=c++17", "-Xcompiler", "-fPIC,-fvisibility=hidden",
                           "-Icsrc/include", "-Xfatbin=-compress-all"] + gencode
                    if env_flag("VRAMKIT_WERROR"):
                        cmd += ["-Werror", "all-warnings"]
                    self.announce(" ".join(cmd), level=2)
                    subprocess.check_call(cmd, cwd=ROOT)
                for e in self.extensions:
                    e.extra_objects.append(obj)
        super().build_extensions()


setup(ext_modules=[ext], cmdclass={"build_ext": BuildExt})
