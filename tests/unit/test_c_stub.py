"""The hand-written stub ``python/vramkit/_C.pyi`` against the built extension ``vramkit._C``.

mypy trusts the stub for every use of ``_C`` in the package, so the stub must say what the
extension has: every name the extension exposes is declared (private ``_x`` names when the
package uses them), every declared name exists, functions are builtin functions and classes
are classes, and each function's signature matches. The C functions carry no
``__text_signature__`` today, so where a function has none its signature is read from how it
refuses calls that cannot be right: an unknown keyword argument (a function that takes no
keywords must have positional-only parameters in the stub; one that takes them must use the
names its docstring signature gives), and 64 positional arguments (CPython's message gives the
number of parameters). Both are refused before the C function does anything. A function
whose stub line ends in ``# CUDA builds only`` may be missing from a build without CUDA
(CI's sanitizer build). The checkers also run on broken copies of the stub, so that each is
shown to catch what it is for.
"""

from __future__ import annotations

import ast
import inspect
import os
import re
import types
from dataclasses import dataclass, field
from typing import Any

import pytest

import vramkit
from vramkit import _C

PACKAGE_DIR = os.path.dirname(os.path.abspath(vramkit.__file__))
STUB = os.path.join(PACKAGE_DIR, "_C.pyi")
PROBE_KEYWORD = "__vramkit_stub_probe__"
# Attributes every module has; the package may read them from _C without the stub declaring them.
MODULE_ATTRIBUTES = set(dir(types.ModuleType("m"))) | {"__file__", "__path__", "__cached__"}
SIMPLE_TYPES = {"str": str, "bool": bool, "int": int, "float": float, "bytes": bytes}
CUDA_ONLY = "# CUDA builds only"  # the stub's mark on functions a build without CUDA lacks


# ----------------------------------------------------------------------------- reading the stub


@dataclass
class Stub:
    functions: dict[str, ast.FunctionDef] = field(default_factory=dict)
    classes: dict[str, ast.ClassDef] = field(default_factory=dict)
    attributes: dict[str, ast.expr | None] = field(default_factory=dict)  # name -> annotation (None: `x = ...`)
    aliases: set[str] = field(default_factory=set)  # `_X: TypeAlias = ...`, stub-only
    cuda_only: set[str] = field(default_factory=set)  # functions whose line ends in CUDA_ONLY

    def declared(self) -> set[str]:
        return set(self.functions) | set(self.classes) | set(self.attributes)


def _is_type_alias(annotation: ast.expr) -> bool:
    return (isinstance(annotation, ast.Name) and annotation.id == "TypeAlias") or \
        (isinstance(annotation, ast.Attribute) and annotation.attr == "TypeAlias")


