"""The cold start, from checkpoint files to a pipeline ready to run, against the disk's ceiling.

Writes real-width checkpoint folders once (`checkpoint_folders.py` beside this script: Wan 2.2 at Wan 1.3B's
width, Flux at Flux.1's width, a few blocks each), then measures every row in a fresh process with the files
dropped from the page cache first (`cold_start_rows.py`, `page_cache.py`): reading the files raw (the ceiling),
diffusers' `from_pretrained` (in the saved dtypes and in float32), diffusers plus group offload, and
layerstream's load plus enable. Each row reports seconds, GB/s (checkpoint bytes / seconds) and that as a
fraction of the raw read's, the peak anonymous and file-backed RSS while loading, and the host bytes the
weights take after.

`--read-mechanisms` measures the ways the host store could read the files instead: layerstream's `FileReader`
with 1 to 8 threads, copying from safetensors' mapping (what it did before), fastsafetensors (if installed).

    python benchmarks/cold_start.py --repeats 3            # both models, every row (minutes; GB written once)
    python benchmarks/cold_start.py --smoke --device cpu   # the small Wan folder, raw read and layerstream
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# the modules beside this script, found also when a test loads it from its file
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
from checkpoint_folders import (  # noqa: E402
    FLUX_WIDTH,
    SMALL_FLUX,
    SMALL_WAN,
    WAN_1_3B_WIDTH,
    CheckpointSpec,
    cached_checkpoint_folder,
    checkpoint_files,
    default_cold_start_dir,
)
from cold_start_rows import is_known_row  # noqa: E402

from layerstream.cli.bench_cmd import print_results  # noqa: E402

MODELS = {"wan": WAN_1_3B_WIDTH, "flux": FLUX_WIDTH}
SMALL_MODELS = {"wan": SMALL_WAN, "flux": SMALL_FLUX}
DEFAULT_ROWS = (
    "raw-readinto", "raw-preadv-4", "diffusers", "diffusers-float32", "diffusers-group", "layerstream", "layerstream-float32",
)
READ_MECHANISM_ROWS = (
    "raw-readinto", "raw-preadv-1", "raw-preadv-2", "raw-preadv-4", "raw-preadv-8", "mmap-copy", "fastsafetensors",
)  # fmt: skip
SMOKE_ROWS = ("raw-readinto", "layerstream")
"""--smoke: the small Wan folder only, the ceiling and layerstream (every row is a process importing torch, and
diffusers for a pipeline: seconds each on a small machine)."""
ROW_TIMEOUT_S = 900.0


class ColdStartConfigError(ValueError):
    """A cold-start setting that cannot run; the message names the setting, the value and what is allowed."""


@dataclass(frozen=True, kw_only=True)
class ColdStartConfig:
    """One cold-start run, validated when built."""

    models: tuple[str, ...] = ("wan", "flux")
    """Keys of `MODELS` (or of `SMALL_MODELS` with `small`)."""
    small: bool = False
    """The small-width folders (a few MB): for tests and a quick look, not for figures."""
    rows: tuple[str, ...] = DEFAULT_ROWS
    device: str = "cpu"
    cache_dir: Path | None = None
    """Where the folders are written once (default: `<layerstream cache>/bench/cold-start`)."""
    repeats: int = 1
    """Runs of every row, round robin; a row's seconds are the median, its peaks the highest."""

    def __post_init__(self):
        known = SMALL_MODELS if self.small else MODELS
        if not self.models or any(m not in known for m in self.models):
            raise ColdStartConfigError(f"models = {','.join(self.models)!r}; allowed: {', '.join(known)}")
        bad = [r for r in self.rows if not is_known_row(r)]
        if not self.rows or bad:
            raise ColdStartConfigError(
                f"rows = {','.join(self.rows)!r}; allowed: {', '.join(dict.fromkeys(DEFAULT_ROWS + READ_MECHANISM_ROWS))}"
                " (raw-preadv-N for any N from 1 to 64)"
            )
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ColdStartConfigError(f"device = {self.device!r}; allowed: cpu, cuda, cuda:N")
        if self.repeats < 1:
            raise ColdStartConfigError(f"repeats = {self.repeats}; expected an integer >= 1")

    @property
    def specs(self) -> dict[str, CheckpointSpec]:
        known = SMALL_MODELS if self.small else MODELS
        return {name: known[name] for name in self.models}


