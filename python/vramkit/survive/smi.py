"""GPUs and the processes holding their memory, stale ones included (`vramkit smi`).

`devices()` and `processes()` come from NVML, the NVIDIA driver's management library, which the
C core loads at run time (`VRAMKIT_NVML_LIBRARY`, else `libnvidia-ml.so.1`); without it they
raise `NVMLUnavailableError`. Each process NVML reports is joined with /proc: its user, command
line, state and parent. `stale()` picks those that hold GPU memory and will not give it back by
themselves, each with its reason:

- "pid not found in /proc (exited, or in another PID namespace)": NVML still charges memory to a
  pid that is not running here (often a child that inherited the GPU file descriptors keeps it;
  or the pid lives in another container);
- "zombie: exited, not reaped by its parent (pid N)";
- "dead (exiting)";
- "stopped (SIGSTOP or SIGTSTP)": a stopped process keeps its memory until it is continued;
- "orphaned: parent gone, reparented to pid 1" (or "parent pid N gone"): a **heuristic**, a
  candidate rather than a verdict, since daemons and the children of a container's init also
  have parent 1; and a parent that dies under a subreaper (systemd --user, tini -s) leaves
  a ppid other than 1, which this does not see.

A process stopped by a debugger (state t) is not stale, nor is the process asking.

Inside a container's PID namespace NVML still reports the host's pids, which /proc there does
not show (or shows as other processes): then nothing is joined, no process is called stale and
`kill_stale` signals nothing (run the container with --pid=host to see them).
"""

from __future__ import annotations

import os
import pwd
import signal
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .. import _C
from .._core.errors import VramkitError

__all__ = ["GPU", "GPUProcess", "KillOutcome", "NVMLUnavailableError", "devices", "processes", "stale",
           "kill_stale", "format_table", "list_gpu_processes", "nested_pid_namespace"]


class NVMLUnavailableError(VramkitError):
    """No usable NVIDIA driver: the NVML library could not be loaded or initialised."""


@dataclass(frozen=True)
class GPU:
    index: int                       # NVML index (PCI bus order, not necessarily CUDA's order)
    name: str
    uuid: str
    memory_total: int                # bytes
    memory_used: int                 # bytes, including what the driver reserves
    memory_free: int
    utilization_gpu: int | None      # % of time a kernel ran; None where unsupported (MIG, vGPU)
    utilization_memory: int | None   # % of time the memory controller was busy (not capacity)


@dataclass(frozen=True)
class GPUProcess:
    gpu: int                   # NVML index of the GPU
    pid: int                   # as NVML reports it (the host's PID namespace)
    kind: str                  # "compute", "graphics" or "compute+graphics"
    used_memory: int | None    # bytes on this GPU; None when NVML cannot tell
    visible: bool              # /proc here shows the host's pids (False in a nested PID namespace)
    found: bool                # the pid is in /proc
    uid: int | None = None     # real uid
    user: str | None = None
    command: str | None = None  # the command line, or "[comm]" when it is empty (zombies)
    state: str | None = None   # /proc/PID/stat: R running, S sleeping, D disk, Z zombie, T stopped,
                               # t traced, X dead, I idle
    ppid: int | None = None
    start_time: int | None = None  # clock ticks after boot: tells a reused pid apart
    stale_reason: str | None = None

    @property
    def stale(self) -> bool:
        return self.stale_reason is not None


@dataclass(frozen=True)
class KillOutcome:
    process: GPUProcess
    signalled: bool
    detail: str                # "sent SIGTERM", or why it was left alone


NOT_FOUND = "pid not found in /proc (exited, or in another PID namespace)"
STOPPED = "stopped (SIGSTOP or SIGTSTP)"
DEAD = "dead (exiting)"
ORPHAN = "orphaned: parent gone, reparented to pid 1"


def _load() -> None:
    why = _C.nvml_load()
    if why is not None:
        raise NVMLUnavailableError(why)


def devices() -> list[GPU]:
    """Every GPU NVML sees, in NVML order."""
    _load()
    return [GPU(**d) for d in _C.nvml_devices()]