def parse_stub(source: str) -> Stub:
    stub = Stub()
    lines = source.splitlines()
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef):
            stub.functions[node.name] = node
            if lines[(node.end_lineno or node.lineno) - 1].rstrip().endswith(CUDA_ONLY):
                stub.cuda_only.add(node.name)
        elif isinstance(node, ast.ClassDef):
            stub.classes[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if _is_type_alias(node.annotation):
                stub.aliases.add(node.target.id)
            else:
                stub.attributes[node.target.id] = node.annotation
        elif isinstance(node, ast.Assign):  # an implicit alias or a value: either way a name the stub declares
            for target in node.targets:
                if isinstance(target, ast.Name):
                    stub.attributes[target.id] = None
        elif not isinstance(node, (ast.Import, ast.ImportFrom, ast.Expr)):
            raise AssertionError(f"_C.pyi line {node.lineno}: a {type(node).__name__} this test does not read")
    return stub


def class_members(node: ast.ClassDef) -> dict[str, ast.FunctionDef | None]:
    """name -> the method's def, or None for a property or an annotated attribute."""
    members: dict[str, ast.FunctionDef | None] = {}
    for item in node.body:
        if isinstance(item, ast.FunctionDef):
            is_property = any(isinstance(d, ast.Name) and d.id == "property" for d in item.decorator_list)
            members[item.name] = None if is_property else item
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            members[item.target.id] = None
    return members


@dataclass
class Params:
    """A stub function's parameters (``self`` left out for methods)."""

    positional_only: list[str]
    positional: list[str]  # positional-or-keyword
    keyword_only: list[str]
    required_positional: int
    star_args: bool
    star_kwargs: bool

    @property
    def positional_count(self) -> int:
        return len(self.positional_only) + len(self.positional)

    @property
    def total(self) -> int:
        return self.positional_count + len(self.keyword_only)


def stub_params(fn: ast.FunctionDef, method: bool = False) -> Params:
    a = fn.args
    posonly = [p.arg for p in a.posonlyargs]
    normal = [p.arg for p in a.args]
    required = len(posonly) + len(normal) - len(a.defaults)
    if method:
        if posonly:
            posonly = posonly[1:]
        else:
            normal = normal[1:]
        required -= 1
    return Params(posonly, normal, [p.arg for p in a.kwonlyargs], required, a.vararg is not None, a.kwarg is not None)


# ----------------------------------------------------------------------------- the package's uses


def used_names(package_dir: str) -> dict[str, list[str]]:
    """{name: ["file:line", ...]} of every ``_C.<name>`` the package's Python code reads: through
    a name bound to the module (``from . import _C``, ``C = self._C``), ``self._C.x`` and
    ``vramkit._C.x`` (not ``torch._C``), and ``getattr(_C, "x")``."""
    used: dict[str, list[str]] = {}
    for root, _dirs, files in os.walk(package_dir):
        for fname in sorted(files):
            if not fname.endswith(".py"):
                continue
            path = os.path.join(root, fname)
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), path)
            rel = os.path.relpath(path, package_dir)
            aliases = {"_C"}
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom):
                    aliases.update(a.asname or a.name for a in node.names if a.name == "_C")
                elif isinstance(node, ast.Import):
                    aliases.update(a.asname for a in node.names if a.name == "vramkit._C" and a.asname)

            def is_module(expr: ast.expr) -> bool:
                return (isinstance(expr, ast.Name) and expr.id in aliases) or \
                    (isinstance(expr, ast.Attribute) and expr.attr == "_C" and isinstance(expr.value, ast.Name)
                     and expr.value.id in ("self", "vramkit"))

            changed = True
            while changed:  # names assigned from the module: `C = self._C`
                changed = False
                for node in ast.walk(tree):
                    if isinstance(node, ast.Assign) and is_module(node.value):
                        for target in node.targets:
                            if isinstance(target, ast.Name) and target.id not in aliases:
                                aliases.add(target.id)
                                changed = True
            for node in ast.walk(tree):
                name = None
                if isinstance(node, ast.Attribute) and is_module(node.value):
                    name = node.attr
                elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                      and len(node.args) >= 2 and is_module(node.args[0])
                      and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
                    name = node.args[1].value
                if name is not None:
                    used.setdefault(name, []).append(f"{rel}:{node.lineno}")
    return used


# ----------------------------------------------------------------------------- the checks


def missing_from_stub(stub: Stub, module: Any, used: dict[str, list[str]]) -> list[str]:
    """Names the extension has (public ones, and private ones the package uses) or the package
    reads from it, that the stub does not declare."""
    problems = []
    declared = stub.declared()
    reported = set()
    for name in sorted(n for n in dir(module) if not n.startswith("__")):
        if name not in declared and (not name.startswith("_") or name in used):
            problems.append(f"{name}: in the extension but not declared in _C.pyi")
            reported.add(name)
    for name, where in sorted(used.items()):
        if name not in declared and name not in MODULE_ATTRIBUTES and name not in reported:
            elsewhere = "" if hasattr(module, name) else " (nor in the extension)"
            problems.append(f"{name}: used at {', '.join(where)} but not declared in _C.pyi{elsewhere}")
    return problems


