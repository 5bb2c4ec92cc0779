"""host_pressure — NumPy workloads near the host's memory limit, run in child processes.

Used by `numpy_temporaries.py` (its pressure rows) and by tests/integration/test_host_pressure.py,
so the benchmark and the tests measure the same thing. Nothing here is timed as a test.

Workloads (each a child Python that prints one JSON line):
  grow    the issue's case, repeated: make an X array and a temporary of it, free both, then a
          2X array and a temporary of it. NumPy's allocator needs 4X at the peak; a cache that
          keeps the freed X segments resident needs 6X.
  random  a seeded sequence of growing, shrinking and varying arrays (X/64 to X, at most 3X
          live), each written in full, some freed at random.

Per child it reports wall time, VmHWM (peak resident set, as `top` would show it), and the
peak of Rss - LazyFree sampled after every step of the workload: pages freed with MADV_FREE
stay in Rss until the kernel needs them, but it takes them back before it OOM-kills anyone,
so Rss - LazyFree is what the process really holds against the rest of the machine.

MemoryCgroup runs a child under a memory limit of its own (cgroup v1 memory controller or
cgroup v2, which needs root or a delegated cgroup): past the limit the kernel's OOM killer
ends the child, as in a container or a CI runner.

    python benchmarks/host_pressure.py --child grow --scale 268435456 --handler 1
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MiB = 1 << 20


# --- memory cgroups --------------------------------------------------------------------------

def _own_cgroup_dir(version: int) -> str | None:
    """This process's cgroup directory in the v1 memory hierarchy or in the v2 one."""
    mount = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rfields = left.split(), right.split()
            if len(rfields) < 3:
                continue
            if version == 2 and rfields[0] == "cgroup2" or \
                    version == 1 and rfields[0] == "cgroup" and "memory" in rfields[2].split(","):
                mount = (fields[3], fields[4])
                break
    if mount is None:
        return None
    root, point = mount
    with open("/proc/self/cgroup") as f:
        for line in f:
            ident, controllers, path = line.rstrip("\n").split(":", 2)
            if version == 2 and ident == "0" and controllers == "" or \
                    version == 1 and "memory" in controllers.split(","):
                rel = path[len(root):] if root != "/" and path.startswith(root) else path
                candidate = point + (rel if rel != "/" else "")
                return candidate if os.path.isdir(candidate) else point
    return None


class MemoryCgroup:
    """A new memory cgroup below ours with a hard limit (and no swap), for one child process.

        with MemoryCgroup(1 << 30) as cg:
            subprocess.run(cmd, preexec_fn=cg.enter)
            cg.oom_kills(), cg.peak()
    """

    def __init__(self, limit: int):
        self.limit = limit
        self.dir: str | None = None
        self.version = 0

    @staticmethod
    def unavailable_reason() -> str | None:
        """None if a limited child cgroup can be made here, else why not."""
        try:
            with MemoryCgroup(64 * MiB):
                return None
        except OSError as e:
            return f"cannot create a memory cgroup here ({e}); needs root or a delegated cgroup"

    def __enter__(self) -> MemoryCgroup:
        errors = []
        for version in (1, 2):
            parent = _own_cgroup_dir(version)
            if parent is None:
                continue
            path = os.path.join(parent, f"vramkit-test-{uuid.uuid4().hex[:10]}")
            try:
                if version == 2:
                    with open(os.path.join(parent, "cgroup.subtree_control")) as f:
                        if "memory" not in f.read().split():
                            raise OSError("the memory controller is not enabled for child cgroups")
                os.mkdir(path)
            except OSError as e:
                errors.append(f"v{version}: {e}")
                continue
            self.dir, self.version = path, version
            try:
                if version == 1:
                    self._write("memory.limit_in_bytes", self.limit)
                    if os.path.exists(os.path.join(path, "memory.memsw.limit_in_bytes")):
                        self._write("memory.memsw.limit_in_bytes", self.limit)
                else:
                    self._write("memory.max", self.limit)
                    if os.path.exists(os.path.join(path, "memory.swap.max")):
                        self._write("memory.swap.max", 0)
            except OSError:
                self.__exit__(None, None, None)
                raise
            return self
        raise OSError("; ".join(errors) or "no cgroup memory controller is mounted")

    def _write(self, name: str, value: object) -> None:
        with open(os.path.join(self.dir, name), "w") as f:
            f.write(str(value))

    def _read(self, name: str) -> str:
        with open(os.path.join(self.dir, name)) as f:
            return f.read()

    def enter(self) -> None:
        """preexec_fn: move the child into the cgroup before it runs anything."""
        self._write("cgroup.procs", os.getpid())

    def peak(self) -> int | None:
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        try:
            return int(self._read(name))
        except (OSError, ValueError):
            return None

    def oom_kills(self) -> int:
        text = self._read("memory.oom_control" if self.version == 1 else "memory.events")
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def __exit__(self, *exc) -> None:
        if self.dir:
            for _ in range(50):  # the last child may take a moment to leave
                try:
                    os.rmdir(self.dir)
                    break
                except OSError:
                    time.sleep(0.02)
            self.dir = None


