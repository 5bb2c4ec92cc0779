"""The Python package's import rule, read from docs/architecture.md ("Layers of the Python
package"): every module belongs to a unit (a subpackage or a top-level module) on a layer; a
unit imports only units on lower layers and its own modules, never its own package's
``__init__`` from inside, and the module graph has no cycle. Every import counts, the ones
inside functions and ``if TYPE_CHECKING:`` blocks too, since each is a dependency a reader
must follow. ``vramkit.trace`` has a second table, for its stages, checked the same way.
Also: no source file of the repository is over 600 lines, and no package has a submodule
named like a name it exports (importing the submodule would replace the name).

The checker is also run on small packages written to tmp_path, so that it is shown to catch a
cycle, an upward import, a sideways import, an import of the package's own ``__init__`` and a
module the table does not place."""

from __future__ import annotations

import ast
import os
import re
import textwrap
from dataclasses import dataclass

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE_DIR = os.path.join(REPO, "python", "vramkit")
ARCHITECTURE = os.path.join(REPO, "docs", "architecture.md")
MAX_LINES = 600


def read_layers(text: str, marker: str = "<!-- layers -->") -> dict[str, int]:
    """{unit: layer} from the ``layer N  unit unit ...`` lines of the block that follows
    `marker` (a parenthesis after a unit is a comment)."""
    start = text.index(marker)
    block = text[start:].split("```", 2)[1]
    layers: dict[str, int] = {}
    for line in block.splitlines():
        m = re.match(r"\s*layer (\d+)\s+(.*)$", line)
        if not m:
            continue
        for unit in re.sub(r"\([^)]*\)", " ", m.group(2)).split():
            assert unit not in layers, f"{unit} is on two layers"
            layers[unit] = int(m.group(1))
    return layers


@dataclass(frozen=True)
class Module:
    name: str      # dotted, e.g. vramkit.trace.replaying.replay_sim
    path: str
    is_package: bool


def walk_package(root_dir: str, root: str) -> dict[str, Module]:
    modules = {}
    for dirpath, dirnames, filenames in os.walk(root_dir):
        dirnames[:] = sorted(d for d in dirnames if os.path.exists(os.path.join(dirpath, d, "__init__.py")))
        rel = os.path.relpath(dirpath, root_dir)
        prefix = root if rel == "." else root + "." + rel.replace(os.sep, ".")
        for f in sorted(filenames):
            if f.endswith(".py"):
                stem = f[:-3]
                name = prefix if stem == "__init__" else f"{prefix}.{stem}"
                modules[name] = Module(name, os.path.join(dirpath, f), stem == "__init__")
    return modules


def imports_of(mod: Module, modules: dict[str, Module], root: str) -> list[tuple[str, int]]:
    """(imported module, line) for every import of a module of the package in ``mod``."""
    package = mod.name if mod.is_package else mod.name.rpartition(".")[0]
    found = []
    extension = f"{root}._C"
    with open(mod.path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), mod.path)
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for a in node.names:
                sub = f"{base}.{a.name}"
                targets.append(sub if sub in modules or sub == extension else base)
        for t in targets:
            if t == root or t.startswith(root + "."):
                found.append((t, node.lineno))
    return found


def unit_of(name: str, layers: dict[str, int]) -> str | None:
    """The longest unit of the table that is ``name`` or a package above it; the root package
    is a unit of its own (its ``__init__``), not a catch-all for modules the table omits."""
    parts = name.split(".")
    for k in range(len(parts), 1, -1):
        candidate = ".".join(parts[:k])
        if candidate in layers:
            return candidate
    return name if name in layers else None


