"""Fixtures shared by the whole test suite: one tiny-model cache for every worker, the command line run in
this process, and the guard that keeps `fast` tests free of processes and sockets."""

from __future__ import annotations

import logging
import multiprocessing.process
import os
import socket
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import diffusers.utils  # noqa: F401
import pytest
import transformers.utils  # noqa: F401

# diffusers and transformers imported here, under the session's capture: they bind their log handler to the
# sys.stderr of their first import, and a test's captured stream is closed after it (a later warning then printed
# "--- Logging error ---" into another test's stderr); and torchao_deferred hides torchao from a process where they
# have not looked for it yet, an answer they keep: looked for now, a command run in process changes nothing later

FAST = "fast"
"""The marker of `make test-fast`: unit and contract tests that start no process, open no socket and run no browser."""


@pytest.fixture(scope="session", autouse=True)
def layerstream_cache(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Path]:
    """Point ``$LAYERSTREAM_CACHE`` at one temporary folder for the whole run, every xdist worker included.

    Autouse so that no test ever writes to the user's real cache; shared so that each embedded tiny model is
    built once per run, however many tests (and servers they start) load it. Under xdist the folder sits
    beside the workers' own temporary folders, and the first worker to need it builds the tiny models there
    under a file lock while the others wait (`publish_folder` would make racing builds safe, but each would
    cost a build). Tests of the cache itself override it with ``monkeypatch.setenv`` and a ``tmp_path``.
    """
    worker = _xdist_worker(request.config)
    if worker is None:  # no xdist: this process's own folder
        cache = tmp_path_factory.mktemp("layerstream-cache")
    else:
        cache = tmp_path_factory.getbasetemp().parent / "layerstream-cache"
        cache.mkdir(exist_ok=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LAYERSTREAM_CACHE", str(cache))
        # Nothing in the suite may reach the Hugging Face Hub.
        patch.setenv("HF_HUB_OFFLINE", "1")
        if worker is not None:
            _build_tiny_models_once(cache)
        yield cache


def _build_tiny_models_once(cache: Path) -> None:
    from filelock import FileLock

    from layerstream.models.tiny import TINY_MODELS, ensure_tiny_model

    with FileLock(str(cache / "tiny-models.lock")):
        for name in TINY_MODELS:
            ensure_tiny_model(name)


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> Iterator[None]:
    """Under ``--dist loadgroup``, a test of no `xdist_group` joins its module's: a module's tests run on one
    worker, so that a module-scoped server (or browser, or rank group) starts once, not on each worker.

    After xdist's own hook every grouped test is named ``NODEID@GROUP`` (its worker is chosen by that name):
    one without the suffix means the groups would run side by side, which is refused."""
    grouping = getattr(config.option, "loadgroup", False)  # set on a worker of --dist loadgroup (its dist reads "no")
    if grouping:
        for item in items:
            if item.get_closest_marker("xdist_group") is None:
                item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    yield
    lost = [item.nodeid for item in items if grouping and "@" not in item.nodeid]
    if lost:
        raise pytest.UsageError(
            f"--dist loadgroup did not group {lost[0]} (pytest {pytest.__version__}): "
            "pin a pytest that pytest-xdist can rename items in (pyproject's test extra says which)"
        )


@pytest.fixture(scope="session", autouse=True)
def _one_intra_op_thread_per_worker_and_its_children(request: pytest.FixtureRequest) -> None:
    """Under xdist, each worker's torch computes on one thread: two workers already fill the two cores, and more
    threads only make them wait on each other (a test of 100 racing tiny generations took 74 s instead of 29).

    The processes a test starts (servers, ranks, the command line) compute with as many threads: a reference the
    test computes here is then computed under the same threading as the child's output it checks (on the AMD
    EPYC, MKL rounds some products differently with two threads than with one; docs/testing.md)."""
    import torch

    if _xdist_worker(request.config) is not None:
        torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = str(torch.get_num_threads())


def _xdist_worker(config: pytest.Config) -> str | None:
    """xdist's name for this worker (``gw0``, ...), or None in a run without xdist."""
    workerinput = getattr(config, "workerinput", None)
    return workerinput["workerid"] if workerinput else None


# --- fast tests start no process and open no socket ---------------------------------------------------------------


class ForbiddenInFastTest(BaseException):
    """Raised where a `fast` test starts a process or opens a socket (a BaseException, so that no ``except
    Exception`` in the code under test hides it)."""


def _forbid(what: str, violations: list[str]) -> Callable[..., object]:
    def refuse(*args: object, **kwargs: object) -> object:
        violations.append(what)
        raise ForbiddenInFastTest(f"a test marked {FAST!r} {what}: mark it otherwise, or keep it in process")

    return refuse


@pytest.fixture(autouse=True)
def _fast_tests_stay_in_process(request: pytest.FixtureRequest) -> Iterator[None]:
    if request.node.get_closest_marker(FAST) is None:
        yield
        return
    violations: list[str] = []
    real_socket_init = socket.socket.__init__

    def new_socket(self: socket.socket, family: int = -1, type: int = -1, proto: int = -1, fileno: int | None = None) -> None:
        if fileno is None:  # a new socket, not one wrapped around a descriptor (socketpair's, an event loop's)
            _forbid("opened a socket", violations)()
        real_socket_init(self, family, type, proto, fileno)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(socket.socket, "__init__", new_socket)
        for name in ("connect", "connect_ex", "bind"):
            patch.setattr(socket.socket, name, _forbid(f"used a socket ({name})", violations))
        patch.setattr(subprocess.Popen, "_execute_child", _forbid("started a process (subprocess)", violations))
        patch.setattr(multiprocessing.process.BaseProcess, "start", _forbid("started a process (multiprocessing)", violations))
        for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system", "execv", "execve"):
            if hasattr(os, name):
                patch.setattr(os, name, _forbid(f"started a process (os.{name})", violations))
        yield
    call = request.node.stash.get(_CALL_REPORT, None)
    if violations and call is not None and call.passed:  # the code under test swallowed the exception
        pytest.fail(f"a test marked {FAST!r} {violations[0]}", pytrace=False)


_CALL_REPORT = pytest.StashKey[pytest.TestReport]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    report = yield
    if report.when == "call":
        item.stash[_CALL_REPORT] = report
    return report


# --- the command line, in this process ----------------------------------------------------------------------------


def _logger_levels() -> dict[logging.Logger, int]:
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    return {logger: logger.level for logger in loggers if isinstance(logger, logging.Logger)}


_CLI_DEFAULTED_ENV = ("HF_HUB_DISABLE_PROGRESS_BARS", "DIFFUSERS_VERBOSITY", "TRANSFORMERS_VERBOSITY")
"""What `configure_logging` sets with ``setdefault``: restored after each command run in process."""


@dataclass(frozen=True)
class CliResult:
    returncode: int
    stdout: str
    stderr: str

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.startswith("layerstream: error:")]