@dataclass(frozen=True, kw_only=True)
class ColdStartRow:
    model: str
    row: str
    seconds: float | None = None
    gbps: float | None = None
    """Checkpoint bytes (every safetensors file of the folder) / seconds."""
    fraction_of_raw: float | None = None
    """GB/s over the best raw row's GB/s for the same folder in this run."""
    peak_anon_bytes: int | None = None
    peak_file_bytes: int | None = None
    peak_rss_bytes: int | None = None
    host_bytes: int | None = None
    cached_fraction_before: float | None = None
    """Highest fraction of the checkpoint found in the page cache when a timer started (0.0: cold)."""
    warm_gbps: float | None = None
    """raw-readinto only: the same read again, files cached."""
    seconds_all: tuple[float, ...] = ()
    note: str = ""
    skipped: str = ""
    error: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class ColdStartModel:
    model: str
    folder: str
    checkpoint_bytes: int
    num_files: int
    spec: dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class ColdStartResult:
    device: str
    repeats: int
    models: tuple[ColdStartModel, ...]
    rows: tuple[ColdStartRow, ...]
    drop_ok: bool
    """posix_fadvise(DONTNEED) ran before every row."""
    max_cached_fraction_before: float | None
    load_average: tuple[float, float, float] | None
    """The machine's 1, 5 and 15 minute load averages when the run ended (other work competes for the cores)."""

    def to_dict(self) -> dict[str, Any]:
        return {"schema": "layerstream.bench.cold_start/1", **asdict(self)}

    @property
    def failed(self) -> list[ColdStartRow]:
        return [row for row in self.rows if row.error]


def run_cold_start(config: ColdStartConfig, *, log: Callable[[str], None] = lambda line: None) -> ColdStartResult:
    """Write the folders if needed, then measure every row of every model in its own process."""
    root = config.cache_dir if config.cache_dir is not None else default_cold_start_dir()
    models, rows = [], []
    for name, spec in config.specs.items():
        log(f"{name}: checkpoint folder {root / spec.folder_name}")
        folder, built = cached_checkpoint_folder(spec, root)
        if built:
            log(f"{name}: written")
        files = checkpoint_files(folder)
        checkpoint_bytes = sum(p.stat().st_size for p in files)
        models.append(ColdStartModel(model=name, folder=str(folder), checkpoint_bytes=checkpoint_bytes,
                                     num_files=len(files), spec=asdict(spec)))  # fmt: skip
        runs: dict[str, list[dict[str, Any]]] = {row: [] for row in config.rows}
        for repeat in range(config.repeats):
            for row in config.rows:
                log(f"{name}: {row} ({repeat + 1}/{config.repeats})")
                runs[row].append(_run_row_process(row, folder, config.device))
        rows.extend(_summarize(name, checkpoint_bytes, runs))
    measured = [r for r in rows if r.seconds is not None]
    fractions = [r.cached_fraction_before for r in measured if r.cached_fraction_before is not None]
    return ColdStartResult(
        device=config.device, repeats=config.repeats, models=tuple(models), rows=tuple(rows),
        drop_ok=bool(measured) and all(r.extra.get("drop_ok", False) for r in measured),
        max_cached_fraction_before=max(fractions) if fractions else None,
        load_average=tuple(round(x, 2) for x in os.getloadavg()) if hasattr(os, "getloadavg") else None,
    )  # fmt: skip