def nested_pid_namespace() -> bool:
    """True inside a PID namespace other than the host's (a container without --pid=host): the
    pids NVML reports then do not name processes in this /proc."""
    if os.environ.get("VRAMKIT_SMI_SAME_PID_NAMESPACE") == "1":  # tests: the fake NVML reports our pids
        return False
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return len(line.split()) > 2  # one pid per namespace level, outermost first
    except OSError:
        pass
    return False  # kernels before 4.1 do not say; assume the host's


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:  # gone (or hidden: hidepid)
        return None


def _stat(pid: int) -> tuple[str, str, int, int] | None:
    """(comm, state, ppid, start_time) from /proc/PID/stat, or None when the pid is not there."""
    raw = _read(f"/proc/{pid}/stat")
    if raw is None:
        return None
    text = raw.decode("utf-8", "replace")
    open_paren, close_paren = text.find("("), text.rfind(")")  # comm may hold spaces and parentheses
    fields = text[close_paren + 2:].split()
    try:
        return text[open_paren + 1:close_paren], fields[0], int(fields[1]), int(fields[19])
    except (IndexError, ValueError):
        return None


def _uid(pid: int) -> int | None:
    raw = _read(f"/proc/{pid}/status")
    for line in (raw or b"").decode("ascii", "replace").splitlines():
        if line.startswith("Uid:"):
            try:
                return int(line.split()[1])  # real uid
            except (IndexError, ValueError):
                return None
    return None


def _user(uid: int | None) -> str | None:
    if uid is None:
        return None
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _stale_reason(pid: int, state: str, ppid: int) -> str | None:
    if pid == os.getpid():
        return None  # the caller is running
    if state == "Z":
        return f"zombie: exited, not reaped by its parent (pid {ppid})"
    if state == "X":
        return DEAD
    if state == "T":
        return STOPPED
    if state == "t":
        return None  # a debugger holds it on purpose
    if ppid == 1 and pid != 1:
        return ORPHAN
    if ppid > 1 and not os.path.exists(f"/proc/{ppid}"):
        return f"orphaned: parent pid {ppid} gone"
    return None


def _describe(gpu: int, pid: int, kind: str, used: int | None, visible: bool) -> GPUProcess:
    if not visible:
        return GPUProcess(gpu, pid, kind, used, visible=False, found=False)
    stat = _stat(pid)
    if stat is None:
        return GPUProcess(gpu, pid, kind, used, visible=True, found=False, stale_reason=NOT_FOUND)
    comm, state, ppid, start_time = stat
    uid = _uid(pid)
    raw = _read(f"/proc/{pid}/cmdline") or b""
    command = b" ".join(part for part in raw.split(b"\0") if part).decode("utf-8", "replace") or f"[{comm}]"
    return GPUProcess(gpu, pid, kind, used, visible=True, found=True, uid=uid, user=_user(uid), command=command,
                      state=state, ppid=ppid, start_time=start_time, stale_reason=_stale_reason(pid, state, ppid))


def processes(gpu: int | None = None) -> list[GPUProcess]:
    """The processes with a context on each GPU (or on GPU `gpu`), joined with /proc.

    A process with both a compute and a graphics context on a GPU is one entry of kind
    "compute+graphics", with the larger of the two figures NVML gives (they describe the same
    process's memory). Ordered by GPU, then pid.
    """
    _load()
    indexes = range(_C.nvml_device_count()) if gpu is None else [gpu]
    visible = not nested_pid_namespace()
    found: dict[tuple[int, int], tuple[list[str], list[int | None]]] = {}
    for index in indexes:
        for entry in _C.nvml_processes(index):
            kinds, used = found.setdefault((index, entry["pid"]), ([], []))
            if entry["kind"] not in kinds:
                kinds.append(entry["kind"])
            used.append(entry["used_memory"])
    result = []
    for (index, pid), (kinds, used) in sorted(found.items()):
        known = [u for u in used if u is not None]
        kind = "+".join(k for k in ("compute", "graphics") if k in kinds)
        result.append(_describe(index, pid, kind, max(known) if known else None, visible))
    return result