@pytest.fixture
def layerstream_cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Callable[..., CliResult]:
    """``layerstream ARGS`` run through `main` in this process: exit code, stdout and stderr, as a subprocess
    would give them, without starting an interpreter (and importing torch) per call. Each command keeps one
    subprocess test for what only a real process shows (no traceback on stderr, the exit status itself).

    ``cwd=`` runs it in another folder. The variables `main` sets with ``setdefault`` are restored after.
    """
    from layerstream.cli.main import main

    def run(*argv: str, cwd: Path | None = None) -> CliResult:
        capsys.readouterr()  # what the test printed before is not the command's
        saved_env = {name: os.environ.get(name) for name in _CLI_DEFAULTED_ENV}
        saved_levels = _logger_levels()
        root_handlers = list(logging.getLogger().handlers)
        with monkeypatch.context() as patch:
            if cwd is not None:
                patch.chdir(cwd)
            try:
                code = main(list(argv))
            except SystemExit as e:  # argparse's --help and usage errors
                code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
            finally:  # the command's logging set-up (levels, a root handler) is the process's: undone
                for name, value in saved_env.items():
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value
                for logger, level in _logger_levels().items():
                    logger.setLevel(saved_levels.get(logger, logging.NOTSET))
                logging.getLogger().handlers[:] = root_handlers
        out, err = capsys.readouterr()
        return CliResult(code, out, err)

    return run


@pytest.fixture(scope="session")
def real_width_wan_folder(layerstream_cache: Path) -> Path:
    """A Wan 2.2 pipeline folder whose two transformers have Wan 1.3B's width (12 heads of 128, FFN 8960) with 2
    blocks each, saved in bfloat16 in 60 MB shards (a block of ~92 MB spans two or three files); the text encoder
    and VAE are the tiny ones. Built once per run under the shared cache, every worker reading the same folder
    (published atomically: a racing build is discarded). A test that changes files works on a copy."""
    import dataclasses

    from tests.benchmark_modules import benchmark_module

    folders = benchmark_module("checkpoint_folders")
    spec = dataclasses.replace(folders.WAN_1_3B_WIDTH, num_blocks=2, max_shard_size="60MB")
    folder, _ = folders.cached_checkpoint_folder(spec, layerstream_cache / "real-width")
    return folder