def _run_row_process(row: str, folder: Path, device: str) -> dict[str, Any]:
    request = json.dumps({"row": row, "folder": str(folder), "device": device})
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_DISABLE_PROGRESS_BARS="1", TOKENIZERS_PARALLELISM="false")
    try:
        done = subprocess.run(
            [sys.executable, str(HERE / "cold_start_rows.py"), request],
            capture_output=True, text=True, env=env, timeout=ROW_TIMEOUT_S,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {ROW_TIMEOUT_S:.0f} s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = [line for line in done.stderr.strip().splitlines() if line.strip()][-1:] or ["no output"]
        return {"error": f"exit code {done.returncode}: {tail[0]}"}
    return json.loads(lines[-1])


def _summarize(model: str, checkpoint_bytes: int, runs: dict[str, list[dict[str, Any]]]) -> list[ColdStartRow]:
    summaries = {}
    for row, results in runs.items():
        errors = [r["error"] for r in results if "error" in r]
        skipped = [r["skipped"] for r in results if "skipped" in r]
        ok = [r for r in results if "seconds" in r]
        if errors or not ok:
            summaries[row] = ColdStartRow(model=model, row=row, error=errors[0] if errors else "", skipped=skipped[0] if skipped else "")
            continue
        seconds = statistics.median(r["seconds"] for r in ok)
        warm = [r["warm_seconds"] for r in ok if r.get("warm_seconds")]
        cached = [r["cached_fraction_before"] for r in ok if r["cached_fraction_before"] is not None]
        summaries[row] = ColdStartRow(
            model=model, row=row, seconds=seconds, gbps=checkpoint_bytes / seconds / 1e9,
            peak_anon_bytes=max(r["peak_anon_bytes"] for r in ok), peak_file_bytes=max(r["peak_file_bytes"] for r in ok),
            peak_rss_bytes=max(r["peak_rss_bytes"] for r in ok), host_bytes=ok[0]["host_bytes"],
            cached_fraction_before=max(cached) if cached else None,
            warm_gbps=checkpoint_bytes / statistics.median(warm) / 1e9 if warm else None,
            seconds_all=tuple(r["seconds"] for r in ok), note=ok[0]["note"],
            extra={**ok[0]["extra"], "drop_ok": all(r["drop_ok"] for r in ok),
                   **({"load_seconds": statistics.median(r["load_seconds"] for r in ok)} if ok[0]["load_seconds"] is not None else {})},
        )  # fmt: skip
    raw = [s.gbps for s in summaries.values() if s.row.startswith("raw-") and s.gbps]
    ceiling = max(raw) if raw else None
    return [
        ColdStartRow(**{**asdict(s), "fraction_of_raw": s.gbps / ceiling}) if ceiling and s.gbps else s
        for s in summaries.values()
    ]


def format_cold_start_report(result: ColdStartResult) -> str:
    """Markdown: a table per model, then whether the page cache was dropped."""
    out = []
    for model in result.models:
        out.append(
            f"### cold start: {model.model} ({Path(model.folder).name}: {model.checkpoint_bytes / 1e9:.2f} GB in "
            f"{model.num_files} safetensors files), device {result.device}, median of {result.repeats}"
            f"{f', load average {result.load_average[0]:.1f}' if result.load_average else ''}\n"
        )
        out.append("| row | seconds | GB/s | x raw | peak anon | peak file | peak total | host bytes | note |")
        out.append("|---|---|---|---|---|---|---|---|---|")
        for row in (r for r in result.rows if r.model == model.model):
            if row.seconds is None:
                out.append(f"| {row.row} | - | - | - | - | - | - | - | {'skipped: ' + row.skipped if row.skipped else 'FAILED: ' + row.error} |")
                continue
            fraction = f"{row.fraction_of_raw:.2f}" if row.fraction_of_raw is not None else "-"
            out.append(
                f"| {row.row} | {row.seconds:.2f} | {row.gbps:.2f} | {fraction} | {_gb(row.peak_anon_bytes)} | "
                f"{_gb(row.peak_file_bytes)} | {_gb(row.peak_rss_bytes)} | {_gb(row.host_bytes)} | {row.note} |"
            )
        out.append("")
    out.append(_page_cache_line(result))
    out.append(
        "Peaks are above the process's own RSS after imports (anon: RssAnon, file: RssFile, sampled every 5 ms; "
        "total: VmHWM). GB/s is checkpoint bytes / seconds; x raw is that over the best raw row of the folder."
    )
    if result.device == "cpu":
        out.append(
            "On a CPU diffusers keeps same-dtype weights as lazy views of the files: its seconds include faulting "
            "every page in (the first forward would pay it); group offload onloads to the CPU itself (a baseline only)."
        )
    return "\n".join(out) + "\n"


def _page_cache_line(result: ColdStartResult) -> str:
    warm = [r for r in result.rows if r.warm_gbps]
    speeds = "; ".join(f"{r.model}: raw read cold {r.gbps:.2f} GB/s, warm {r.warm_gbps:.2f} GB/s" for r in warm)
    if not result.drop_ok:
        return f"Page cache: NOT dropped (posix_fadvise unavailable): figures may be warm. {speeds}\n"
    cached = result.max_cached_fraction_before
    seen = f"at most {cached:.1%} of the checkpoint was cached when a timer started (mincore)" if cached is not None else "mincore unavailable"
    verdict = "dropped" if cached is None or cached < 0.01 else "NOT fully dropped"
    return f"Page cache: {verdict} before every row (posix_fadvise DONTNEED per file): {seen}. {speeds}\n"


def _gb(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 1e9:.2f} GB"


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, ColdStartConfig]:
    """The command line and the `ColdStartConfig` it describes (--smoke fills what was not given)."""
    parser = argparse.ArgumentParser(prog="cold_start.py", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--models", default=None, help="comma list of wan, flux (default: both; --smoke: wan)")
    parser.add_argument("--rows", default=None, help=f"comma list of rows (default: {','.join(DEFAULT_ROWS)})")
    parser.add_argument(
        "--read-mechanisms", action="store_true",
        help="compare ways of reading the files instead (preadv on 1-8 threads, copy from the safetensors mapping, fastsafetensors)",
    )  # fmt: skip
    parser.add_argument("--repeats", type=int, default=1, help="runs of every row, round robin (default: 1)")
    parser.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available)")
    parser.add_argument("--dir", metavar="DIR", default=None, help="where the folders are written once (default: <layerstream cache>/bench/cold-start)")
    parser.add_argument("--smoke", action="store_true", help="the small Wan folder (a few MB), the raw read and layerstream")
    parser.add_argument("--json", action="store_true", help="print the results as JSON on stdout (and nothing else)")
    parser.add_argument("--out", metavar="DIR", default=None, help="also write results.json and results.md to DIR")
    args = parser.parse_args(argv)
    if args.read_mechanisms and args.rows is not None:
        parser.error("--read-mechanisms names the rows itself; give it or --rows, not both")
    if args.rows is not None:
        rows = tuple(r.strip() for r in args.rows.split(",") if r.strip())
    else:
        rows = READ_MECHANISM_ROWS if args.read_mechanisms else SMOKE_ROWS if args.smoke else DEFAULT_ROWS
    models = args.models or ("wan" if args.smoke else "wan,flux")
    try:
        config = ColdStartConfig(
            models=tuple(m.strip() for m in models.split(",") if m.strip()),
            small=args.smoke,
            rows=rows,
            device=args.device or _default_device(),
            cache_dir=Path(args.dir) if args.dir else None,
            repeats=args.repeats,
        )
    except ColdStartConfigError as e:
        parser.error(str(e))
    return args, config


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def main(argv: list[str] | None = None) -> int:
    args, config = parse_args(argv)
    result = run_cold_start(config, log=lambda line: print(f"cold start: {line}", file=sys.stderr, flush=True))
    print_results(args, json.dumps(result.to_dict(), indent=2), format_cold_start_report(result))
    for row in result.failed:
        print(f"cold start: {row.model} {row.row} failed: {row.error}", file=sys.stderr)
    return 1 if result.failed else 0


if __name__ == "__main__":
    sys.exit(main())
