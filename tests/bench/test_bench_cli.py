"""benchmarks/strategies.py end to end: JSON on stdout, a row per strategy, trace files. The smoke run and one
user error run as subprocesses (the exit status, stderr without a traceback); the rest through its `main`.

No timing is asserted: the figures depend on the machine. What is checked is the shape of the output and the
facts that do not depend on speed (bytes streamed, copies per block, outputs equal to resident).
"""

from __future__ import annotations

import json
import subprocess
import sys

from dataclasses import dataclass

import pytest

from benchmark_modules import BENCHMARKS, benchmark_module

DEFAULT_STRATEGIES = benchmark_module("strategy_bench.strategies").DEFAULT_STRATEGIES

ROW_FIELDS = (
    "strategy",
    "median_seconds",
    "ratio_to_resident",
    "device_peak_bytes",
    "device_peak_source",
    "host_rss_peak_bytes",
    "bytes_streamed_per_forward",
    "stall_seconds_per_forward",
    "enable_seconds",
    "ideal_seconds",
    "measured_over_ideal",
    "transfer_floor_seconds",
    "measured_over_floor",
    "matches_resident",
)


def _bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / "strategies.py"), *args], capture_output=True, text=True, timeout=timeout
    )


@dataclass(frozen=True)
class ScriptResult:
    returncode: int
    stdout: str
    stderr: str

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.startswith("strategies.py: error:")]


@pytest.fixture
def strategies_cli(capsys):
    """The script's `main` in this process: exit code, stdout and stderr, as a subprocess would give them."""
    script = benchmark_module("strategies")

    def run(*argv: str) -> ScriptResult:
        capsys.readouterr()
        try:
            code = script.main(list(argv))
        except SystemExit as e:  # argparse's --help and usage errors
            code = e.code if isinstance(e.code, int) else 0
        out = capsys.readouterr()
        return ScriptResult(code, out.out, out.err)

    return run


@pytest.fixture(scope="module")
def smoke_json() -> dict:
    done = _bench("--smoke", "--json", "--device", "cpu")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # stdout holds the JSON and nothing else


def test_smoke_json_has_a_row_per_strategy(smoke_json):
    rows = {row["strategy"]: row for row in smoke_json["strategies"]}
    assert list(rows) == list(DEFAULT_STRATEGIES)
    for row in rows.values():
        for field in ROW_FIELDS:
            assert field in row, (row["strategy"], field)
        if not row["skipped"]:
            assert row["median_seconds"] > 0
            assert row["host_rss_peak_bytes"] > 0
            assert row["enable_seconds"] >= 0
    assert rows["resident"]["ratio_to_resident"] == pytest.approx(1.0)


def test_smoke_json_layerwise_rows_stream_and_match_resident(smoke_json):
    run = smoke_json["run"]
    rows = {row["strategy"]: row for row in smoke_json["strategies"]}
    block_bytes = run["block_bytes"]
    assert run["link_gbps"] > 0 and run["link_ratio"] == 0.5  # --smoke simulates a link on the CPU
    layerwise = rows["layerwise"]
    assert layerwise["bytes_streamed_per_forward"] == sum(block_bytes)  # every block, once per forward
    assert layerwise["stall_seconds_per_forward"] is not None
    assert layerwise["ideal_seconds"] > 0 and layerwise["transfer_floor_seconds"] > 0
    resident_one = rows["layerwise-resident-1"]
    assert resident_one["bytes_streamed_per_forward"] == sum(block_bytes[1:])
    assert rows["naive"]["bytes_streamed_per_forward"] > 0
    for name, row in rows.items():
        if not row["skipped"]:
            assert row["matches_resident"] is True, name
    assert rows["diffusers-group"]["meaningful"] is False  # CPU to CPU: reported, marked
    assert rows["layerwise"]["device_peak_bytes"] < rows["resident"]["device_peak_bytes"]


