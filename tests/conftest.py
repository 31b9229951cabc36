"""Fixtures shared by the whole test suite."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def layerstream_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Point ``$LAYERSTREAM_CACHE`` at one temporary folder for the whole session.

    Autouse so that no test ever writes to the user's real cache; shared so that each embedded tiny model is
    built once per session, however many tests load it. Tests of the cache itself override it with
    ``monkeypatch.setenv`` and a ``tmp_path`` of their own.
    """
    cache = tmp_path_factory.mktemp("layerstream-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LAYERSTREAM_CACHE", str(cache))
        # Nothing in the suite may reach the Hugging Face Hub.
        patch.setenv("HF_HUB_OFFLINE", "1")
        yield cache