def _nvml_index(device: object) -> int:
    """The NVML index of a CUDA device (None: the current one), through CUDA_VISIBLE_DEVICES as
    CUDA numbers GPUs: integers pick NVML's order, UUIDs (or their prefixes) are looked up."""
    if device is None:
        from .._core.devices import current_device

        current = current_device()
        index = int(current.partition(":")[2] or 0) if current.startswith("cuda") else 0
    elif isinstance(device, int) and not isinstance(device, bool):
        index = device
    elif isinstance(device, str) or hasattr(device, "index"):
        text = str(device)
        kind, _, number = text.partition(":")
        if kind != "cuda" or (number and not number.isdigit()):
            raise ValueError(f"list_gpu_processes: device must be a CUDA device ('cuda', 'cuda:N', an int or a "
                             f"torch.device of type cuda), got {device!r}")
        index = int(number or 0)
    else:
        raise TypeError(f"list_gpu_processes: device must be None, an int, 'cuda:N' or a torch.device; "
                        f"got {type(device).__name__}")
    if index < 0:
        raise ValueError(f"list_gpu_processes: a device index is >= 0, got {index}")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return index
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if index >= len(entries):
        raise ValueError(f"list_gpu_processes: cuda:{index} is not visible (CUDA_VISIBLE_DEVICES={visible!r})")
    entry = entries[index]
    if entry.isdigit():
        return int(entry)
    for gpu in devices():
        if gpu.uuid.startswith(entry) or gpu.uuid.startswith("GPU-" + entry.removeprefix("GPU-")):
            return gpu.index
    raise ValueError(f"list_gpu_processes: no GPU has the UUID {entry!r} from CUDA_VISIBLE_DEVICES")


def list_gpu_processes(device: object = None) -> str:
    """torch.cuda.list_gpu_processes through vramkit's NVML binding (no pynvml needed): a
    human-readable list of the compute processes on a GPU and the memory each uses, in torch's
    format ("GPU:0", then "process <pid> uses <MB> MB GPU memory" lines). Like torch's, it
    returns a sentence instead of raising when NVML cannot be loaded."""
    why = _C.nvml_load()
    if why is not None:
        return f"NVML could not be loaded ({why}); is the NVIDIA driver installed?"
    index = _nvml_index(device)
    lines = [f"GPU:{index}"]
    procs = [p for p in processes(index) if "compute" in p.kind]
    if not procs:
        lines.append("no processes are running")
    for p in procs:
        used = "n/a" if p.used_memory is None else f"{p.used_memory / (1024 * 1024):.3f}"
        lines.append(f"process {p.pid:>10d} uses {used:>12} MB GPU memory")
    return "\n".join(lines)


def stale(procs: Iterable[GPUProcess] | None = None) -> list[GPUProcess]:
    """The stale processes among `procs` (default: processes())."""
    return [p for p in (processes() if procs is None else procs) if p.stale]


def kill_stale(confirm: Callable[[GPUProcess], bool], sig: int = signal.SIGTERM, other_users: bool = False,
               procs: Iterable[GPUProcess] | None = None, orphans: bool = False) -> list[KillOutcome]:
    """Send `sig` to each stale process that `confirm(process)` approves; one outcome per pid.

    Left alone without asking: pids not running here (nothing to signal), zombies (they have
    exited already: their parent must reap them), the calling process, unless `other_users`
    processes whose real uid is not this user's, and unless `orphans` the orphaned ones:
    "orphaned" is a guess (a daemon or a `nohup` job has parent 1 too), so they are signalled
    only when asked for by name. Just before signalling, the
    pid's start time is compared with the one listed, so a pid reused meanwhile is not hit.
    A stopped process is sent SIGCONT after the signal, so that it can act on it.
    """
    name = signal.Signals(sig).name
    outcomes: list[KillOutcome] = []
    seen: set[int] = set()
    for p in stale(procs):
        if p.pid in seen:
            continue
        seen.add(p.pid)

        def leave(detail: str, p: GPUProcess = p) -> None:
            outcomes.append(KillOutcome(p, False, detail))

        if not p.visible or not p.found:
            leave("not running in this PID namespace: nothing to signal")
        elif p.pid == os.getpid():
            leave("this process")
        elif p.state == "Z":
            leave(f"a zombie has exited already; its parent (pid {p.ppid}) must reap it")
        elif p.uid != os.getuid() and not other_users:
            leave(f"owned by {p.user}, not by this user (--other-users, other_users=True, to include it)")
        elif (p.stale_reason or "").startswith("orphaned") and not orphans:
            leave("orphaned is a guess (daemons and nohup jobs have parent 1 too); left alone "
                  "(--include-orphans, orphans=True, to include it)")
        elif not confirm(p):
            leave("declined")
        elif (now := _stat(p.pid)) is None or now[3] != p.start_time:
            leave("exited meanwhile" if now is None else "the pid now belongs to another process")
        else:
            try:
                os.kill(p.pid, sig)
                detail = f"sent {name}"
                if p.state == "T" and sig not in (signal.SIGKILL, signal.SIGCONT):
                    os.kill(p.pid, signal.SIGCONT)
                    detail += " and SIGCONT (it was stopped)"
                outcomes.append(KillOutcome(p, True, detail))
            except ProcessLookupError:
                leave("exited meanwhile")
            except PermissionError:
                leave(f"permission denied (sending {name} to a process of {p.user})")
    return outcomes