def test_trace_writes_chrome_json_and_png(tmp_path, strategies_cli):
    done = strategies_cli("--smoke", "--device", "cpu", "--strategies", "resident,layerwise", "--repeats", "1",
                  "--trace", str(tmp_path))
    assert done.returncode == 0, done.stderr
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    lanes = {e["args"]["name"]: e["tid"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"}
    assert set(lanes) == {"copy", "compute"}
    complete = [e for e in events if e.get("ph") == "X"]
    num_blocks = 8  # the tiny model's default
    for lane in ("copy", "compute"):
        labels = sorted(e["name"] for e in complete if e["cat"] == lane)
        if lane == "copy" and labels.count("blocks.0") == 2:
            # the next call's first block, prefetched while the last one computes, may finish inside this trace
            labels.remove("blocks.0")
        assert labels == sorted(f"blocks.{i}" for i in range(num_blocks)), lane  # one interval per streamed block
        assert all(e["tid"] == lanes[lane] and e["dur"] >= 0 for e in complete if e["cat"] == lane)
    png = (tmp_path / "timeline.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 1000


def test_help_and_user_errors(strategies_cli):
    done = strategies_cli("--help")
    assert done.returncode == 0 and "--link-ratio" in done.stdout
    done = _bench("--smoke", "--device", "cpu", "--strategies", "resident,bogus", timeout=60)  # a real process
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("strategies.py: error: --strategies: unknown strategy 'bogus'")
    done = strategies_cli("--smoke", "--device", "cpu", "--link-gbps", "1", "--link-ratio", "1")
    assert done.returncode == 2 and len(done.error_lines) == 1


def test_disk_tier_rows_read_their_disk_blocks_every_forward_and_match_resident(strategies_cli):
    """--host-budget-gb puts the layerwise rows' blocks beyond it in spill files; --disk-gbps simulates the disk.
    Rows report disk bytes per forward, the disk stall and the disk floor, and stay bit-identical to resident."""
    done = strategies_cli("--smoke", "--json", "--device", "cpu", "--strategies", "resident,layerwise,naive", "--repeats", "2",
                  "--host-budget-gb", "0.0006", "--disk-gbps", "0.5")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    run = result["run"]
    assert run["host_budget_gb"] == 0.0006 and run["disk_gbps"] == 0.5
    rows = {row["strategy"]: row for row in result["strategies"]}
    layerwise = rows["layerwise"]
    block = max(run["block_bytes"])
    num_host = int(0.0006e9 // block)  # the tiny model's blocks are all the same size
    assert layerwise["num_disk_blocks"] == run["num_blocks"] - num_host
    # every disk block is read once a forward (bytes count when read: within one block of it)
    assert abs(layerwise["disk_bytes_per_forward"] - layerwise["num_disk_blocks"] * block) <= block
    assert 0 <= layerwise["disk_stall_seconds_per_forward"] <= layerwise["stall_seconds_per_forward"]
    assert layerwise["disk_floor_seconds"] == pytest.approx(layerwise["num_disk_blocks"] * block / 0.5e9, rel=0.05)
    assert layerwise["ideal_seconds"] >= layerwise["disk_floor_seconds"]
    assert layerwise["matches_resident"] is True
    assert rows["naive"]["num_disk_blocks"] is None  # the disk tier is the layerwise rows'


@pytest.mark.parametrize(
    "args, message",
    [
        (("--disk-gbps", "1"), "--disk-gbps = 1.0 needs --host-budget-gb"),
        (("--host-budget-gb", "0"), "--host-budget-gb = 0.0 is not valid; expected a number > 0"),
        (("--host-budget-gb", "1", "--disk-gbps", "-2"), "--disk-gbps = -2.0 is not valid; expected a number > 0"),
    ],
)
def test_disk_tier_flags_are_checked_before_anything_runs(args, message, capsys):
    main = benchmark_module("strategies").main

    assert main(["--smoke", "--device", "cpu", *args]) == 2
    assert message in capsys.readouterr().err


def test_disk_tier_flags_that_the_strategies_cannot_take_exit_2_naming_them(strategies_cli):
    done = strategies_cli("--smoke", "--device", "cpu", "--host-budget-gb", "1", "--strategies", "resident,naive")
    assert done.returncode == 2 and "applies to layerwise rows, and --strategies names none" in done.stderr
