"""Every dotted vramkit name the README and the docs show (``vramkit.trace.replay``,
``vramkit.leaks.LeakWatchWarning``, ``from vramkit.survive import find_batch_size``) imports
from where they show it. Moving a module or renaming a function without updating the pages fails
here; the API reference pages themselves are checked by the strict documentation build."""

from __future__ import annotations

import glob
import importlib
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGES = [os.path.join(REPO, "README.md")] + sorted(glob.glob(os.path.join(REPO, "docs", "**", "*.md"), recursive=True))
DOTTED = re.compile(r"\bvramkit(?:\.[A-Za-z_][A-Za-z_0-9]*)+")
FROM_IMPORT = re.compile(r"^\s*from (vramkit(?:\.[A-Za-z_][A-Za-z_0-9]*)*) import ([A-Za-z_][A-Za-z_0-9, ]*)", re.M)
# Names that look dotted but are files (vramkit.h, vramkit-snapshot.pickle's stem is not matched),
# or that run something when imported (python -m vramkit).
NOT_NAMES = re.compile(r"\.(h|c|py|pyi|md|html|pickle|vktrace|json|so|whl)$|^vramkit\.__main__$")


def documented_names() -> dict[str, str]:
    found: dict[str, str] = {}
    for page in PAGES:
        with open(page, encoding="utf-8") as f:
            text = f.read()
        where = os.path.relpath(page, REPO)
        for m in DOTTED.finditer(text):
            if not NOT_NAMES.search(m.group(0)):
                found.setdefault(m.group(0), where)
        for m in FROM_IMPORT.finditer(text):
            for name in m.group(2).split(","):
                name = name.strip().split(" as ")[0]
                if name:
                    found.setdefault(f"{m.group(1)}.{name}", where)
    return found


def resolve(dotted: str) -> object:
    """Import the longest module prefix of ``dotted``, then follow the attributes."""
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:k]))
        except ModuleNotFoundError:
            continue
        break
    for attr in parts[k:]:
        obj = getattr(obj, attr)  # AttributeError: the page shows a name that is not there
    return obj


NAMES = documented_names()


def test_the_pages_show_names():
    assert len(NAMES) > 50 and "vramkit.leaks.LeakWatchWarning" in NAMES and "vramkit.survive.find_batch_size" in NAMES


@pytest.mark.parametrize("dotted", sorted(NAMES))
def test_documented_name_imports(dotted):
    if dotted.startswith(("vramkit.torch", "vramkit.checkpoint.", "vramkit.trace.capture", "vramkit.trace.fit")):
        pytest.importorskip("torch")
    if dotted.split(".")[:2] == ["vramkit", "examples"]:
        # installed, examples/ is the package vramkit.examples; in a source checkout it is examples/
        rest = dotted.split(".")[2:]
        assert os.path.exists(os.path.join(REPO, "examples", *rest) + (".py" if rest else "")), dotted
        return
    try:
        resolve(dotted)
    except (ImportError, AttributeError) as exc:
        pytest.fail(f"{NAMES[dotted]} shows {dotted}, which does not import: {exc!r}")


def test_the_check_catches_a_missing_name():
    with pytest.raises(AttributeError):
        resolve("vramkit.trace.replay_on_gpu")
    with pytest.raises(AttributeError):
        resolve("vramkit.leaks.NoSuchWarning")