def missing_from_extension(stub: Stub, module: Any) -> list[str]:
    """Names the stub declares that the extension lacks (type aliases are stub-only: they must
    be private so that nothing takes them for the extension's). A function marked CUDA_ONLY may
    be missing from a build without CUDA, and only there."""
    cuda = getattr(module, "CUDA_COMPILED", True)
    problems = [f"{name}: declared in _C.pyi but not in the extension" for name in sorted(stub.declared())
                if not hasattr(module, name) and (cuda or name not in stub.cuda_only)]
    for name in sorted(stub.aliases):
        if not name.startswith("_"):
            problems.append(f"{name}: a stub-only type alias must be private (_{name})")
        if hasattr(module, name):
            problems.append(f"{name}: declared as a type alias in _C.pyi, but the extension has a {name}")
    for cname, cnode in sorted(stub.classes.items()):
        cls = getattr(module, cname, None)
        if not isinstance(cls, type):
            continue
        members = class_members(cnode)
        for member in sorted(members):
            if not hasattr(cls, member):
                problems.append(f"{cname}.{member}: declared in _C.pyi but not in the extension")
        for member in sorted(vars(cls)):
            if member not in members and member != "__doc__" and not hasattr(object, member):
                problems.append(f"{cname}.{member}: in the extension but not declared in _C.pyi")
    return problems


def kind_mismatches(stub: Stub, module: Any) -> list[str]:
    """Stub functions are builtin functions, stub classes classes, stub attributes values of the
    annotated type (when it is a builtin one); class properties and methods likewise."""
    problems = []
    for name in sorted(stub.functions):
        obj = getattr(module, name, None)
        if obj is not None and not isinstance(obj, types.BuiltinFunctionType):
            problems.append(f"{name}: a function in _C.pyi, a {type(obj).__name__} in the extension")
    for name, cnode in sorted(stub.classes.items()):
        obj = getattr(module, name, None)
        if obj is None:
            continue
        if not isinstance(obj, type):
            problems.append(f"{name}: a class in _C.pyi, a {type(obj).__name__} in the extension")
            continue
        for member, fn in sorted(class_members(cnode).items()):
            raw = inspect.getattr_static(obj, member, None)
            if raw is None:
                continue
            is_data = inspect.isgetsetdescriptor(raw) or inspect.ismemberdescriptor(raw) or isinstance(raw, property)
            if fn is None and not is_data:
                problems.append(f"{name}.{member}: a property in _C.pyi, a {type(raw).__name__} in the extension")
            if fn is not None and not (inspect.ismethoddescriptor(raw) and callable(raw)):
                problems.append(f"{name}.{member}: a method in _C.pyi, a {type(raw).__name__} in the extension")
    for name, annotation in sorted(stub.attributes.items()):
        if not hasattr(module, name):
            continue
        value = getattr(module, name)
        if callable(value):
            problems.append(f"{name}: a {type(value).__name__} in the extension; declare it as a function or class")
        expected = SIMPLE_TYPES.get(annotation.id) if isinstance(annotation, ast.Name) else None
        if expected is not None and type(value) is not expected:
            problems.append(f"{name}: annotated {annotation.id} in _C.pyi, a {type(value).__name__} in the extension")
    return problems


_ARITY = [
    (re.compile(r"takes no arguments \(\d+ given\)"), lambda m: (0, 0)),
    (re.compile(r"takes exactly one argument \(\d+ given\)"), lambda m: (1, 1)),
    (re.compile(r"takes exactly (\d+) (?:positional )?arguments? \(\d+ given\)"),
     lambda m: (int(m[1]), int(m[1]))),
    (re.compile(r"takes at most (\d+) (?:positional )?arguments? \(\d+ given\)"), lambda m: (None, int(m[1]))),
    (re.compile(r"expected at most (\d+) arguments?, got \d+"), lambda m: (None, int(m[1]))),
    (re.compile(r"takes from (\d+) to (\d+) positional arguments but \d+ were given"),
     lambda m: (int(m[1]), int(m[2]))),
]