# --- the child ---------------------------------------------------------------------------------

def rss_and_lazyfree() -> tuple[int, int]:
    """(Rss, LazyFree) of this process in bytes, from /proc/self/smaps_rollup."""
    fields = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("Rss", "LazyFree"):
                fields[key] = int(rest.split()[0]) * 1024
    return fields.get("Rss", 0), fields.get("LazyFree", 0)


def _held_now() -> tuple[int, int]:
    """(Rss, Rss - LazyFree) in bytes."""
    rss, lazy = rss_and_lazyfree()
    return rss, rss - lazy


def _vm_hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _grow(np, scale: int, rounds: int, sample) -> float:
    x = scale // 8
    total = 0.0
    for r in range(rounds):
        a = np.full(x, r + 1.0)
        total += float((a * 2.0).sum())  # a temporary of X
        sample()
        del a
        b = np.full(2 * x, r + 2.0)
        sample()
        total += float((b + 1.0).sum())  # a temporary of 2X
        sample()
        del b
    return total


def _random(np, scale: int, steps: int, seed: int, sample) -> float:
    rng = np.random.default_rng(seed)
    live: list = []
    live_bytes, total = 0, 0.0
    for step in range(steps):
        n = int(scale * 2.0 ** rng.uniform(-6, 0)) // 8
        while live and (live_bytes + 8 * n > 3 * scale or rng.random() < 0.3):
            victim = live.pop(int(rng.integers(len(live))))
            live_bytes -= victim.nbytes
            del victim
        arr = np.empty(n)
        arr.fill(step % 7 + 0.5)  # write it all: a workload's arrays are used
        total += float(arr[::4096].sum())
        live.append(arr)
        live_bytes += arr.nbytes
        sample()
    return total


def child_main(workload: str, scale: int, handler: bool, seed: int, rounds: int) -> dict:
    import numpy as np

    if handler:
        import vramkit.numpy

        vramkit.numpy.install()
    peak = {"rss": 0, "held": 0}

    def sample() -> None:
        rss, held = _held_now()
        peak["rss"], peak["held"] = max(peak["rss"], rss), max(peak["held"], held)

    start = time.perf_counter()
    errors = 0
    try:
        if workload == "grow":
            checksum = _grow(np, scale, rounds, sample)
        else:
            checksum = _random(np, scale, rounds, seed, sample)
    except MemoryError:
        errors, checksum = 1, float("nan")
    seconds = time.perf_counter() - start
    out = {"ok": errors == 0, "memory_errors": errors, "seconds": seconds, "vm_hwm": _vm_hwm(),
           "peak_rss_sampled": peak["rss"], "peak_held": peak["held"], "checksum": checksum}
    if handler:
        import vramkit

        vramkit.pool_check("cpu")
        stats = vramkit.memory_stats("cpu")
        out["stats"] = {k: v for k, v in stats.items() if k.startswith(("host_", "num_")) or "reserved_bytes.all" in k}
    return out


def run_child(workload: str, scale: int, handler: bool, *, seed: int = 0, rounds: int = 3, conf: str = "",
              cgroup: MemoryCgroup | None = None, timeout: float = 600) -> dict:
    """Run one workload in a fresh Python; returns its JSON, or {"killed": signal} if it died."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", VRAMKIT_ALLOC_CONF=conf)
    source = os.path.join(REPO, "python")
    if any(name.startswith("_C") and name.endswith(".so") for name in os.listdir(os.path.join(source, "vramkit"))):
        env["PYTHONPATH"] = source + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", workload, "--scale", str(scale), "--handler",
           "1" if handler else "0", "--seed", str(seed), "--rounds", str(rounds)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                          preexec_fn=cgroup.enter if cgroup else None)
    if proc.returncode < 0:
        return {"ok": False, "killed": signal.Signals(-proc.returncode).name, "stderr": proc.stderr[-2000:]}
    if proc.returncode != 0:
        raise RuntimeError(f"workload child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["warnings"] = proc.stderr
    return result


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", choices=("grow", "random"), required=True)
    parser.add_argument("--scale", type=int, required=True, help="X in bytes")
    parser.add_argument("--handler", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(json.dumps(child_main(args.child, args.scale, bool(args.handler), args.seed, args.rounds)))
