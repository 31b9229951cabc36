"""`benchmarks/gpu_checks.sh` and `.py` on a machine without a GPU: the shell script parses, the Python one names
every check the GPU audit asks for, and its CPU simulation (the accelerator engine over a synchronous stand-in,
the disk tier on a simulated disk) runs end to end with outputs bit-identical to resident."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_checks.py"
REQUIRED = {"pinning", "paths", "delays", "drop", "sync-debug", "capture", "second-gpu", "compute-thread", "write-back", "backward"}


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT / "src")}


def test_the_shell_script_parses_and_the_checks_cover_the_audit():
    subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu_checks.sh")], check=True)
    listed = subprocess.run([sys.executable, str(SCRIPT), "--list"], capture_output=True, text=True, env=_env(), check=True)
    assert set(listed.stdout.split()) == REQUIRED


def test_the_cpu_simulation_runs_and_is_bit_identical():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu-simulation", "1"], capture_output=True, text=True, env=_env(), timeout=600
    )
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("compute-thread: PASS CPU simulation") and "bit-identical" in lines[0]
