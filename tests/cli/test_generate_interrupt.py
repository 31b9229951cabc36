"""Ctrl-C in `layerstream generate`, as a terminal sends it (SIGINT to the process group), at several moments,
with a file already at the output path: afterwards that file is untouched or a complete new output is there,
stderr carries exactly one line saying where it stopped, the exit code is 130 and no temporary file is left.

The moments are found by watching what the run does (its model cache, its progress lines, its files), never
by timing; the one hook is `LAYERSTREAM_TEST_WRITE_PAUSE_SECONDS`, which holds a written temporary file
before its rename so that an interrupt while writing is certain to land there.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import imageio.v3 as iio
import pytest

from layerstream.atomic_write import PARTIAL_MARK, PAUSE_ENV_VAR
from layerstream.cli.interrupt import EXIT_PAUSE_ENV_VAR

OLD_BYTES = b"the output of an earlier run"
NUM_FRAMES = 9  # tiny-wan's default
HANG_GUARD_SECONDS = 300  # only so that a broken run fails instead of hanging the suite


class Run:
    """`layerstream generate` in a session of its own, its stderr read as it comes."""

    def __init__(self, *args: str, env: dict[str, str]):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "layerstream", "generate", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
        )  # fmt: skip
        self.stderr: list[str] = []
        self._reader = threading.Thread(target=lambda: self.stderr.extend(self.process.stderr), daemon=True)
        self._reader.start()

    def interrupt_when(self, condition: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + HANG_GUARD_SECONDS
        while not condition():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()
                pytest.fail(f"the run ended (exit {self.process.poll()}) before {what}: {''.join(self.stderr)}")
            time.sleep(0.01)
        os.killpg(self.process.pid, signal.SIGINT)  # what Ctrl-C in a terminal does

    def finish(self) -> tuple[int, list[str]]:
        """(exit code, stderr lines other than the progress lines)."""
        code = self.process.wait(timeout=HANG_GUARD_SECONDS)
        self._reader.join(timeout=HANG_GUARD_SECONDS)
        self.process.stdout.close()
        return code, [line.rstrip("\n") for line in self.stderr if not line.startswith("step ")]


@pytest.fixture(autouse=True)
def runs_take_sigint():
    """A suite started where SIGINT is ignored (a shell's background job, nohup) passes the ignoring on to every
    process it starts, and a run that ignores Ctrl-C cannot be tested: here the suite's own process handles it
    while these tests run, so the runs start with Python's handling (exec resets a handled signal, not an
    ignored one). The runs are sessions of their own, so the SIGINT sent to them never reaches this process."""
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.fixture
def workspace(tmp_path) -> Path:
    folder = tmp_path / "out"
    folder.mkdir()
    return folder


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, **extra}


def _old_output(folder: Path, name: str) -> Path:
    path = folder / name
    path.write_bytes(OLD_BYTES)
    return path


def _assert_only(folder: Path, path: Path) -> None:
    """The output path alone in its folder: no temporary file, no write probe."""
    assert sorted(p.name for p in folder.iterdir()) == [path.name]


def test_interrupted_while_loading(workspace, tmp_path):
    """A fresh model cache: the run is loading (building tiny-wan) once the cache's models folder appears."""
    output = _old_output(workspace, "fox.mp4")
    cache = tmp_path / "cache"
    run = Run("--steps", "2", "--output", str(output), env=_env(LAYERSTREAM_CACHE=str(cache)))
    run.interrupt_when(lambda: (cache / "models").is_dir(), "it began loading")
    code, lines = run.finish()
    assert code == 130
    assert lines == ["layerstream: interrupted during loading the model; nothing was written"]
    assert output.read_bytes() == OLD_BYTES
    _assert_only(workspace, output)
    assert list((cache / "models").iterdir()) == []  # the half-built tiny model is gone as well


def test_interrupted_during_the_steps(workspace):
    output = _old_output(workspace, "fox.mp4")
    run = Run("--steps", "200", "--output", str(output), env=_env())
    run.interrupt_when(lambda: any(line.startswith("step 1/200") for line in run.stderr), "its first step")
    code, lines = run.finish()
    assert code == 130
    assert lines == ["layerstream: interrupted during generation; nothing was written"]
    assert output.read_bytes() == OLD_BYTES
    _assert_only(workspace, output)


@pytest.mark.parametrize("name", ["fox.mp4", "fox.gif"])
def test_interrupted_while_writing_the_output(workspace, name):
    """Interrupted as soon as the temporary file exists: mid-encode or in the pause before the rename."""
    output = _old_output(workspace, name)
    run = Run("--steps", "1", "--output", str(output), env=_env(**{PAUSE_ENV_VAR: str(HANG_GUARD_SECONDS)}))
    # the partial mark, not any dot file: the output-path check's probe file is one too, before loading
    run.interrupt_when(lambda: any(PARTIAL_MARK in p.name for p in workspace.iterdir()), "it began writing")
    code, lines = run.finish()
    assert code == 130
    assert lines == ["layerstream: interrupted during writing the output; nothing was written"]
    assert output.read_bytes() == OLD_BYTES
    _assert_only(workspace, output)


def test_interrupted_after_the_output_is_in_place_says_it_was_written(workspace):
    """With --compare-resident the run goes on after the output is renamed into place; an interrupt then must
    not claim that nothing was written (it may land in the rename's last moments, or in the resident run)."""
    output = _old_output(workspace, "fox.mp4")
    old_inode = output.stat().st_ino
    run = Run("--steps", "200", "--compare-resident", "--output", str(output), env=_env())
    run.interrupt_when(lambda: output.stat().st_ino != old_inode, "the output was renamed into place")
    code, lines = run.finish()
    assert code == 130
    assert lines in (
        [f"layerstream: interrupted during the run on the resident model; {output} was written"],
        [f"layerstream: interrupted during writing the output; {output} was written"],
    )
    assert iio.imread(output, index=None).shape[0] == NUM_FRAMES  # the new output, whole
    _assert_only(workspace, output)


def test_interrupted_after_the_summary_prints_one_line_and_exits_130(workspace):
    """Once the command has finished (its summary printed) an interrupt still ends the process with one line and
    130: never a traceback from an exit hook, never the signal's own ending. The process is held after its
    command by `EXIT_PAUSE_ENV_VAR`, so that the interrupt surely lands there."""
    output = workspace / "fox.gif"
    run = Run("--steps", "1", "--json", "--output", str(output), env=_env(**{EXIT_PAUSE_ENV_VAR: str(HANG_GUARD_SECONDS)}))
    summary: list[str] = []
    reader = threading.Thread(target=lambda: summary.extend(run.process.stdout), daemon=True)
    reader.start()
    run.interrupt_when(lambda: summary and summary[-1].startswith("}"), "its summary was printed")
    code, lines = run.finish()
    assert code == 130
    assert lines == ["layerstream: interrupted while exiting, after the command had finished"]
    assert iio.imread(output, index=None).shape[0] == NUM_FRAMES
