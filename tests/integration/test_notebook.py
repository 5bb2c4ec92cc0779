"""The IPython extension (``%load_ext vramkit``: ``%%vram``, ``%vram_free``) in a real Jupyter
kernel, run by nbclient as Jupyter runs a notebook, and its parts in this process.

The kernel is this interpreter (a kernel spec written for the test) and imports the vramkit
the tests import. Expected figures come from the allocator's counters read in the kernel
before and after, from arrays' ``nbytes`` and from the sizes the cells ask for; never from
the extension's own arithmetic.
"""

from __future__ import annotations

import html
import json
import re
import sys

import numpy as np
import pytest
from conftest import SOURCE_PACKAGE

import vramkit

MiB = 1 << 20


def size_text(n: int) -> str:
    """Bytes as the magics print them ('1.50 GiB', '512 B'), written here independently."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def signed_text(n: int) -> str:
    return "0 B" if n == 0 else ("+" if n > 0 else "-") + size_text(abs(n))


# --- running a notebook --------------------------------------------------------------------


class Raises(str):
    """A cell that is expected to fail (nbclient's raises-exception tag)."""


def run_notebook(tmp_path, cells: list[str]) -> list[dict]:
    """Execute `cells` in a fresh kernel; returns each cell's outputs and execution count."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    spec_dir = tmp_path / "kernels" / "vramkit-test"
    spec_dir.mkdir(parents=True)
    env = {"IPYTHONDIR": str(tmp_path / "ipython"), "PYDEVD_DISABLE_FILE_VALIDATION": "1"}
    if SOURCE_PACKAGE in sys.path:  # the tests use the source tree's build: so must the kernel
        env["PYTHONPATH"] = SOURCE_PACKAGE
    spec = {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "vramkit test", "language": "python", "env": env}
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    km = KernelManager(kernel_name="vramkit-test",
                       kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(tmp_path / "kernels")]))
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(str(src), metadata={"tags": ["raises-exception"]} if isinstance(src, Raises)
                                          else {}) for src in cells]
    nbclient.NotebookClient(nb, km=km, timeout=300, resources={"metadata": {"path": str(tmp_path)}}).execute()
    return [{"count": c.execution_count, "outputs": c.outputs} for c in nb.cells]


def stdout(cell: dict) -> str:
    return "".join(o["text"] for o in cell["outputs"] if o["output_type"] == "stream" and o["name"] == "stdout")


def error(cell: dict) -> dict | None:
    return next((o for o in cell["outputs"] if o["output_type"] == "error"), None)


def usage_error(cell: dict) -> str | None:
    """The message of the UsageError a cell raised: IPython prints it alone on stderr, without
    a traceback (no error output)."""
    text = "".join(o["text"] for o in cell["outputs"] if o["output_type"] == "stream" and o["name"] == "stderr")
    return text[len("UsageError: "):] if text.startswith("UsageError: ") else None


def last_json(cell: dict) -> dict:
    return json.loads(stdout(cell).strip().splitlines()[-1])


def html_outputs(cell: dict) -> list[str]:
    return [o["data"]["text/html"] for o in cell["outputs"]
            if o["output_type"] in ("display_data", "execute_result") and "text/html" in o.get("data", {})]


def table_rows(text: str) -> dict[str, list[str]]:
    """The %%vram table: device -> its four figures (columns are two or more spaces apart)."""
    lines = text.strip().splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("device"))
    rows = {}
    for line in lines[head + 1:]:
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) == 5:
            rows[cells[0]] = cells[1:]
    return rows


SETUP = """\
%load_ext vramkit
import json, sys
import numpy as np
import vramkit, vramkit.numpy as vnp
import vramkit.integrations.notebook as vnb
vnp.install()  # NumPy arrays come from vramkit's cpu pool, so its counters see them
print(json.dumps({"vramkit": vramkit.__file__}))
"""


def check_same_vramkit(cell: dict) -> None:
    assert last_json(cell)["vramkit"] == vramkit.__file__, "the kernel imported another vramkit"


# --- %%vram ----------------------------------------------------------------------------------


def test_vram_cell_prints_the_counters_change_and_peak(tmp_path):
    pytest.importorskip("torch")
    counters = """\
print(json.dumps({d: [vramkit.memory_allocated(d), vramkit.max_memory_allocated(d), vramkit.memory_reserved(d),
                      vramkit.max_memory_reserved(d)] for d in ("cpu", sim)}))"""
    cells = run_notebook(tmp_path, [
        # Peaks higher than the cell's come first: the cell must report its own.
        SETUP + "import torch\nsim = vramkit.sim.create(1 << 30)\nkeep = vramkit.empty(8 << 20, device=sim)\n"
        "vramkit.empty(256 << 20, device=sim)\nnp.empty(32 << 20, np.uint8)\nNone",
        counters,
        # a (3 MiB) stays, tmp (5 MiB) only raises the peak; on sim 48 MiB stay, 16 MiB come and go;
        # torch: t (4 MiB of float32) stays, u (8 MiB) comes and goes.
        """%%vram
a = np.ones(3 << 20, np.uint8)
tmp = np.ones(5 << 20, np.uint8)
del tmp
buf = vramkit.empty(48 << 20, device=sim)
scratch = vramkit.empty(16 << 20, device=sim)
del scratch
t = torch.ones(1 << 20)
u = torch.ones(2 << 20)
del u
a.nbytes + buf.nbytes""",
        counters,
        "vnb.last_cell_report()",
        "%%vram --timeline --device {sim}\nmore = vramkit.empty(4 << 20, device=sim)",
    ])
    check_same_vramkit(cells[0])
    before, after = last_json(cells[1]), last_json(cells[3])
    printed = table_rows(stdout(cells[2]))
    sim = next(d for d in printed if d.startswith("sim:"))
    for device in ("cpu", sim):
        b, a = before[device], after[device]
        # The cell reset the peaks at its start: max_memory_* read after it are the cell's peaks.
        assert printed[device] == [signed_text(a[0] - b[0]), size_text(a[1]), signed_text(a[2] - b[2]), size_text(a[3])]
    assert after[sim][0] - before[sim][0] == 48 * MiB
    assert after[sim][1] == before[sim][0] + 64 * MiB
    # NumPy keeps a few of its own small arrays (a 512 B block each) beside the cell's.
    assert 3 * MiB <= after["cpu"][0] - before["cpu"][0] < 3 * MiB + 64 * 1024
    assert 8 * MiB <= after["cpu"][1] - before["cpu"][0] < 8 * MiB + 64 * 1024
    assert printed["torch cpu*"] == [signed_text(4 * MiB), size_text(12 * MiB), "-", "-"]
    assert "* tensors created in this cell" in stdout(cells[2])
    # The cell's value is its output, as without the magic.
    assert cells[2]["outputs"][-1]["data"]["text/plain"] == str(51 * MiB)

    # The report object shows the same table inline.
    page = html_outputs(cells[4])
    assert len(page) == 1 and page[0].startswith("<pre") and html.escape(f"{sim}  ") in page[0]

    # --timeline: the table, then the HTML timeline of the cell's history in a frame.
    assert table_rows(stdout(cells[5]))[sim][0] == signed_text(4 * MiB)
    (frame,) = html_outputs(cells[5])
    doc = html.unescape(re.search(r'srcdoc="([^"]*)"', frame).group(1))
    assert frame.startswith("<iframe") and "<svg" in doc and f"%%vram timeline, {sim}" in doc
    # The timeline's own format: the peak (8 + 48 MiB before the cell, 4 MiB in it) and the allocation made.
    assert "60.0 MiB" in doc and "4.0 MiB" in doc


# --- %vram_free ------------------------------------------------------------------------------


def free_rows(text: str) -> list[tuple[int, str, str]]:
    """%vram_free's listing: (bytes, devices, holder) per row; sizes parsed back from the text."""
    units = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    rows = []
    for line in text.splitlines():
        m = re.match(r"\s*(?:at least )?([\d.]+) (B|KiB|MiB|GiB)  (\S+)\s+(.*)$", line)
        if m:
            rows.append((round(float(m.group(1)) * units[m.group(2)]), m.group(3), m.group(4)))
    return rows


def test_vram_free_names_the_holders_and_clear_gives_the_memory_back(tmp_path):
    cells = run_notebook(tmp_path, [
        SETUP + "vramkit.empty_cache('cpu')\nvramkit.set_memory_limit(160 << 20, 'cpu')",
        """\
def step(n):  # np.empty: a failure is then one of these requests, not a NumPy temporary's
    activations = np.empty(40 << 20, np.uint8)
    grads = np.empty(40 << 20, np.uint8)
    out = np.empty(n, np.uint8)
    return out.size""",
        Raises("step(1 << 30)  # more than the limit"),
        "np.full(6 << 20, 1, np.uint8)",
        "big = np.zeros(10 << 20, np.uint8)\nbig[:1000]",
        "x = np.ones(5 << 20, np.uint8)",
        # The first failure's traceback still holds its 80 MiB: the retry runs out too, at `grads`
        # (the limit counts segments: 80 MiB held, 20 MiB for the 6 and 5 MiB arrays, 10 MiB for big).
        Raises("step(1 << 20)  # OOM once, OOM forever"),
        "print(json.dumps({'allocated': vramkit.memory_allocated('cpu'), 'out': sorted(Out)}))",
        "%vram_free",
        "print(json.dumps({'allocated': vramkit.memory_allocated('cpu')}))",
        "%vram_free --clear",
        "print(json.dumps({'allocated': vramkit.memory_allocated('cpu'), 'reserved': vramkit.memory_reserved('cpu'),"
        " 'out': sorted(Out), 'under': repr(_), 'last': hasattr(sys, 'last_traceback'),"
        " 'x': int(x.sum()), 'big': int(big.size)}))",
        "step(1 << 20)",
    ])
    check_same_vramkit(cells[0])
    for failed in (cells[2], cells[6]):
        assert error(failed) is not None and "MemoryError" in error(failed)["ename"]
    six, view = cells[3]["count"], cells[4]["count"]
    listing = stdout(cells[8])
    rows = free_rows(listing)
    before_clear, clearing, after, retry = last_json(cells[9]), stdout(cells[10]), last_json(cells[11]), cells[12]
    # The retry failed at `grads`, so its traceback holds `activations` only.
    assert rows[0][0] == 40 * MiB and rows[0][2].startswith("the last error (") and "[cleared by --clear]" in rows[0][2]
    assert f"in step(): activations {size_text(40 * MiB)}" in listing
    by_name = {name.split(" [")[0]: (n, where) for n, where, name in rows}
    assert by_name[f"Out[{six}] (also _{six}, __)"] == (6 * MiB, "cpu")
    # A view keeps its whole base alive: the holder is charged the base's 10 MiB.
    assert by_name[f"Out[{view}] (also _{view}, _)"] == (10 * MiB, "cpu")
    assert by_name["variable big"] == (10 * MiB, "cpu") and by_name["variable x"] == (5 * MiB, "cpu")
    assert "variable big [" not in listing  # variables are never marked for clearing
    # Clearing frees the error's 40 MiB and Out[six]'s 6 MiB; the view's base stays with `big`.
    assert f"about {size_text(46 * MiB)} that no variable also holds" in listing

    # Whatever garbage collection found first (the first failure's traceback, once IPython let go
    # of it, waits for the cycle collector) was collected by the listing.
    assert last_json(cells[7])["allocated"] >= before_clear["allocated"]
    assert before_clear["allocated"] - after["allocated"] >= 40 * MiB + 6 * MiB
    assert after["allocated"] <= 10 * MiB + 5 * MiB + 64 * 1024  # big, x, and NumPy's small change
    assert f"cleared: the last error, Out[{six}] (also _{six}, __), Out[{view}] (also _{view}, _)" in clearing
    assert f"cpu: allocated {size_text(before_clear['allocated'])} -> {size_text(after['allocated'])}" in clearing
    assert f"-> {size_text(after['reserved'])}" in clearing
    assert six not in after["out"] and view not in after["out"] and after["under"] == "''"
    assert after["last"] is False
    assert after["x"] == 5 * MiB and after["big"] == 10 * MiB  # variables untouched
    # The same step fits once the traceback no longer holds the failed one's arrays.
    assert error(retry) is None and retry["outputs"][-1]["data"]["text/plain"] == str(1 << 20)


def test_bad_input_is_a_usage_error_and_changes_nothing(tmp_path):
    state = ("print(json.dumps({'allocated': vramkit.memory_allocated('cpu'), 'out': sorted(Out),"
             " 'ran': 'ran' in globals(), 'report': vnb.last_free_report() is None}))")
    bad = ["%vram_free --clear --device nosuch", "%vram_free --clear --device sim:99", "%vram_free --top -1",
           "%vram_free --top many", "%vram_free --clear --bogus", "%%vram --device nosuch\nran = True",
           "%%vram --top 3\nran = True", '%%vram --device "cpu\nran = True']
    cells = run_notebook(tmp_path, [SETUP, "np.full(3 << 20, 2, np.uint8)", state] + [Raises(b) for b in bad] + [state])
    failures = cells[3:-1]
    messages = [usage_error(c) for c in failures]
    for source, cell, message in zip(bad, failures, messages):
        assert message is not None and error(cell) is None, (source, cell["outputs"])
    assert "bad --device 'nosuch'" in messages[0] and "unknown device" in messages[0]
    assert "sim:99 does not exist" in messages[1]
    assert "--top must be 0 or more" in messages[2] and "invalid int value" in messages[3]
    assert "unrecognized arguments: --bogus" in messages[4] and "bad --device 'nosuch'" in messages[5]
    assert "unrecognized arguments: --top 3" in messages[6] and "No closing quotation" in messages[7]
    first, last = last_json(cells[2]), last_json(cells[-1])
    assert first == last and first["allocated"] >= 3 * MiB
    assert first["out"] == [cells[1]["count"]] and first["ran"] is False and first["report"] is True


# --- the parts, in this process --------------------------------------------------------------


def test_reach_counts_each_storage_once():
    from vramkit.integrations.notebook_reach import Reach

    base = np.zeros(3 * MiB, np.uint8)
    other = np.ones(1000, np.float64)
    # Views, repeats and containers: the base's bytes once, plus the other array's.
    assert Reach().add([base[:10], base[5:], {"k": (base, other)}, [other] * 3]).nbytes == base.nbytes + other.nbytes
    assert Reach().add(base[::2]).by_device() == {"cpu": base.nbytes}
    sim = vramkit.sim.create(1 << 30)
    buf = vramkit.empty(5 * MiB, device=sim)

    class Holder:
        def __init__(self):
            self.buffers = [buf, buf]

    assert Reach().add(Holder()).by_device() == {sim: 5 * MiB}
    # An exception's traceback holds the failed frame's locals.
    def fail():
        local = np.ones(2 * MiB, np.uint8)  # noqa: F841
        raise ValueError("no")

    def catch(f):  # the traceback starts in the frame that catches: this one holds nothing
        try:
            f()
        except ValueError as e:
            return e

    assert Reach().add(catch(fail)).nbytes == 2 * MiB
    # Functions and modules are not followed (they reach every global).
    assert Reach().add(fail, np).nbytes == 0
    # A walk stopped early says so.
    partial = Reach(limit=3).add([np.ones(10), np.ones(10), np.ones(10), np.ones(10)])
    assert partial.truncated and partial.nbytes < 4 * 80


def test_reach_follows_tensors_gradients_and_saved_tensors():
    torch = pytest.importorskip("torch")
    from vramkit.integrations.notebook_reach import Reach

    w = torch.ones(1000, requires_grad=True)  # 4000 B
    w.grad = torch.zeros(1000)
    hidden = (w * 2).sin()
    loss = hidden.sum()
    assert Reach().add(w).nbytes == 2 * 4000  # the leaf and its gradient
    # From the loss (4 B): sin's saved input w * 2 (4000 B), mul's saved scalar 2 (a float64,
    # 8 B), w and its gradient through the graph's leaf; not `hidden`, which sum does not save.
    assert Reach().add(loss).nbytes == 4 + 4000 + 8 + 2 * 4000
    aliased = torch.from_numpy(np.zeros(1000, np.float32))  # one storage, seen twice
    assert Reach().add([aliased, aliased.numpy()]).nbytes == 4000


def test_reports_have_an_html_form():
    with vramkit.clear_cache("cpu") as report:
        pass
    text = str(report)
    assert "->" in text and report._repr_html_() == (
        '<pre style="white-space:pre;overflow-x:auto">' + text.replace(">", "&gt;") + "</pre>")
    result = vramkit.survive.BatchSizeResult(4, device="cpu")
    assert result._repr_html_().endswith(str(result) + "</pre>")
    from vramkit.leaks import LeakReport, LeakWatch
    from vramkit.trace import Prediction

    assert all(hasattr(cls, "_repr_html_") for cls in (Prediction, LeakReport, LeakWatch))


def test_timeline_shows_the_report_page_in_a_frame(tmp_path):
    from vramkit.integrations.notebook_display import Timeline
    from vramkit.report.timeline import render_html

    sim = vramkit.sim.create(1 << 30)
    vramkit.record_memory_history(True, device=sim)
    try:
        a = vramkit.empty(3 * MiB, device=sim)
        del a
        keep = vramkit.empty(1 * MiB, device=sim)
        snapshot = vramkit.memory_snapshot(sim)
        timeline = Timeline.of(sim, title="t <1>")
    finally:
        vramkit.record_memory_history(False, device=sim)
    frame = timeline._repr_html_()
    assert frame.startswith("<iframe") and 'sandbox=""' in frame
    srcdoc = re.search(r'srcdoc="([^"]*)"', frame).group(1)
    assert html.unescape(srcdoc) == render_html(snapshot, title="t <1>")
    assert "3.0 MiB" in html.unescape(srcdoc)  # the peak
    assert timeline.save(tmp_path / "t.html") == str(tmp_path / "t.html")
    assert (tmp_path / "t.html").read_text() == render_html(snapshot, title="t <1>")
    with pytest.raises(ValueError, match="height"):
        Timeline(snapshot, height=0)
    del keep


def test_torch_cuda_rows_come_from_torch_cuda_counters(monkeypatch):
    """torch's CUDA counters (no GPU here: torch.cuda's functions replaced by a fake allocator
    with two devices, on the names %%vram calls)."""
    torch = pytest.importorskip("torch")
    from vramkit.integrations.notebook_cell import CellMeter

    state = {i: {"allocated": 100 * MiB * (i + 1), "peak": 900 * MiB, "reserved": 200 * MiB, "peak_reserved": 950 * MiB}
             for i in range(2)}

    def reset(i):
        state[i]["peak"], state[i]["peak_reserved"] = state[i]["allocated"], state[i]["reserved"]

    def use(i, nbytes, keep):  # allocate nbytes, then free all but `keep` of it
        s = state[i]
        s["allocated"] += nbytes
        s["reserved"] = max(s["reserved"], s["allocated"])
        s["peak"], s["peak_reserved"] = max(s["peak"], s["allocated"]), max(s["peak_reserved"], s["reserved"])
        s["allocated"] -= nbytes - keep

    for name, fn in {"is_initialized": lambda: True, "device_count": lambda: 2,
                     "memory_allocated": lambda i: state[i]["allocated"], "max_memory_allocated": lambda i: state[i]["peak"],
                     "memory_reserved": lambda i: state[i]["reserved"],
                     "max_memory_reserved": lambda i: state[i]["peak_reserved"], "reset_peak_memory_stats": reset}.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    with CellMeter(devices=[], meter_torch=False) as meter:
        use(1, 300 * MiB, keep=50 * MiB)
    idle, row = meter.report.devices  # cuda:0 did nothing but holds memory; its old peak is not the cell's
    assert (idle.device, idle.allocated_change, idle.peak_allocated, idle.peak_before) == (
        "torch cuda:0", 0, 100 * MiB, 900 * MiB)
    assert (row.device, row.allocated_change, row.peak_allocated) == ("torch cuda:1", 50 * MiB, 500 * MiB)
    assert (row.reserved_change, row.peak_reserved, row.peak_before) == (300 * MiB, 500 * MiB, 900 * MiB)
    assert "torch cuda:1   +50.00 MiB      500.00 MiB  +300.00 MiB     500.00 MiB" in str(meter.report)
