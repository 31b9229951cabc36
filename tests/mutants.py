"""A mutation check of the central guarantees: each named one-line mutant is applied to a copy of `src/`, the tests
that should catch it run against that copy, and the mutant is reported killed (they failed, or hung past the
limit), survived (they passed) or skipped (they skipped, where the mutant's control says what that means).

    python tests/mutants.py              # every mutant; exit 1 if one survives
    python tests/mutants.py --list       # the mutants, their files and test selections
    python tests/mutants.py atomic-rename disk-offset   # only these

Why not mutmut 3 or cosmic-ray 8: both generate mutants from their own operator set (mutmut trampolines every
function it finds and runs the tests it maps to each; cosmic-ray walks a parse tree with operator classes and
runs one test command for the whole session). Neither takes a given list of named, hand-written mutants, each
with its own test selection; with cosmic-ray that means one operator class per mutant, registered as a plugin of
an installed package. The runner below is the smaller thing: text replacement in a temporary copy.

The user's files are never touched: every mutant gets a fresh copy of `src/layerstream` in a temporary folder,
imported first through PYTHONPATH (a process the tests start inherits it), so a Ctrl-C or a crash leaves the tree
as it was, and the check can run beside other work. An original snippet that is not found exactly once in its
file stops the run before anything is tried (`check_mutants`, also held by tests/test_mutants.py), so the list
cannot rot silently; an unmutated baseline of every selection runs first, so that a selection failing for another
reason is not counted as a kill.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "layerstream"
TIMEOUT_SECONDS = 300
"""A selection still running after this long counts as a kill (the mutant made the tests hang); the slowest
selection takes about 40 s on 2 cores unmutated."""


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    """Relative to src/layerstream."""
    original: str
    """A snippet found exactly once in the file (a whole line, or the part of one that changes)."""
    replacement: str
    tests: tuple[str, ...]
    """pytest node ids or files, run from the repository root."""
    reason: str
    """The guarantee the mutant breaks, in one line."""
    skip_means: str | None = None
    """Where the selected tests may skip rather than pass (a control that shows the mutant cannot be seen on this
    machine): what that says. Without it, a selection that only skipped counts as survived."""


MUTANTS = (
    Mutant(
        "prefetch-wait",
        "runtime/streaming/streamer.py",
        "stall = self.engine.wait_ready(slot)",
        "stall = 0.0",
        (
            "tests/runtime/test_accelerator_protocol.py::test_accelerator_engine_orders_copies_and_compute_with_events",
            "tests/runtime/test_streaming.py::test_slow_link_raises_stall_counter",
        ),
        "a block computes before its slot's copy has landed",
    ),
    Mutant(
        "slot-release",
        "runtime/streaming/streamer.py",
        "        self.engine.release(record.slot)\n",
        "        pass\n",
        ("tests/runtime/test_accelerator_protocol.py::test_accelerator_engine_orders_copies_and_compute_with_events",),
        "compute never releases a slot after a block, so its next copy never lands",
    ),
    Mutant(
        "copy-waits-for-release",
        "runtime/engines/copy_engine.py",
        "self._released[slot].wait()  # never overwrite a slot compute may still read",
        "pass",
        ("tests/runtime/test_copy_engine_contract.py::test_cpu_copy_into_a_held_slot_runs_only_after_release",),
        "the CPU copy thread overwrites a slot that compute still reads",
    ),
    Mutant(
        "stale-copy-forgotten",
        "runtime/streaming/streamer.py",
        "if block.slot is not None and block.copied_version != block.host.host_version:",
        "if False:",
        ("tests/runtime/test_write_while_prefetching.py::test_a_write_after_the_prefetch_landed_reaches_the_next_forward_and_costs_one_copy",),
        "a block whose stored bytes were written after its copy landed runs on the old copy",
    ),
    Mutant(
        "thread-adoption",
        "pipeline_runner.py",
        "torch.set_num_threads(torch.get_num_threads())",
        "pass",
        ("tests/omni/test_same_bits_on_any_thread.py::test_a_new_thread_that_adopts_the_process_threads_computes_the_main_threads_bits",),
        "a new thread (the server's worker) computes with MKL's default thread count, not the process's",
        skip_means="control shows no per-thread difference on this CPU",
    ),
    Mutant(
        "job-ending-guard",
        "server/jobs/manager.py",
        "            self._fail_unstored(live, e)\n",
        "            pass\n",
        ("tests/server/test_job_manager_edges.py::test_a_job_whose_outcome_cannot_be_stored_still_ends_failed",),
        "a job whose output or row cannot be stored never ends (stays in progress forever)",
    ),
    Mutant(
        "work-cap-product",
        "models/work.py",
        "return self.num_inference_steps * self.passes * self.n",
        "return self.num_inference_steps * self.passes",
        ("tests/models/test_work.py::test_the_forwards_of_an_admitted_request_never_exceed_its_price",),
        "the price ignores n in the forwards: n outputs' forwards priced as one output's",
    ),
    Mutant(
        "lossless-escape-count",
        "runtime/packing/lossless_code.py",
        "out, escapes = [], [escaped.numel()]",
        "out, escapes = [], [0]",
        (
            "tests/runtime/test_lossless_code.py::test_distinct_values_take_the_later_tiers_and_a_single_value_takes_none",
            "tests/runtime/test_lossless_code.py::test_random_tensors_round_trip",
        ),
        "the header says no element escapes tier 0, so the decoder never looks for the escaped values",
    ),
    Mutant(
        "decode-scratch-term",
        "models/decode/meta_peak.py",
        "self.peak_nbytes = max(self.peak_nbytes, self.live_nbytes + scratch)",
        "self.peak_nbytes = max(self.peak_nbytes, self.live_nbytes)",
        ("tests/models/test_conv_scratch.py",),
        "the VAE decode's planned peak leaves out the convolutions' scratch, so a decode planned to fit may not",
    ),
    Mutant(
        "planner-resident-count",
        "plan/placement.py",
        "picked = tuple(chain[i] for i in spread_indices(len(chain), counts[comp.path]))",
        "picked = tuple(chain[i] for i in spread_indices(len(chain), min(len(chain), counts[comp.path] + 1)))",
        (
            "tests/runtime/test_residency.py::test_auto_with_tiny_budget_streams_everything_and_large_budget_keeps_all",
            "tests/plan/test_placement.py::test_auto_with_a_budget_too_small_keeps_nothing_and_says_the_minimal_budget",
            "tests/plan/test_placement.py::test_auto_minimal_budget_in_the_reason_is_enough_when_given_back",
        ),
        'residency "auto" keeps one block more than its device budget holds',
    ),
    Mutant(
        "disk-offset",
        "runtime/stores/disk/disk_store.py",
        "FileRange(source.path, source.offset + lo - dst, hi - lo)",
        "FileRange(source.path, lo - dst, hi - lo)",
        ("tests/runtime/test_disk_tier.py::test_tiny_wan_with_half_its_blocks_on_disk_generates_bit_identically",),
        "a checkpoint-backed disk block is read from the file's start, not from its tensors' offset",
    ),
    Mutant(
        "atomic-rename",
        "atomic_write.py",
        "        os.replace(partial, target)\n",
        "        pass\n",
        ("tests/test_atomic_write.py",),
        "a complete output is never renamed onto its target",
    ),
)


class MutantListError(Exception):
    """The mutant list does not match the code or the tests any more (a snippet moved, a test renamed)."""


def check_mutants(mutants=MUTANTS, package: Path = PACKAGE, root: Path = ROOT) -> None:
    """Raise `MutantListError` naming every mutant whose original is not found exactly once in its file, whose
    replacement is the original, or whose selected test file or function is gone."""
    problems = []
    names = [m.name for m in mutants]
    problems += [f"mutant name {n!r} is used twice" for n in sorted({n for n in names if names.count(n) > 1})]
    for m in mutants:
        path = package / m.file
        if not path.is_file():
            problems.append(f"{m.name}: {path.relative_to(root)} does not exist")
            continue
        found = path.read_text().count(m.original)
        if found != 1:
            problems.append(f"{m.name}: the original {m.original!r} is found {found} times in {m.file}, not once")
        if m.replacement == m.original:
            problems.append(f"{m.name}: the replacement is the original")
        for selection in m.tests:
            file, _, function = selection.partition("::")
            test_file = root / file
            if not test_file.is_file():
                problems.append(f"{m.name}: the selected test file {file} does not exist")
            elif function and f"def {function.split('[')[0]}(" not in test_file.read_text():
                problems.append(f"{m.name}: the selected test {selection} does not exist")
    if problems:
        raise MutantListError("the mutant list does not match the code:\n  " + "\n  ".join(problems))


@dataclass
class Outcome:
    verdict: str
    """"killed", "survived", "skipped" or "broken" (pytest could not run the selection: nothing collected, a usage
    error, an internal error)."""
    detail: str
    seconds: float


def _copy_package(into: Path, mutant: Mutant | None) -> Path:
    """A copy of src/layerstream under `into`/src with `mutant` applied; the folder to put on PYTHONPATH."""
    src = into / "src"
    shutil.copytree(PACKAGE, src / "layerstream", ignore=shutil.ignore_patterns("__pycache__"))
    if mutant is not None:
        path = src / "layerstream" / mutant.file
        text = path.read_text()
        path.write_text(text.replace(mutant.original, mutant.replacement, 1))
    return src


def _run_pytest(src: Path, tests: tuple[str, ...], report: Path, timeout: float) -> tuple[int | None, str]:
    """(pytest's exit code or None if it ran past `timeout`, its output's tail). A new session: a timeout or a
    Ctrl-C ends pytest and every process it started."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), *filter(None, [os.environ.get("PYTHONPATH")])])}
    command = [
        sys.executable, "-m", "pytest", *tests, "-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
        "-o", "addopts=", "-rs", f"--junitxml={report}",
    ]  # fmt: skip
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
        return process.returncode, output
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        return None, output
    except BaseException:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        raise