def _refusal(call: Any) -> str | None:
    """The TypeError message of a call that must be refused; None if it was accepted."""
    try:
        call()
    except TypeError as e:
        return str(e)
    return None


def _doc_params(name: str, doc: str | None) -> Params | None:
    """The parameters of a docstring that starts with ``name(...)``, or None."""
    first = (doc or "").lstrip().split("\n", 1)[0]
    m = re.match(re.escape(name) + r"\(([^()]*)\)", first)
    if m is None:
        return None
    try:
        fn = ast.parse(f"def f({m[1]}): pass").body[0]
    except SyntaxError:
        return None
    assert isinstance(fn, ast.FunctionDef)
    return stub_params(fn)


def signature_problems(qualname: str, fn: ast.FunctionDef, obj: Any, method: bool = False) -> list[str]:
    """Where the stub's signature of ``fn`` disagrees with the builtin ``obj``."""
    params = stub_params(fn, method)
    name = fn.name
    try:
        sig = inspect.signature(obj)
    except (ValueError, TypeError):
        sig = None
    if sig is not None:  # a __text_signature__: compare names and kinds exactly
        P = inspect.Parameter
        kinds = {P.POSITIONAL_ONLY: "positional-only", P.POSITIONAL_OR_KEYWORD: "positional",
                 P.KEYWORD_ONLY: "keyword-only", P.VAR_POSITIONAL: "*args", P.VAR_KEYWORD: "**kwargs"}
        got = [(p.name if p.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD) else "", kinds[p.kind])
               for p in sig.parameters.values()]
        want = ([(p, "positional-only") for p in params.positional_only]
                + [(p, "positional") for p in params.positional] + ([("", "*args")] if params.star_args else [])
                + [(p, "keyword-only") for p in params.keyword_only]
                + ([("", "**kwargs")] if params.star_kwargs else []))
        if got != want:
            return [f"{qualname}: the extension's signature is {sig}, _C.pyi has {want}"]
        return []
    if params.star_kwargs:
        return []  # takes anything: a probe would run it
    problems = []
    refused = _refusal(lambda: obj(**{PROBE_KEYWORD: None}))
    if refused is None:
        return [f"{qualname}: accepted an unknown keyword argument; _C.pyi declares no **kwargs"]
    takes_keywords = "takes no keyword arguments" not in refused
    if not takes_keywords and (params.positional or params.keyword_only):
        problems.append(f"{qualname}: takes no keyword arguments, so _C.pyi must declare its parameters "
                        f"positional-only (end them with /), got {params.positional + params.keyword_only}")
    m = re.search(r"missing required argument '(\w+)' \(pos (\d+)\)", refused)
    if m is not None:
        names = params.positional_only + params.positional
        pos = int(m[2]) - 1
        if pos >= len(names) or names[pos] != m[1]:
            problems.append(f"{qualname}: the extension's parameter {pos + 1} is {m[1]!r}, _C.pyi says "
                            f"{names[pos] if pos < len(names) else 'nothing'}")
    if not params.star_args:
        refused = _refusal(lambda: obj(*[None] * 64))
        arity = None
        for pattern, read in _ARITY:
            found = pattern.search(refused or "")
            if found is not None:
                arity = read(found)
                break
        if arity is None:
            problems.append(f"{qualname}: 64 positional arguments gave {refused!r}, which this test cannot read")
        else:
            least, most = arity
            if most != params.total:
                problems.append(f"{qualname}: the extension takes at most {most} arguments, _C.pyi declares "
                                f"{params.total}")
            if least is not None and least == most and params.required_positional != least:
                problems.append(f"{qualname}: the extension requires {least} arguments, _C.pyi makes "
                                f"{params.required_positional} required")
        if params.keyword_only:  # kwargs-only parameters: one positional argument too many is refused
            refused = _refusal(lambda: obj(*[None] * (params.positional_count + 1)))
            if refused is None or "positional argument" not in refused:
                problems.append(f"{qualname}: _C.pyi declares {params.keyword_only} keyword-only, but the "
                                f"extension did not refuse {params.positional_count + 1} positional arguments")
    doc = _doc_params(name, getattr(obj, "__doc__", None))
    if doc is not None:
        if doc.total != params.total:
            problems.append(f"{qualname}: its docstring lists {doc.total} parameters, _C.pyi {params.total}")
        elif takes_keywords and (doc.positional_only + doc.positional, doc.keyword_only) != (
                params.positional_only + params.positional, params.keyword_only):
            problems.append(f"{qualname}: takes keyword arguments named as in its docstring "
                            f"{doc.positional + doc.keyword_only} (keyword-only {doc.keyword_only}); _C.pyi has "
                            f"{params.positional_only + params.positional} (keyword-only {params.keyword_only})")
    return problems


