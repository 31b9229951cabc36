"""The public surface: `layerstream.__all__` is exactly what a user calls and the errors a user catches, every
name of it imports, and every import the README and docs/ show works."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import layerstream

PUBLIC = {
    # what a user calls, and the config and plans it takes
    "enable_offload", "OffloadHandle", "Omni", "GenerationRequest", "parse_offload_config", "OffloadConfig",
    "LayerOptions", "get_offload_plan", "OffloadPlan", "resolve_offload_plan", "ResolvedOffloadPlan",
    # what a user catches: the base, enable_offload's and the runtime's, the config's and plans', Omni's
    "LayerstreamError", "OffloadError", "UnsupportedTensorError", "UnsupportedUseError", "ConcurrentUseError",
    "TransferError", "OffloadConfigError", "OffloadPlanError", "OffloadPlanResolutionError", "GenerationError",
    "ModelLoadError", "InputImageError", "MissingExtraError",
}  # fmt: skip


def test_the_package_exports_exactly_the_public_names():
    assert sorted(layerstream.__all__) == sorted(PUBLIC)


@pytest.mark.parametrize("name", layerstream.__all__)
def test_every_public_name_imports(name):
    assert getattr(layerstream, name) is not None


@pytest.mark.parametrize(
    "path", ["layerstream.runtime.errors", "layerstream.server.media", "layerstream.server.jobs.outputs"]
)
def test_no_module_keeps_a_moved_path_alive(path):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(path)


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
