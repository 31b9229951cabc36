"""`benchmarks/vae_decode.py` at its smoke row: a narrow Flux VAE's decode planned within 20% of the allocator's
peak, measured in this process (the full rows, in fresh processes, are in benchmarks/README.md)."""

from __future__ import annotations

import json

from benchmark_modules import benchmark_module


def test_the_smoke_row_is_planned_within_20_percent_of_the_allocators_peak(tmp_path, capsys):
    raw = tmp_path / "vae.json"
    assert benchmark_module("vae_decode").main(["--rows", "smoke", "--in-process", "--threads", "1", "--json", str(raw)]) == 0
    (row,) = json.loads(raw.read_text())
    assert 0.8 <= row["planned_over_allocator"] <= 1.2  # measured: 0.996
    assert "planned" in capsys.readouterr().out