def signature_mismatches(stub: Stub, module: Any, instances: dict[str, Any]) -> list[str]:
    """Every stub function, and every method of a class with an instance in ``instances``."""
    problems = []
    for name, fn in sorted(stub.functions.items()):
        obj = getattr(module, name, None)
        if isinstance(obj, types.BuiltinFunctionType):
            problems += signature_problems(name, fn, obj)
    for cname, cnode in sorted(stub.classes.items()):
        instance = instances.get(cname)
        for member, fn in sorted(class_members(cnode).items()):
            if fn is None or instance is None or not hasattr(instance, member):
                continue
            problems += signature_problems(f"{cname}.{member}", fn, getattr(instance, member), method=True)
    return problems


# ----------------------------------------------------------------------------- tests


def _stub_source() -> str:
    with open(STUB, encoding="utf-8") as f:
        return f.read()


@pytest.fixture
def instances():
    """An instance of each class the extension exposes, so that its methods can be probed."""
    buf = vramkit.empty(16, device="cpu")
    yield {"Buffer": buf}
    del buf


def test_the_package_uses_the_extension_through_names_the_walk_finds():
    used = used_names(PACKAGE_DIR)
    assert len(used) >= 30, sorted(used)  # the walk sees the package's calls (not vacuously empty)
    for name in ("raw_alloc", "memory_stats", "_register_exceptions", "amp_unscale_check", "ckpt_plan"):
        assert name in used, name


def test_every_name_of_the_extension_and_every_name_the_package_uses_is_in_the_stub():
    assert missing_from_stub(parse_stub(_stub_source()), _C, used_names(PACKAGE_DIR)) == []


def test_every_name_in_the_stub_exists_in_the_extension():
    assert missing_from_extension(parse_stub(_stub_source()), _C) == []


def test_stub_functions_classes_and_attributes_are_what_the_extension_has():
    assert kind_mismatches(parse_stub(_stub_source()), _C) == []


def test_stub_signatures_match_the_extension(instances):
    stub = parse_stub(_stub_source())
    assert signature_mismatches(stub, _C, instances) == []
    # every function was compared
    expected = set(stub.functions) - (set() if _C.CUDA_COMPILED else stub.cuda_only)
    assert expected <= {n for n in dir(_C) if isinstance(getattr(_C, n), types.BuiltinFunctionType)}


def test_no_extension_function_has_a_text_signature_the_stub_ignores():
    """Where the extension gains text signatures, they are compared name by name (above); this
    lists which functions have one, so that the signature test's exact branch is exercised."""
    with_signature = [n for n in dir(_C) if isinstance(getattr(_C, n), types.BuiltinFunctionType)
                      and getattr(getattr(_C, n), "__text_signature__", None)]
    stub = parse_stub(_stub_source())
    for name in with_signature:
        assert signature_problems(name, stub.functions[name], getattr(_C, name)) == []


