"""The documented API holds: every name of `layerstream.__all__` and every import the README and docs/ show
imports, and a documented path that moved keeps an alias that warns, naming the new path, until the next minor
version."""

from __future__ import annotations

import importlib
import re
import sys
import warnings
from pathlib import Path

import pytest

import layerstream


@pytest.mark.parametrize("name", layerstream.__all__)
def test_every_public_name_imports(name):
    assert getattr(layerstream, name) is not None


def test_the_runtime_errors_path_of_the_last_release_still_imports_and_warns():
    sys.modules.pop("layerstream.runtime.errors", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = importlib.import_module("layerstream.runtime.errors")
    assert old.OffloadError is layerstream.OffloadError and old.TransferError is layerstream.errors.TransferError
    messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert any("layerstream.runtime.errors is deprecated" in m and "layerstream.errors" in m for m in messages)


@pytest.mark.parametrize(
    "old_path, name, new_path",
    [
        ("layerstream.server.media", "encode_result_b64", "layerstream.outputs"),
    ],
)
def test_a_moved_module_of_the_last_release_still_imports_and_warns(old_path, name, new_path):
    sys.modules.pop(old_path, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = importlib.import_module(old_path)
    assert callable(getattr(old, name))
    new = importlib.import_module(new_path)
    if hasattr(new, name):
        assert getattr(old, name) is getattr(new, name)
    messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert any(f"{old_path} is deprecated" in m and new_path in m for m in messages)


DOCUMENTED_IMPORT = re.compile(r"^\s*from (layerstream[\w.]*) import ([\w, ]+)$|^\s*import (layerstream[\w.]*)$", re.M)


def _documented_imports() -> list[tuple[str, tuple[str, ...]]]:
    root = Path(__file__).resolve().parents[1]
    found = set()
    for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for match in DOCUMENTED_IMPORT.finditer(page.read_text()):
            if match[3]:
                found.add((match[3], ()))
            else:
                found.add((match[1], tuple(n.strip() for n in match[2].split(",") if n.strip())))
    return sorted(found)


def test_the_docs_show_imports():
    assert len(_documented_imports()) >= 3  # the README's quick starts: a pattern that finds none tests nothing


@pytest.mark.parametrize(("module", "names"), _documented_imports())
def test_every_import_the_docs_show_works(module, names):
    imported = importlib.import_module(module)
    for name in names:
        assert getattr(imported, name) is not None, f"{module}.{name}"
