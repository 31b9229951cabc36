"""The bench report's disk-tier columns and header: shown when a row read blocks from disk, absent otherwise."""

from __future__ import annotations

import pytest

from benchmark_modules import benchmark_module

benchmark_module("strategy_bench")  # benchmarks/ on sys.path, as the scripts have it

from strategy_bench.report import DISK_COLUMNS, format_report  # noqa: E402
from strategy_bench.results import BenchResult, RunInfo, StrategyResult  # noqa: E402

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast

MIB = 2**20


def _result(*, disk: bool) -> BenchResult:
    run = RunInfo(
        model="tiny", dim=64, num_heads=4, ffn_dim=256, num_blocks=4, num_tokens=64, num_context_tokens=0,
        batch_size=1, dtype="float32", device="cpu", device_name="cpu", torch_version="x", threads=1, repeats=1,
        warmup=1, prefetch_depth=1, model_bytes=4 * MIB, block_bytes=[MIB] * 4, block_compute_seconds=[0.01] * 4,
        other_compute_seconds=0.0, link_gbps=None, link_ratio=None, measured_link_gbps=None, device_budget_gb=None,
        process_rss_bytes=0, host_budget_gb=0.002 if disk else None, disk_gbps=0.05 if disk else None,
    )  # fmt: skip
    resident = StrategyResult(strategy="resident", kind="resident", median_seconds=0.04, min_seconds=0.04)
    extra = (
        dict(num_disk_blocks=3, disk_bytes_per_forward=3 * MIB, disk_stall_seconds_per_forward=0.0125,
             disk_gbps=0.05, disk_floor_seconds=0.0629, measured_over_disk_floor=1.0123)
        if disk
        else {}
    )  # fmt: skip
    layerwise = StrategyResult(strategy="layerwise", kind="layerwise", median_seconds=0.0637, min_seconds=0.06, **extra)
    return BenchResult(run=run, strategies=[resident, layerwise])


def test_disk_rows_add_disk_columns_before_the_notes_and_a_header_line():
    report = format_report(_result(disk=True))
    header, rows = report.split("\n\n", 1)
    assert "disk tier: host budget 0.002 GB" in header and "simulated disk 0.05 GB/s" in header
    columns = [c.strip() for c in rows.splitlines()[0].strip("|").split("|")]
    assert columns[-1 - len(DISK_COLUMNS) : -1] == list(DISK_COLUMNS) and columns[-1] == "notes"
    layerwise = [c.strip() for c in rows.splitlines()[3].strip("|").split("|")]
    assert layerwise[-5:-1] == ["3", "3.0", "12.50", "1.012"]  # disk blocks, MiB/fwd, stall ms/fwd, x disk floor
    resident = [c.strip() for c in rows.splitlines()[2].strip("|").split("|")]
    assert resident[-5:-1] == ["-"] * 4


def test_without_the_disk_tier_the_report_has_no_disk_columns():
    report = format_report(_result(disk=False))
    assert "disk" not in report
