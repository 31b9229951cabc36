"""How long `layerstream --help` and each subcommand's `--help` take, each in a fresh interpreter as a user's shell
runs them (the help imports no torch: tests/cli/test_install_tiers.py holds that; this measures the time). The
bytecode cache is on, as for an installed package (PYTHONDONTWRITEBYTECODE is dropped; one untimed run first).

    python benchmarks/cli_help.py               # median of 5 runs a command, a table
    python benchmarks/cli_help.py --json --repeats 9
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

COMMANDS = (("--help",), ("generate", "--help"), ("plan", "--help"), ("bench", "--help"), ("serve", "--help"), ("--version",))


def time_command(argv: tuple[str, ...], repeats: int) -> dict:
    """Median and fastest wall seconds of ``python -m layerstream ARGV`` over `repeats` fresh processes."""
    seconds = [_seconds([sys.executable, "-m", "layerstream", *argv]) for _ in range(repeats)]
    return {"command": "layerstream " + " ".join(argv), "median_s": statistics.median(seconds), "fastest_s": min(seconds)}


_ENV = {name: value for name, value in os.environ.items() if name != "PYTHONDONTWRITEBYTECODE"}


def _seconds(argv: list[str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env=_ENV)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited with {done.returncode}: {done.stderr.strip()}")
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="fresh processes a command (default: 5)")
    parser.add_argument("--json", action="store_true", help="the rows as JSON on stdout")
    args = parser.parse_args(argv)
    _seconds([sys.executable, "-m", "layerstream", "--version"])  # writes the bytecode cache
    interpreter_s = statistics.median(_seconds([sys.executable, "-c", "pass"]) for _ in range(args.repeats))
    rows = [time_command(command, args.repeats) for command in COMMANDS]
    if args.json:
        print(json.dumps({"interpreter_start_s": interpreter_s, "rows": rows}, indent=2))
        return 0
    print(f"python start alone: {interpreter_s * 1e3:.0f} ms; median of {args.repeats} fresh processes a command:")
    for row in rows:
        print(f"  {row['command']:<28} {row['median_s'] * 1e3:6.0f} ms (fastest {row['fastest_s'] * 1e3:.0f} ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