def check(root_dir: str, root: str, layers: dict[str, int]) -> list[str]:
    """Every breach of the rule, one line each (empty: the package keeps it)."""
    modules = walk_package(root_dir, root)
    problems = []
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for mod in modules.values():
        src_unit = unit_of(mod.name, layers)
        if src_unit is None:
            problems.append(f"{mod.name}: on no layer of the table in docs/architecture.md")
            continue
        for target, line in imports_of(mod, modules, root):
            where = f"{os.path.relpath(mod.path, root_dir)}:{line}"
            if target not in modules and target != f"{root}._C":
                continue  # e.g. vramkit.examples, installed from examples/; not part of the rule
            dst_unit = unit_of(target, layers)
            if dst_unit is None:
                problems.append(f"{where}: imports {target}, which is on no layer")
                continue
            if target in graph:
                graph[mod.name].add(target)
            if dst_unit == src_unit:
                own_package = mod.name if mod.is_package else mod.name.rpartition(".")[0]
                above = [p for p in modules if modules[p].is_package and (own_package == p or
                                                                           own_package.startswith(p + "."))]
                if target in above and target != mod.name and not mod.is_package:
                    problems.append(f"{where}: {mod.name} imports its own package's __init__ ({target}); "
                                    "import the module that defines the name")
                continue
            if layers[dst_unit] > layers[src_unit]:
                problems.append(f"{where}: upward import: {src_unit} (layer {layers[src_unit]}) imports {target} "
                                f"({dst_unit}, layer {layers[dst_unit]})")
            elif layers[dst_unit] == layers[src_unit]:
                problems.append(f"{where}: sideways import: {src_unit} imports {target} ({dst_unit}), both on "
                                f"layer {layers[src_unit]}")
    problems += [f"import cycle: {' -> '.join(c)}" for c in cycles(graph)]
    return problems


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (or a self-import)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                found.append(sorted(component) + [sorted(component)[0]])

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_vramkit_keeps_the_layer_rule_of_the_architecture_doc():
    with open(ARCHITECTURE, encoding="utf-8") as f:
        layers = read_layers(f.read())
    assert layers, "docs/architecture.md has no layer table"
    problems = check(PACKAGE_DIR, "vramkit", layers)
    assert not problems, "\n".join(problems)


TRACE_MARKER = "<!-- layers vramkit.trace -->"


def test_the_stages_of_trace_keep_their_own_layer_table():
    """Inside the trace unit, its stages (formats, target, sharding, capturing, replaying,
    fitting) import only stages below them, so that following the GPU argument from the
    command to the replay goes down and never comes back."""
    with open(ARCHITECTURE, encoding="utf-8") as f:
        layers = read_layers(f.read(), TRACE_MARKER)
    assert set(layers) >= {"vramkit.trace", "vramkit.trace.formats", "vramkit.trace.target",
                           "vramkit.trace.replaying", "vramkit.trace.fitting"}, layers
    problems = check(os.path.join(PACKAGE_DIR, "trace"), "vramkit.trace", layers)
    assert not problems, "\n".join(problems)


def test_every_unit_of_the_table_exists():
    with open(ARCHITECTURE, encoding="utf-8") as f:
        text = f.read()
    modules = walk_package(PACKAGE_DIR, "vramkit")
    for layers in (read_layers(text), read_layers(text, TRACE_MARKER)):
        missing = [u for u in layers if u not in modules and u != "vramkit._C"]
        assert not missing, f"units in docs/architecture.md that the package lacks: {missing}"


