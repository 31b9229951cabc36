"""The modules beside the scripts of benchmarks/ (checkpoint folders, the page cache, the cold start), imported
as the scripts import them: by their own names, with benchmarks/ on `sys.path`, so that a test and the script
it runs share one module."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def benchmark_module(name: str) -> ModuleType:
    """`benchmarks/<name>.py`, imported."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)