def _counts(report: Path) -> dict[str, int | list[str]]:
    """passed, failed (errors included) and skipped tests of a junitxml report, with the skip messages."""
    tree = ET.parse(report)
    cases = list(tree.iter("testcase"))
    skips = [s.get("message", "") for c in cases for s in c.findall("skipped")]
    failed = [f"{c.get('classname', '')}.{c.get('name')}" for c in cases if c.find("failure") is not None or c.find("error") is not None]
    passed = len(cases) - len(failed) - len(skips)
    return {"passed": passed, "failed": len(failed), "skipped": len(skips), "skips": skips, "failed_tests": failed}


def _check_imports_the_copy() -> None:
    """The copy on PYTHONPATH is the package the tests import (before an installed or editable one)."""
    with tempfile.TemporaryDirectory(prefix="layerstream-mutant-") as folder:
        src = _copy_package(Path(folder), None)
        find = "import importlib.util; print(importlib.util.find_spec('layerstream').origin)"
        env = {**os.environ, "PYTHONPATH": str(src)}
        origin = subprocess.run([sys.executable, "-c", find], env=env, capture_output=True, text=True, check=True).stdout.strip()
        if not Path(origin).is_relative_to(src):
            raise MutantListError(f"with the copy on PYTHONPATH, layerstream is still imported from {origin}")