# -- the checks catch what they are for: each broken copy of the stub is reported


def _edit(source: str, old: str, new: str) -> str:
    assert source.count(old) == 1, old
    return source.replace(old, new)


def test_a_name_missing_from_the_stub_is_reported():
    source = _stub_source()
    declaration = 'def raw_free(ptr: int, /) -> None:\n    """Return an address from raw_alloc to its cache (0 is a no-op)."""\n'
    stub = parse_stub(_edit(source, declaration, ""))
    problems = missing_from_stub(stub, _C, used_names(PACKAGE_DIR))
    assert [p for p in problems if p.startswith("raw_free:")], problems


def test_a_private_name_the_package_uses_missing_from_the_stub_is_reported():
    source = _stub_source()
    stub = parse_stub(_edit(source, "def _register_exceptions(base: type, oom: type, /) -> None: ...\n", ""))
    problems = missing_from_stub(stub, _C, used_names(PACKAGE_DIR))
    assert [p for p in problems if p.startswith("_register_exceptions:")], problems


def test_a_name_used_by_the_package_but_absent_everywhere_is_reported():
    problems = missing_from_stub(parse_stub(_stub_source()), _C, {"no_such_function": ["x.py:1"]})
    assert "no_such_function: used at x.py:1 but not declared in _C.pyi (nor in the extension)" in problems, problems


def test_a_stub_name_the_extension_lacks_is_reported():
    source = _stub_source() + "def no_such_function() -> None: ...\nDeviceLike = Any\nclass NoSuchClass: ...\n"
    problems = missing_from_extension(parse_stub(source), _C)
    for name in ("no_such_function", "DeviceLike", "NoSuchClass"):
        assert f"{name}: declared in _C.pyi but not in the extension" in problems, problems


def test_a_public_or_shadowing_type_alias_is_reported():
    source = _stub_source() + "Triple: TypeAlias = tuple[int, int, int]\nraw_free: TypeAlias = int\n"
    problems = missing_from_extension(parse_stub(source), _C)
    assert "Triple: a stub-only type alias must be private (_Triple)" in problems, problems
    assert [p for p in problems if p.startswith("raw_free: declared as a type alias")], problems


def test_a_class_member_missing_on_either_side_is_reported():
    source = _edit(_stub_source(), "    def __dlpack_device__(self) -> tuple[int, int]: ...\n",
                   "    def no_such_method(self) -> None: ...\n")
    problems = missing_from_extension(parse_stub(source), _C)
    assert "Buffer.__dlpack_device__: in the extension but not declared in _C.pyi" in problems, problems
    assert "Buffer.no_such_method: declared in _C.pyi but not in the extension" in problems, problems


def _extension_without(names: set[str], cuda_compiled: bool) -> types.ModuleType:
    """A stand-in for the extension lacking ``names``, built with or without CUDA."""
    fake = types.ModuleType("vramkit._C")
    for name in dir(_C):
        if name not in MODULE_ATTRIBUTES and name not in names:
            setattr(fake, name, getattr(_C, name))
    fake.CUDA_COMPILED = cuda_compiled
    return fake


def test_cuda_only_functions_may_be_missing_from_a_build_without_cuda_only():
    stub = parse_stub(_stub_source())
    assert stub.cuda_only == {"bench_cuda_async_pairs", "_cuda_fill_pattern", "_cuda_count_mismatches"}
    assert missing_from_extension(stub, _extension_without(stub.cuda_only, cuda_compiled=False)) == []
    problems = missing_from_extension(stub, _extension_without(stub.cuda_only, cuda_compiled=True))
    assert problems == [f"{name}: declared in _C.pyi but not in the extension" for name in sorted(stub.cuda_only)]
    unmarked = parse_stub(_edit(_stub_source(), "-> list[float]: ...  # CUDA builds only", "-> list[float]: ..."))
    problems = missing_from_extension(unmarked, _extension_without({"bench_cuda_async_pairs"}, cuda_compiled=False))
    assert problems == ["bench_cuda_async_pairs: declared in _C.pyi but not in the extension"]


