"""Run a worker script as the ranks of a torchrun job, or as one plain process, and collect
what each printed on its "RESULT " line (JSON). The ranks get the environment torchrun gives
its workers (TorchElastic's: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, ...), so the
frameworks find the job as they would under torchrun; each process has a deadline, so a hang
fails the test instead of stalling it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import vramkit


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _base_env() -> dict[str, str]:
    root = os.path.dirname(os.path.dirname(vramkit.__file__))  # the vramkit these tests import
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
                OMP_NUM_THREADS="1")


def rank_envs(world: int) -> list[dict[str, str]]:
    """torchrun's environment for each of `world` ranks on this host."""
    base = dict(_base_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world),
                LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0", ROLE_RANK="0", ROLE_WORLD_SIZE=str(world),
                TORCHELASTIC_RUN_ID="vramkit-test")
    return [dict(base, RANK=str(r), LOCAL_RANK=str(r)) for r in range(world)]


def plain_env() -> dict[str, str]:
    """One process, not a rank of anything."""
    return _base_env()


def run_workers(tmp_path, source: str, runs: list[tuple[list[str], dict[str, str]]], deadline: float) -> list[dict]:
    """Write `source` to tmp_path and run it once per (arguments, environment), all at once;
    each must exit 0 within `deadline` seconds. Returns each one's last RESULT, in order."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    script = tmp_path / "worker.py"
    script.write_text(source)
    procs = [subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env, cwd=str(tmp_path)) for args, env in runs]
    results = []
    try:
        for i, p in enumerate(procs):
            out, err = p.communicate(timeout=deadline)  # a hang fails here
            assert p.returncode == 0, f"process {i} failed:\n{err[-4000:]}"
            line = [x for x in out.splitlines() if x.startswith("RESULT ")][-1]
            results.append(json.loads(line[len("RESULT "):]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return results


def launch(tmp_path, source: str, mode: str, limits, deadline: float) -> list[dict]:
    """The worker `source` in `mode` with each limit as its arguments: as the ranks of one job, or
    ("reference") as separate plain processes."""
    envs = [plain_env()] * len(limits) if mode == "reference" else rank_envs(len(limits))
    return run_workers(tmp_path, source, [([mode, str(limit)], env) for limit, env in zip(limits, envs)], deadline)