def run_selection(mutant: Mutant | None, tests: tuple[str, ...], timeout: float) -> Outcome:
    """Run `tests` against a copy of the package with `mutant` applied (None: unmutated) and judge the outcome."""
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="layerstream-mutant-") as folder:
        src = _copy_package(Path(folder), mutant)
        report = Path(folder) / "report.xml"
        code, output = _run_pytest(src, tests, report, timeout)
        seconds = time.monotonic() - start
        tail = "\n".join(output.strip().splitlines()[-15:])
        if code is None:
            return Outcome("killed", f"the tests hung (stopped after {timeout:.0f} s)", seconds)
        if code in (2, 3, 4, 5) or not report.exists():  # interrupted, internal error, usage error, nothing collected
            return Outcome("broken", f"pytest exit {code}:\n{tail}", seconds)
        counts = _counts(report)
    if counts["failed"]:
        return Outcome("killed", f"by {counts['failed_tests'][0]}", seconds)
    if counts["passed"] == 0 and counts["skipped"]:
        why = "; ".join(sorted(set(counts["skips"])))
        if mutant is not None and mutant.skip_means:
            return Outcome("skipped", f"{mutant.skip_means} (pytest: {why})", seconds)
        return Outcome("survived", f"every selected test skipped ({why})", seconds)
    return Outcome("survived", f"{counts['passed']} passed, {counts['skipped']} skipped", seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="run only these mutants (default: all)")
    parser.add_argument("--list", action="store_true", help="print the mutants and exit")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of each selection")
    parser.add_argument("--timeout", type=float, default=TIMEOUT_SECONDS, help="seconds before a selection counts as hung")
    args = parser.parse_args(argv)
    check_mutants()
    by_name = {m.name: m for m in MUTANTS}
    unknown = [n for n in args.names if n not in by_name]
    if unknown:
        parser.error(f"unknown mutant(s) {', '.join(unknown)}; known: {', '.join(by_name)}")
    chosen = [by_name[n] for n in args.names] if args.names else list(MUTANTS)
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.file}: {m.original.strip()!r} -> {m.replacement.strip()!r}\n  {m.reason}\n  tests: {' '.join(m.tests)}")
        return 0
    start = time.monotonic()
    _check_imports_the_copy()
    if not args.no_baseline:
        selections = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
        baseline = run_selection(None, selections, args.timeout)
        print(f"baseline (unmutated, {len(selections)} selections): {baseline.detail.splitlines()[0]} in {baseline.seconds:.0f} s", flush=True)
        if baseline.verdict != "survived":  # "survived" unmutated: every selected test passed (or skipped)
            print(f"the selections do not pass unmutated: {baseline.detail}")
            return 2
    results = {}
    for m in chosen:
        outcome = results[m.name] = run_selection(m, m.tests, args.timeout)
        print(f"{m.name:24} {outcome.verdict:9} {outcome.seconds:5.0f} s  {outcome.detail.splitlines()[0]}", flush=True)
        if outcome.verdict == "broken":
            print(outcome.detail)
    total = time.monotonic() - start
    tally = {v: sum(o.verdict == v for o in results.values()) for v in ("killed", "survived", "skipped", "broken")}
    print(f"{tally['killed']} killed, {tally['survived']} survived, {tally['skipped']} skipped, {tally['broken']} broken "
          f"of {len(results)} mutants in {total:.0f} s")  # fmt: skip
    return 1 if tally["survived"] or tally["broken"] else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the tests' processes are stopped and the copy removed; the tree was never touched
        print("interrupted: nothing was changed", file=sys.stderr)
        sys.exit(130)