def test_a_text_signature_is_compared_name_by_name():
    """The branch for functions with a __text_signature__ (none of the extension's has one yet),
    on Python functions, whose signatures inspect reads the same way."""
    def f(a, /, b, *args, c, **kwargs):
        pass

    def g(a, b, *args, c, **kwargs):
        pass

    stub = parse_stub("from typing import Any\n"
                      "def f(a: int, /, b: int, *args: Any, c: int, **kwargs: Any) -> None: ...\n")
    assert signature_problems("f", stub.functions["f"], f) == []
    problems = signature_problems("f", stub.functions["f"], g)
    assert len(problems) == 1 and problems[0].startswith("f: the extension's signature is (a, b, *args, c, **kwargs)")


def test_wrong_kinds_are_reported():
    source = _edit(_stub_source(), "CUDA_COMPILED: bool\n", "CUDA_COMPILED: str\nraw_free: int\n")
    source = _edit(source, "    @property\n    def ptr(self) -> int: ...\n", "    def ptr(self) -> int: ...\n")
    source += "def Buffer() -> None: ...\n"
    problems = kind_mismatches(parse_stub(source), _C)
    assert "CUDA_COMPILED: annotated str in _C.pyi, a bool in the extension" in problems, problems
    assert [p for p in problems if p.startswith("raw_free: a builtin_function_or_method")], problems
    assert [p for p in problems if p.startswith("Buffer.ptr: a method in _C.pyi")], problems
    assert [p for p in problems if p.startswith("Buffer: a function in _C.pyi")], problems


@pytest.mark.parametrize("old, new, expected", [
    # a function that takes no keywords, declared with keyword parameters
    ("def raw_free(ptr: int, /) -> None:", "def raw_free(ptr: int) -> None:",
     "raw_free: takes no keyword arguments"),
    # one parameter too many, and one too few
    ("def raw_free(ptr: int, /) -> None:", "def raw_free(ptr: int, other: int, /) -> None:",
     "raw_free: the extension takes at most 1 arguments, _C.pyi declares 2"),
    ("def get_num_threads() -> int: ...", "def get_num_threads(n: int, /) -> int: ...",
     "get_num_threads: the extension takes at most 0 arguments, _C.pyi declares 1"),
    # an optional parameter the extension requires
    ("def record_stream(ptr: int, stream: _StreamLike, /) -> None: ...",
     "def record_stream(ptr: int, stream: _StreamLike = ..., /) -> None: ...",
     "record_stream: the extension requires 2 arguments, _C.pyi makes 1 required"),
    # a keyword parameter under another name than the extension's
    ("def raw_alloc(nbytes: int, device: _DeviceLike = ..., stream: _StreamLike = ...) -> int:",
     "def raw_alloc(nbytes: int, dev: _DeviceLike = ..., stream: _StreamLike = ...) -> int:",
     "raw_alloc: takes keyword arguments named as in its docstring"),
    ("def trace_replay(kind: Any,", "def trace_replay(kinds: Any,",
     "trace_replay: the extension's parameter 1 is 'kind'"),
    # keyword-only parameters declared positional
    ("    def __dlpack__(self, *, stream: Any = ...,", "    def __dlpack__(self, stream: Any = ...,",
     "Buffer.__dlpack__: takes keyword arguments named as in its docstring"),
])
def test_a_wrong_signature_is_reported(instances, old, new, expected):
    stub = parse_stub(_edit(_stub_source(), old, new))
    problems = signature_mismatches(stub, _C, instances)
    assert [p for p in problems if p.startswith(expected)], problems
