"""vramkit.smi and `vramkit smi` against a fake NVML (tests/c/fake_nvml.c, built here into a
shared library and loaded through VRAMKIT_NVML_LIBRARY), and stale-process detection against
real processes these tests start: one that exited, a zombie, a stopped one, an orphan and a
live one. Every process started is ended by the `procs` fixture."""

from __future__ import annotations

import dataclasses
import os
import select
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import subprocess_env
from vramkit import _C
from vramkit.survive import smi

HERE = os.path.dirname(os.path.abspath(__file__))
FAKE_SOURCE = os.path.join(os.path.dirname(HERE), "c", "fake_nvml.c")
CC = os.environ.get("CC", "gcc")
GiB = 1 << 30
# The fake's defines for each process-listing API generation, and the symbol vramkit must pick.
VARIANTS = {
    "v3": ([], "nvmlDeviceGetComputeRunningProcesses_v3"),
    "v2": (["-DFAKE_NVML_NO_V3"], "nvmlDeviceGetComputeRunningProcesses_v2"),
    "v1": (["-DFAKE_NVML_ONLY_V1"], "nvmlDeviceGetComputeRunningProcesses"),
}

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="NVML and /proc: Linux only")


@pytest.fixture(scope="module")
def fake_libs(tmp_path_factory):
    """{variant: path of the built fake libnvidia-ml}."""
    if shutil.which(CC) is None:
        pytest.skip(f"no C compiler ({CC}) on PATH to build the fake NVML library")
    out = tmp_path_factory.mktemp("fake_nvml")
    libs = {}
    for name, (defines, _) in VARIANTS.items():
        lib = str(out / f"libfake_nvml_{name}.so")
        cmd = [CC, "-std=c11", "-shared", "-fPIC", "-Wall", "-Wextra", "-Werror", "-O1", *defines, FAKE_SOURCE,
               "-o", lib]
        result = subprocess.run(cmd, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        libs[name] = lib
    return libs


class Fake:
    """The fake NVML's spec file and environment, for this process and for child processes."""

    def __init__(self, lib: str, tmp_path) -> None:
        self.lib = lib
        self.spec = str(tmp_path / "nvml.spec")
        self.log = str(tmp_path / "nvml.log")
        self.write([])

    def write(self, lines: list[str]) -> None:
        with open(self.spec + ".tmp", "w") as f:
            f.write("# written by test_smi.py\n" + "\n".join(lines) + "\n")
        os.replace(self.spec + ".tmp", self.spec)  # atomic: the fake re-reads it on every call

    def env(self) -> dict[str, str]:
        return {"VRAMKIT_NVML_LIBRARY": self.lib, "FAKE_NVML_SPEC": self.spec, "FAKE_NVML_LOG": self.log,
                "VRAMKIT_SMI_SAME_PID_NAMESPACE": "1"}  # the fake reports this namespace's pids

    def calls(self) -> list[str]:
        try:
            with open(self.log) as f:
                return f.read().split()
        except FileNotFoundError:
            return []

    def cli(self, *args: str, input: str | None = None, **env: str) -> subprocess.CompletedProcess:
        full = subprocess_env()
        full.update(self.env())
        full.update(env)
        return subprocess.run([sys.executable, "-m", "vramkit", "smi", *args], capture_output=True, text=True,
                              env=full, input=input if input is not None else "", timeout=60)


@pytest.fixture
def fake(fake_libs, tmp_path, monkeypatch):
    """The v3 fake loaded in this process (NVML is closed before and after, so it is re-read)."""
    _C.nvml_close()  # before the environment changes: a library still loaded would log to the new files
    f = Fake(fake_libs["v3"], tmp_path)
    for key, value in f.env().items():
        monkeypatch.setenv(key, value)
    yield f
    _C.nvml_close()


GPU_LINES = [
    f"gpu {80 * GiB} {12 * GiB} 42 7 GPU-0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0 NVIDIA H100 80GB HBM3",
    f"gpu {24 * GiB} {1 * GiB} NA NA GPU-11111111-2222-3333-4444-555555555555 NVIDIA A10",
]


# ---- processes ----------------------------------------------------------------------------


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of a pid, or None when it is not in /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()
    return fields[0], int(fields[1])


def _wait_for(condition, what: str, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


class Procs:
    """Starts the processes a test needs and ends every one of them afterwards."""

    def __init__(self) -> None:
        self.children: list[subprocess.Popen] = []
        self.strays: list[int] = []  # not our children (orphans): killed by pid

    def popen(self, args: list[str], **kwargs) -> subprocess.Popen:
        p = subprocess.Popen(args, **kwargs)
        self.children.append(p)
        return p

    def live(self) -> subprocess.Popen:
        return self.popen(["sleep", "600"])

    def exited(self) -> int:
        """A pid that ran and was reaped: no longer in /proc."""
        p = self.popen(["true"])
        p.wait()
        assert _stat(p.pid) is None
        return p.pid

    def zombie(self) -> tuple[int, subprocess.Popen]:
        """A child that exited and that its parent (a helper sleeping without wait()) never reaps."""
        code = ("import os, time\npid = os.fork()\nif pid == 0:\n    os._exit(0)\n"
                "print(pid, flush=True)\ntime.sleep(600)\n")
        helper = self.popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        pid = int(helper.stdout.readline())
        _wait_for(lambda: (_stat(pid) or ("?",))[0] == "Z", "the zombie")
        return pid, helper

    def stopped(self, **kwargs) -> subprocess.Popen:
        p = self.popen(["sleep", "600"], **kwargs)
        os.kill(p.pid, signal.SIGSTOP)
        _wait_for(lambda: (_stat(p.pid) or ("?",))[0] == "T", "the stopped process")
        return p

    def orphan(self) -> int:
        """A process whose parent exited: the kernel reparents it to pid 1 (or a subreaper)."""
        code = ("import subprocess\np = subprocess.Popen(['sleep', '600'], start_new_session=True)\n"
                "print(p.pid, flush=True)\n")
        helper = self.popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        pid = int(helper.stdout.readline())
        self.strays.append(pid)
        helper.wait()
        _wait_for(lambda: (_stat(pid) or ("?", helper.pid))[1] != helper.pid, "the orphan's reparenting")
        return pid

    def close(self) -> None:
        for pid in self.strays:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in self.children:
            if p.poll() is None:
                p.kill()
            p.wait()
            for stream in (p.stdout, p.stderr):
                if stream:
                    stream.close()


@pytest.fixture
def procs():
    p = Procs()
    yield p
    p.close()


# ---- NVML figures ---------------------------------------------------------------------------


def test_devices_and_processes_match_the_spec(fake):
    me = os.getpid()
    fake.write(GPU_LINES + [f"proc 0 compute {me} {3 * GiB}", f"proc 0 graphics {me} {1 * GiB}",
                            f"proc 1 compute {me} NA", "proc 1 graphics 1 4096"])
    gpus = smi.devices()
    assert gpus == [
        smi.GPU(0, "NVIDIA H100 80GB HBM3", "GPU-0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0", 80 * GiB, 12 * GiB, 68 * GiB,
                42, 7),
        smi.GPU(1, "NVIDIA A10", "GPU-11111111-2222-3333-4444-555555555555", 24 * GiB, 1 * GiB, 23 * GiB, None, None),
    ]
    # The binding lists compute contexts, then graphics ones, as NVML gives them.
    assert _C.nvml_processes(0) == [
        {"pid": me, "used_memory": 3 * GiB, "kind": "compute", "gpu_instance_id": None, "compute_instance_id": None},
        {"pid": me, "used_memory": 1 * GiB, "kind": "graphics", "gpu_instance_id": None, "compute_instance_id": None},
    ]
    assert [(p["pid"], p["used_memory"], p["kind"]) for p in _C.nvml_processes(1)] == [
        (me, None, "compute"), (1, 4096, "graphics")]
    # vramkit.smi merges one process's contexts on a GPU and joins /proc.
    listed = smi.processes()
    assert [(p.gpu, p.pid, p.kind, p.used_memory) for p in listed] == [
        (0, me, "compute+graphics", 3 * GiB), (1, 1, "graphics", 4096), (1, me, "compute", None)]
    mine = listed[0]
    assert mine.found and mine.visible and mine.state == "R" and mine.ppid == os.getppid()
    with open("/proc/self/cmdline", "rb") as f:
        command = " ".join(part.decode() for part in f.read().split(b"\0") if part)
    assert mine.uid == os.getuid() and mine.user == smi._user(os.getuid()) and mine.command == command
    assert not mine.stale  # the caller is never stale
    assert [(p.gpu, p.pid) for p in smi.processes(gpu=1)] == [(1, 1), (1, me)]
    with pytest.raises(smi.VramkitError, match="no GPU with NVML index 2: NVML sees 2 GPUs"):
        _C.nvml_processes(2)
    # The fake re-reads its spec on every call: the lists follow it without reloading NVML.
    fake.write(GPU_LINES[:1])
    assert len(smi.devices()) == 1 and smi.processes() == []


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_each_process_api_generation_is_read_with_its_layout(fake_libs, tmp_path, monkeypatch, variant):
    """_v3 if exported, else _v2, else the unversioned call: each fills a different struct."""
    _C.nvml_close()
    f = Fake(fake_libs[variant], tmp_path)
    for key, value in f.env().items():
        monkeypatch.setenv(key, value)
    f.write(GPU_LINES + ["proc 0 compute 4000001 123456789", "proc 0 compute 4000002 NA",
                         "proc 0 graphics 4000003 5", f"proc 1 compute 4000004 {70 * GiB}"])
    try:
        assert [(p["pid"], p["used_memory"], p["kind"]) for p in _C.nvml_processes(0)] == [
            (4000001, 123456789, "compute"), (4000002, None, "compute"), (4000003, 5, "graphics")]
        assert [(p["pid"], p["used_memory"]) for p in _C.nvml_processes(1)] == [(4000004, 70 * GiB)]
    finally:
        _C.nvml_close()
    symbol = VARIANTS[variant][1]
    calls = f.calls()
    assert symbol in calls and symbol.replace("Compute", "Graphics") in calls
    assert not any(c.startswith("nvmlDeviceGetComputeRunningProcesses") and c != symbol for c in calls)
    assert calls[0] == "nvmlInit_v2" and calls[-1] == "nvmlShutdown"


def test_nvml_is_loaded_once_and_reloaded_after_close(fake, monkeypatch, tmp_path):
    fake.write(GPU_LINES)
    assert _C.nvml_load() is None
    monkeypatch.setenv("VRAMKIT_NVML_LIBRARY", str(tmp_path / "missing.so"))
    assert len(smi.devices()) == 2  # still the library loaded first
    assert fake.calls().count("nvmlInit_v2") == 1
    _C.nvml_close()
    assert fake.calls()[-1] == "nvmlShutdown"
    why = _C.nvml_load()
    assert why.startswith(str(tmp_path / "missing.so") + " could not be loaded (")
    assert "VRAMKIT_NVML_LIBRARY" in why
    with pytest.raises(smi.NVMLUnavailableError, match="could not be loaded"):
        smi.devices()
    monkeypatch.setenv("VRAMKIT_NVML_LIBRARY", fake.lib)
    assert _C.nvml_load() is not None  # a failure is kept too, until a close
    _C.nvml_close()
    assert _C.nvml_load() is None and len(smi.devices()) == 2


def test_nvml_errors_are_reported(fake):
    fake.write(GPU_LINES + ["fail nvmlInit_v2 9"])
    why = _C.nvml_load()
    assert why == f"nvmlInit_v2 from {fake.lib} failed: Driver Not Loaded (NVML error 9)"
    _C.nvml_close()
    fake.write(GPU_LINES + ["fail nvmlDeviceGetMemoryInfo 999"])
    with pytest.raises(smi.VramkitError, match=r"nvmlDeviceGetMemoryInfo failed on GPU 0: Unknown Error "
                                               r"\(NVML error 999\)") as info:
        smi.devices()
    assert not isinstance(info.value, smi.NVMLUnavailableError)
    fake.write(GPU_LINES + ["fail nvmlDeviceGetGraphicsRunningProcesses_v3 4"])
    with pytest.raises(smi.VramkitError, match="nvmlDeviceGetGraphicsRunningProcesses_v3 failed on GPU 0"):
        smi.processes()


def test_not_an_nvml_library(tmp_path, monkeypatch):
    """A library that loads but lacks NVML's functions is refused with the missing name."""
    monkeypatch.setenv("VRAMKIT_NVML_LIBRARY", _C.__file__)
    _C.nvml_close()
    try:
        assert _C.nvml_load() == f"{_C.__file__} has no nvmlInit_v2: not an NVML library, or from too old a driver"
    finally:
        _C.nvml_close()


# ---- the table ------------------------------------------------------------------------------


def test_format_table():
    gpus = [smi.GPU(0, "NVIDIA H100 80GB HBM3", "GPU-x", 80 * GiB, 20 * GiB, 60 * GiB, 42, 7),
            smi.GPU(1, "NVIDIA A10", "GPU-y", 24 * GiB, 0, 24 * GiB, None, None)]
    procs = [
        smi.GPUProcess(0, 4242, "compute", 3 * GiB, True, True, 1000, "alice", "python train.py --lr 3e-4", "S", 77),
        smi.GPUProcess(0, 99, "compute+graphics", None, True, False, stale_reason=smi.NOT_FOUND),
        smi.GPUProcess(1, 5151, "graphics", 512 << 20, True, True, 0, "root", "[python3]", "Z", 4242,
                       stale_reason="zombie: exited, not reaped by its parent (pid 4242)"),
        smi.GPUProcess(1, 6262, "compute", 1 << 20, True, True, 0, "root", "x" * 200, "S", 1,
                       stale_reason=smi.ORPHAN),
    ]
    lines = smi.format_table(gpus, procs, width=100).splitlines()
    assert lines[0].split() == ["GPU", "NAME", "MEMORY", "USED", "/", "TOTAL", "GPU", "UTIL", "MEM", "UTIL"]
    assert lines[1].split() == ["0", "NVIDIA", "H100", "80GB", "HBM3", "20.0", "GiB", "/", "80.0", "GiB", "(25%)",
                                "42%", "7%"]
    assert lines[2].split() == ["1", "NVIDIA", "A10", "0", "B", "/", "24.0", "GiB", "(0%)", "N/A", "N/A"]
    assert lines[3] == ""
    assert lines[4].split() == ["GPU", "PID", "USER", "TYPE", "GPU", "MEMORY", "STATE", "STALE", "COMMAND"]
    assert lines[5].split() == ["0", "4242", "alice", "C", "3.0", "GiB", "S", "-", "python", "train.py", "--lr",
                                "3e-4"]
    assert lines[6].split() == ["0", "99", "?", "C+G", "N/A", "?", "exited", "?"]
    assert lines[7].split() == ["1", "5151", "root", "G", "512.0", "MiB", "Z", "zombie", "[python3]"]
    assert lines[8].split()[:7] == ["1", "6262", "root", "C", "1.0", "MiB", "S"] and lines[8].split()[7] == "orphan?"
    assert len(lines[8]) == 100 and lines[8].endswith("x...")  # cut to the width
    # The columns line up: each row's STALE tag starts where the header's does.
    column = lines[4].index("STALE")
    assert all(line[column:].split()[0] in ("-", "exited", "zombie", "orphan?") for line in lines[5:9])
    assert lines[9:] == [
        "",
        "Stale: 3 processes hold GPU memory and will not release it by themselves:",
        "  pid 99 on GPU 0 (N/A): pid not found in /proc (exited, or in another PID namespace)",
        "  pid 5151 on GPU 1 (512.0 MiB): zombie: exited, not reaped by its parent (pid 4242)",
        "  pid 6262 on GPU 1 (1.0 MiB): orphaned: parent gone, reparented to pid 1",
        "  (orphaned is a guess: daemons and a container's processes also have parent 1)",
    ]
    assert smi.format_table(gpus, procs).splitlines()[8].endswith("x" * 200)  # no width: nothing cut
    empty = smi.format_table([], [])
    assert "No GPUs found." in empty and "No processes hold GPU memory." in empty and "Stale" not in empty


# ---- stale processes ------------------------------------------------------------------------


def test_stale_detection_against_real_processes(fake, procs):
    live = procs.live()
    exited = procs.exited()
    zombie, zombie_parent = procs.zombie()
    stopped = procs.stopped()
    orphan = procs.orphan()
    orphaned = _stat(orphan)[1] == 1  # else reparented to a subreaper, which is alive: not recognisable
    pids = {"live": live.pid, "exited": exited, "zombie": zombie, "stopped": stopped.pid, "orphan": orphan}
    fake.write(GPU_LINES + [f"proc 0 compute {pid} {i + 1}" for i, pid in enumerate(pids.values())])
    listed = {p.pid: p for p in smi.processes()}
    assert sorted(listed) == sorted(pids.values())
    by_name = {name: listed[pid] for name, pid in pids.items()}
    assert by_name["live"].stale_reason is None and by_name["live"].state in ("S", "R")
    assert by_name["live"].ppid == os.getpid() and by_name["live"].command == "sleep 600"
    assert by_name["exited"].stale_reason == "pid not found in /proc (exited, or in another PID namespace)"
    assert not by_name["exited"].found and by_name["exited"].user is None
    assert by_name["zombie"].stale_reason == f"zombie: exited, not reaped by its parent (pid {zombie_parent.pid})"
    assert by_name["zombie"].state == "Z" and by_name["zombie"].command.startswith("[")  # no cmdline left
    assert by_name["stopped"].stale_reason == "stopped (SIGSTOP or SIGTSTP)" and by_name["stopped"].state == "T"
    if orphaned:
        assert by_name["orphan"].stale_reason == "orphaned: parent gone, reparented to pid 1"
        assert by_name["orphan"].ppid == 1
    else:
        assert by_name["orphan"].stale_reason is None  # the known gap of the heuristic
    assert all(p.uid == os.getuid() for name, p in by_name.items() if name != "exited")
    orphans = {orphan} if orphaned else set()
    assert {p.pid for p in smi.stale()} == {exited, zombie, stopped.pid} | orphans
    # Continued, the stopped process is no longer stale.
    os.kill(stopped.pid, signal.SIGCONT)
    _wait_for(lambda: (_stat(stopped.pid) or ("?",))[0] != "T", "SIGCONT")
    assert {p.pid for p in smi.stale()} == {exited, zombie} | orphans


def test_kill_stale_skips_what_it_must_and_checks_the_pid(fake, procs):
    stopped = procs.stopped()
    zombie, _ = procs.zombie()
    exited = procs.exited()
    live = procs.live()
    fake.write(GPU_LINES + [f"proc 0 compute {pid} 1" for pid in (stopped.pid, zombie, exited, live.pid)])
    asked = []
    outcomes = smi.kill_stale(lambda p: asked.append(p.pid) or False)
    assert asked == [stopped.pid]  # zombies and absent pids are not even offered
    assert {o.process.pid: (o.signalled, o.detail) for o in outcomes} == {
        stopped.pid: (False, "declined"),
        zombie: (False, f"a zombie has exited already; its parent (pid {_stat(zombie)[1]}) must reap it"),
        exited: (False, "not running in this PID namespace: nothing to signal"),
    }
    # A pid reused since it was listed is not hit: the start time must still match.
    listed = [dataclasses.replace(p, start_time=p.start_time + 1) if p.pid == stopped.pid else p
              for p in smi.processes()]
    outcomes = smi.kill_stale(lambda p: True, procs=listed)
    assert [o.detail for o in outcomes if o.process.pid == stopped.pid] == ["the pid now belongs to another process"]
    assert stopped.poll() is None
    outcomes = smi.kill_stale(lambda p: True, sig=signal.SIGKILL)
    assert [(o.process.pid, o.signalled, o.detail) for o in outcomes if o.signalled] == [
        (stopped.pid, True, "sent SIGKILL")]
    assert stopped.wait(timeout=10) == -signal.SIGKILL and live.poll() is None


def test_nested_pid_namespace_joins_nothing_and_kills_nothing(fake, procs, monkeypatch):
    stopped = procs.stopped()
    fake.write(GPU_LINES + [f"proc 0 compute {stopped.pid} 1"])
    monkeypatch.setattr(smi, "nested_pid_namespace", lambda: True)
    [p] = smi.processes()
    assert not p.visible and not p.found and p.user is None and not p.stale
    assert smi.kill_stale(lambda p: True, procs=[dataclasses.replace(p, stale_reason="x")])[0].detail == \
        "not running in this PID namespace: nothing to signal"
    table = smi.format_table(smi.devices(), [p])
    assert "nested PID namespace" in table and "--pid=host" in table


# ---- the command ----------------------------------------------------------------------------


def _other_user_stopped(procs: Procs) -> subprocess.Popen | None:
    """A stopped process of another user (uid 65534), when this test may start one (root)."""
    if os.getuid() != 0:
        return None
    return procs.stopped(user=65534, group=65534)


def test_cli_kill_stale_yes_signals_this_users_stale_processes_only(fake, procs):
    live = procs.live()
    exited = procs.exited()
    zombie, _ = procs.zombie()
    stopped = procs.stopped()
    orphan = procs.orphan()
    orphaned = _stat(orphan)[1] == 1  # else reparented to a subreaper: not recognisable, left alone
    other = _other_user_stopped(procs)
    pids = [live.pid, exited, zombie, stopped.pid, orphan] + ([other.pid] if other else [])
    fake.write(GPU_LINES + [f"proc {i % 2} compute {pid} {(i + 1) << 20}" for i, pid in enumerate(pids)])
    r = fake.cli("--kill-stale", "--yes")
    assert r.returncode == 0, r.stderr
    assert "STALE" in r.stdout and "Stale:" in r.stdout
    lines = r.stdout.splitlines()
    assert f"pid {stopped.pid}: sent SIGTERM and SIGCONT (it was stopped)" in lines
    assert f"pid {exited}: not running in this PID namespace: nothing to signal" in lines
    assert any(line.startswith(f"pid {zombie}: a zombie has exited already") for line in lines)
    assert not any(line.startswith(f"pid {live.pid}:") for line in lines)
    assert stopped.wait(timeout=10) == -signal.SIGTERM
    assert live.poll() is None and _stat(zombie)[0] == "Z"
    if orphaned:  # a guess: left alone unless --include-orphans
        assert any(line.startswith(f"pid {orphan}: orphaned is a guess") for line in lines)
        assert _stat(orphan) is not None and _stat(orphan)[0] != "Z"
        r = fake.cli("--kill-stale", "--yes", "--include-orphans")
        assert f"pid {orphan}: sent SIGTERM" in r.stdout.splitlines(), r.stdout
        _wait_for(lambda: _stat(orphan) is None or _stat(orphan)[0] == "Z", "the orphan's end")
    if other:
        assert f"pid {other.pid}: owned by {smi._user(65534)}, not by this user (--other-users, other_users=True, " \
               f"to include it)" in lines
        assert other.poll() is None and _stat(other.pid)[0] == "T"
        r = fake.cli("--kill-stale", "--yes", "--other-users", "--signal", "KILL")
        assert r.returncode == 0, r.stderr
        assert f"pid {other.pid}: sent SIGKILL" in r.stdout.splitlines()
        assert other.wait(timeout=10) == -signal.SIGKILL


def test_cli_kill_stale_asks_for_each(fake, procs):
    first, second = sorted((procs.stopped(), procs.stopped()), key=lambda p: p.pid)  # asked in pid order
    fake.write(GPU_LINES + [f"proc 0 compute {first.pid} {GiB}", f"proc 0 compute {second.pid} {GiB}"])
    r = fake.cli("--kill-stale", input="n\ny\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("[y/N]") == 2
    assert f"Send SIGTERM to pid {first.pid} (" in r.stdout and "stopped (SIGSTOP or SIGTSTP))? [y/N]" in r.stdout
    assert f"pid {first.pid}: declined" in r.stdout and f"pid {second.pid}: sent SIGTERM" in r.stdout
    assert second.wait(timeout=10) == -signal.SIGTERM and first.poll() is None
    r = fake.cli("--kill-stale")  # no answer (end of input) is no
    assert r.returncode == 0 and f"pid {first.pid}: declined" in r.stdout and first.poll() is None
    fake.write(GPU_LINES)
    r = fake.cli("--kill-stale")
    assert r.returncode == 0 and r.stdout.rstrip().endswith("No stale processes.")


def test_cli_without_the_library_exits_2(fake, tmp_path):
    missing = str(tmp_path / "no" / "libnvidia-ml.so.1")
    r = fake.cli(VRAMKIT_NVML_LIBRARY=missing)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith(f"vramkit smi: no NVIDIA driver: {missing} could not be loaded ({missing}: "), r.stderr
    fake.write(GPU_LINES + ["fail nvmlInit_v2 9"])
    r = fake.cli()
    assert r.returncode == 2
    assert r.stderr == f"vramkit smi: no NVIDIA driver: nvmlInit_v2 from {fake.lib} failed: Driver Not Loaded " \
                       f"(NVML error 9)\n"


def test_cli_other_nvml_errors_exit_1(fake):
    fake.write(GPU_LINES + ["fail nvmlDeviceGetUUID 15"])
    r = fake.cli()
    assert r.returncode == 1
    assert r.stderr == "vramkit smi: error: nvmlDeviceGetUUID failed on GPU 0: Unknown Error (NVML error 15)\n"


def test_cli_table(fake, procs):
    live = procs.live()
    fake.write(GPU_LINES + [f"proc 1 compute {live.pid} {2 * GiB}"])
    r = fake.cli()
    assert r.returncode == 0, r.stderr
    assert r.stdout == smi.format_table(smi.devices(), smi.processes()) + "\n"
    assert f"{live.pid}" in r.stdout and "sleep 600" in r.stdout and "Stale" not in r.stdout


def _read_until(proc: subprocess.Popen, predicate, timeout: float = 30.0) -> str:
    data = b""
    deadline = time.monotonic() + timeout
    while not predicate(data.decode(errors="replace")):
        left = deadline - time.monotonic()
        assert left > 0, f"timed out; output so far:\n{data.decode(errors='replace')}"
        ready, _, _ = select.select([proc.stdout], [], [], left)
        if ready:
            chunk = os.read(proc.stdout.fileno(), 65536)
            assert chunk, f"the command ended early:\n{data.decode(errors='replace')}"
            data += chunk
    return data.decode(errors="replace")


def test_cli_watch_refreshes_until_ctrl_c(fake, procs):
    fake.write(GPU_LINES)
    env = dict(subprocess_env(), **fake.env())
    watch = procs.popen([sys.executable, "-m", "vramkit", "smi", "--watch", "0.2"], stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, env=env)
    clear = "\033[H\033[2J"
    first = _read_until(watch, lambda out: out.count(clear) >= 1 and "No processes hold GPU memory." in out)
    assert first.startswith(clear + "Every 0.2s: vramkit smi") and "NVIDIA H100 80GB HBM3" in first
    fake.write(GPU_LINES + [f"proc 0 compute 4999999 {GiB}"])  # the next frame shows it
    _read_until(watch, lambda out: out.count(clear) >= 1 and "4999999" in out)
    watch.send_signal(signal.SIGINT)
    assert watch.wait(timeout=15) == 0, watch.stderr.read().decode()
    assert b"Traceback" not in watch.stderr.read()


def test_cli_usage_errors(fake):
    r = fake.cli("--watch", "0")
    assert r.returncode == 2 and "expected a number of seconds > 0" in r.stderr
    r = fake.cli("--watch", "1", "--kill-stale")
    assert r.returncode == 2 and "--kill-stale cannot be combined with --watch" in r.stderr


def test_list_gpu_processes_in_torchs_format(fake, monkeypatch):
    """torch.cuda.list_gpu_processes's text: compute processes of one GPU, memory in MB (2**20)."""
    import vramkit

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    fake.write(GPU_LINES + ["proc 0 compute 4000001 123456789", "proc 0 graphics 4000003 5",
                            "proc 0 compute 4000002 NA", f"proc 1 compute 4000004 {70 * GiB}"])
    assert vramkit.list_gpu_processes(0) == (
        "GPU:0\n"
        "process    4000001 uses      117.738 MB GPU memory\n"   # 123456789 / 2**20 = 117.73756...
        "process    4000002 uses          n/a MB GPU memory")
    assert vramkit.list_gpu_processes("cuda:1") == "GPU:1\nprocess    4000004 uses    71680.000 MB GPU memory"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # CUDA's device 0 is NVML's GPU 1
    assert vramkit.list_gpu_processes(0).startswith("GPU:1\nprocess    4000004")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-1111")  # by UUID prefix
    assert vramkit.list_gpu_processes(0).startswith("GPU:1\n")
    with pytest.raises(ValueError, match="cuda:1 is not visible"):
        vramkit.list_gpu_processes(1)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    fake.write(GPU_LINES)
    assert vramkit.list_gpu_processes(1) == "GPU:1\nno processes are running"
    with pytest.raises(ValueError, match="must be a CUDA device"):
        vramkit.list_gpu_processes("cpu")