def _bytes(n: int | None) -> str:
    from ..report.sites import format_bytes

    return "N/A" if n is None else format_bytes(n)


def _percent(n: int | None) -> str:
    return "N/A" if n is None else f"{n}%"


_TAGS = {NOT_FOUND: "exited", DEAD: "dead", STOPPED: "stopped"}


def _tag(p: GPUProcess) -> str:
    if p.stale_reason is None:
        return "-" if p.visible else "?"
    if p.stale_reason.startswith("zombie"):
        return "zombie"
    if p.stale_reason.startswith("orphaned"):
        return "orphan?"
    return _TAGS.get(p.stale_reason, "yes")


def format_table(gpus: list[GPU], procs: list[GPUProcess], width: int | None = None) -> str:
    """An nvidia-smi-like table: one row per GPU, then one per process with its STALE column,
    then the reasons for the stale ones. `width` cuts command lines to fit a terminal."""
    lines = [f"{'GPU':>3}  {'NAME':<28}  {'MEMORY USED / TOTAL':>28}  {'GPU UTIL':>8}  {'MEM UTIL':>8}"]
    for g in gpus:
        share = f"({100 * g.memory_used / g.memory_total:.0f}%)" if g.memory_total else ""
        used = f"{_bytes(g.memory_used)} / {_bytes(g.memory_total)} {share:>6}"
        lines.append(f"{g.index:>3}  {g.name:<28}  {used:>28}  {_percent(g.utilization_gpu):>8}  "
                     f"{_percent(g.utilization_memory):>8}")
    if not gpus:
        lines.append("  No GPUs found.")
    lines.append("")
    head = f"{'GPU':>3}  {'PID':>8}  {'USER':<10}  {'TYPE':<4}  {'GPU MEMORY':>10}  {'STATE':<5}  {'STALE':<7}  "
    lines.append(head + "COMMAND")
    kinds = {"compute": "C", "graphics": "G", "compute+graphics": "C+G"}
    for p in procs:
        command = p.command if p.command is not None else "?"
        if width is not None and len(head) + len(command) > width:
            room = max(width - len(head), 12)
            command = command[:room - 3] + "..." if len(command) > room else command
        lines.append(f"{p.gpu:>3}  {p.pid:>8}  {(p.user or '?')[:10]:<10}  {kinds.get(p.kind, p.kind):<4}  "
                     f"{_bytes(p.used_memory):>10}  {p.state or '?':<5}  {_tag(p):<7}  {command}")
    if not procs:
        lines.append("  No processes hold GPU memory.")
    if procs and not all(p.visible for p in procs):
        lines += ["", "Note: this is a nested PID namespace (a container): NVML reports the host's pids, which "
                      "/proc here does not show; users, commands and staleness are unknown (run the container "
                      "with --pid=host to see them)."]
    stale_procs = [p for p in procs if p.stale]
    if stale_procs:
        n = len({p.pid for p in stale_procs})
        lines += ["", f"Stale: {n} process{'es' if n != 1 else ''} hold{'s' if n == 1 else ''} GPU memory "
                      f"and will not release it by {'themselves' if n != 1 else 'itself'}:"]
        for p in stale_procs:
            lines.append(f"  pid {p.pid} on GPU {p.gpu} ({_bytes(p.used_memory)}): {p.stale_reason}")
        if any(p.stale_reason == ORPHAN or (p.stale_reason or "").startswith("orphaned") for p in stale_procs):
            lines.append("  (orphaned is a guess: daemons and a container's processes also have parent 1)")
    return "\n".join(lines)
