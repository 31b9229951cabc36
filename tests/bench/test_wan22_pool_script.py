"""`benchmarks/wan22_pool.py` runs (tiny shape, no simulated delays): every row bit-identical to resident, and
under the same budget the pool keeps more blocks of each expert in host memory and reads fewer bytes from disk
than the static split. Times are not asserted (they live in benchmarks/README.md)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "wan22_pool.py"


def test_the_pool_script_compares_pool_static_and_resident(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("wan22_pool", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "figures.json"
    argv = ["--shape", "tiny", "--blocks", "6", "--tokens", "16", "--context-tokens", "4", "--steps", "4",
            "--repeats", "1", "--disk-dir", str(tmp_path / "spill"), "--json", str(out)]
    threads = torch.get_num_threads()
    try:
        assert module.main(argv) == 0
    finally:
        torch.set_num_threads(threads)  # the script leaves a core to the copy and read threads
    rows = json.loads(out.read_text())["rows"]
    pool, static = rows["pool"], rows["static"]
    assert pool["bit_identical"] and static["bit_identical"]
    assert pool["blocks_in_host_memory_per_expert"] > static["blocks_in_host_memory_per_expert"]
    assert pool["disk_mb_per_loop"] < static["disk_mb_per_loop"]
    assert pool["host_mb"] <= pool["budget_mb"] and static["host_mb"] <= static["budget_mb"]
    assert "| pool |" in capsys.readouterr().out
    assert not any((tmp_path / "spill").rglob("*.block"))  # disable removed every spill file
