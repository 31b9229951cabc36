"""The documented API holds: every name of `layerstream.__all__` imports, and a documented path that moved
keeps an alias that warns, naming the new path, until the next minor version."""

from __future__ import annotations

import importlib
import sys
import warnings

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