def exported_names(path: str) -> set[str]:
    """The names a package's ``__init__`` makes public: ``__all__``'s string literals, the
    keys of a literal dict whose names it loads lazily (``_TORCH_NAMES``) and its functions;
    not the submodules it exports as themselves (``from . import sim``)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    names: set[str] = set()
    submodules = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                  and node.level == 1 and node.module is None for a in node.names}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if isinstance(node.value, (ast.List, ast.Tuple, ast.Set)):
                names |= {e.value for e in node.value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
            elif isinstance(node.value, ast.Dict):
                names |= {k.value for k in node.value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
        elif isinstance(node, ast.FunctionDef):
            names.add(node.name)
    return {n for n in names if not n.startswith("_")} - submodules


def shadowing_submodules(root_dir: str, root: str) -> list[str]:
    """Submodules named like a name their package exports, dotted."""
    modules = walk_package(root_dir, root)
    found = []
    for mod in modules.values():
        if mod.is_package:
            children = {m.rpartition(".")[2] for m in modules if m.rpartition(".")[0] == mod.name}
            found += [f"{mod.name}.{name}" for name in sorted(children & exported_names(mod.path))]
    return found


def test_no_submodule_is_named_like_a_name_its_package_exports():
    """``import vramkit.trace.capture`` would set ``vramkit.trace.capture`` to the module and
    replace the function of that name, so no package may have a child module named like a name
    it exports."""
    clashes = shadowing_submodules(PACKAGE_DIR, "vramkit")
    assert not clashes, f"submodules named like a name their package exports: {clashes}"
    trace_names = exported_names(os.path.join(PACKAGE_DIR, "trace", "__init__.py"))
    assert {"capture", "fit", "replay", "load", "predict_ranks"} <= trace_names  # (the parser sees them)


PLUGIN_DIR = os.path.join(REPO, "python", "vramkit_pytest")


def test_the_pytest_plugin_sits_beside_vramkit_on_survives_layer():
    """vramkit_pytest (the pytest plugin) is outside the package: its modules import vramkit's
    units no higher than survive's layer, and its __init__, which pytest loads in every session,
    imports none of vramkit (the implementation modules import it when a marked test runs)."""
    with open(ARCHITECTURE, encoding="utf-8") as f:
        layers = read_layers(f.read())
    package = walk_package(PACKAGE_DIR, "vramkit")
    plugin = walk_package(PLUGIN_DIR, "vramkit_pytest")
    assert set(plugin) == {"vramkit_pytest", "vramkit_pytest.markers", "vramkit_pytest.benchmark_vram"}
    problems = []
    for mod in plugin.values():
        for target, line in imports_of(mod, package, "vramkit"):
            unit = unit_of(target, layers)
            if mod.is_package:
                problems.append(f"{mod.name}:{line} imports {target}: loading the plugin would import vramkit")
            elif unit is None or layers[unit] > layers["vramkit.survive"]:
                problems.append(f"{mod.name}:{line} imports {target} ({unit}), above survive's layer")
    assert not problems, "\n".join(problems)


SOURCE_DIRS = ("python", "csrc", "tests", "benchmarks", "examples")
SOURCE_SUFFIXES = (".py", ".pyi", ".c", ".h", ".cu", ".cuh", ".cpp", ".sh")


def test_every_source_file_is_under_the_line_limit():
    """Small files with one purpose each: no source file of the repository over 600 lines."""
    long, seen = [], 0
    for top in SOURCE_DIRS:
        for dirpath, dirnames, filenames in os.walk(os.path.join(REPO, top)):
            dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in ("build", "__pycache__")
                           and not d.endswith(".egg-info")]
            for name in filenames:
                if name.endswith(SOURCE_SUFFIXES):
                    seen += 1
                    with open(os.path.join(dirpath, name), encoding="utf-8") as f:
                        n = sum(1 for _ in f)
                    if n > MAX_LINES:
                        long.append(f"{os.path.relpath(os.path.join(dirpath, name), REPO)}: {n} lines")
    assert seen > 100, f"only {seen} source files found under {SOURCE_DIRS}"
    assert not long, f"source files over {MAX_LINES} lines: {long}"


def write_package(tmp_path, files: dict[str, str]) -> str:
    root = tmp_path / "pkg"
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return str(root)


TABLE = {"pkg": 3, "pkg.top": 2, "pkg.mid": 1, "pkg.other": 1, "pkg.base": 0}


def test_a_package_that_keeps_the_rule_passes(tmp_path):
    root = write_package(tmp_path, {
        "__init__.py": "from .top import run\nfrom . import mid\n",
        "base.py": "X = 1\n",
        "mid/__init__.py": "from .impl import f\n",
        "mid/impl.py": "from ..base import X\nfrom . import helper\n",
        "mid/helper.py": "",
        "other.py": "from . import base\n",
        "top/__init__.py": "from .cmd import run\n",
        "top/cmd.py": "def run():\n    from ..mid import f\n    import pkg.other\n    return f\n",
    })
    assert check(root, "pkg", TABLE) == []


@pytest.mark.parametrize("files, expected", [
    ({"base.py": "def f():\n    from .mid import g\n", "mid.py": "g = 1\n"}, "upward import: pkg.base (layer 0)"),
    ({"mid.py": "from .other import y\n", "other.py": "y = 1\n"}, "sideways import: pkg.mid imports pkg.other"),
    ({"mid/__init__.py": "from .a import f\n", "mid/a.py": "from . import b\nf = 1\n",
      "mid/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import f\n"},
     "import cycle: pkg.mid.a -> pkg.mid.b -> pkg.mid.a"),
    ({"mid/__init__.py": "from .a import f\n", "mid/a.py": "from pkg.mid import g\nf = 1\n"},
     "pkg.mid.a imports its own package's __init__ (pkg.mid)"),
    ({"stray.py": "x = 1\n"}, "pkg.stray: on no layer"),
])
def test_the_checker_reports_each_kind_of_breach(tmp_path, files, expected):
    root = write_package(tmp_path, {"__init__.py": "", **files})
    problems = check(root, "pkg", TABLE)
    assert any(expected in p for p in problems), problems


def test_the_shadowing_check_finds_a_submodule_named_like_an_export(tmp_path):
    root = write_package(tmp_path, {
        "__init__.py": "from . import kept\n__all__ = ['run', 'kept']\n_LAZY = {'load': 'io'}\n",
        "run.py": "", "load/__init__.py": "", "kept.py": "", "other.py": "",
    })
    assert shadowing_submodules(root, "pkg") == ["pkg.load", "pkg.run"]


def test_every_subpackage_is_installed():
    """pyproject.toml lists the packages setuptools installs: a subpackage left off is missing
    from `pip install .` (the editable install of a checkout would hide it)."""
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    packages = {m.name for m in walk_package(PACKAGE_DIR, "vramkit").values() if m.is_package}
    assert packages - listed == set(), f"subpackages pyproject.toml does not install: {sorted(packages - listed)}"
