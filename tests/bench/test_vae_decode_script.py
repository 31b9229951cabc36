"""`benchmarks/vae_decode.py` at its smoke row: a narrow Flux VAE's decode planned within 20% of the allocator's
peak, measured in this process (the full rows, in fresh processes, are in benchmarks/README.md)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "vae_decode.py"


@pytest.fixture
def script():
    spec = importlib.util.spec_from_file_location("vae_decode_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def test_the_smoke_row_is_planned_within_20_percent_of_the_allocators_peak(script, tmp_path, capsys):
    raw = tmp_path / "vae.json"
    assert script.main(["--rows", "smoke", "--in-process", "--threads", "1", "--json", str(raw)]) == 0
    (row,) = json.loads(raw.read_text())
    assert 0.8 <= row["planned_over_allocator"] <= 1.2
    assert "planned" in capsys.readouterr().out
