"""`layerstream bench --cold-start` on the small folders: the output's shape and the facts that do not depend on
speed (the page cache was dropped, host bytes against the checkpoint's). No timing is asserted.

Every row runs in a process of its own that imports torch (and diffusers): the CLI test keeps to the smoke
rows on the small Wan folder, written here first so that the command only measures; the other rows are
measured in this process.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")

from layerstream.bench.checkpoint_folders import SMALL_WAN, cached_checkpoint_folder, checkpoint_files  # noqa: E402
from layerstream.bench.cold_start import SMOKE_ROWS, ColdStartConfig, ColdStartConfigError  # noqa: E402
from layerstream.bench.cold_start_rows import measure_row  # noqa: E402
from layerstream.bench.page_cache import cached_fraction, drop_page_cache  # noqa: E402


@pytest.fixture(scope="module")
def cold_start_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cold-start")
    cached_checkpoint_folder(SMALL_WAN, root)
    return root


def _bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "layerstream", "bench", *args], capture_output=True, text=True, timeout=timeout
    )


def test_smoke_reports_every_row_from_cold_files(cold_start_dir, tmp_path):
    done = _bench("--cold-start", "--smoke", "--device", "cpu", "--cold-start-dir", str(cold_start_dir),
                  "--out", str(tmp_path))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "| raw-readinto |" in done.stdout and "| layerstream |" in done.stdout
    assert "Page cache: dropped before every row" in done.stdout
    assert (tmp_path / "results.md").read_text() == done.stdout.removesuffix("\n")
    result = json.loads((tmp_path / "results.json").read_text())
    (model,) = result["models"]
    assert model["model"] == "wan" and model["checkpoint_bytes"] > 0
    rows = {row["row"]: row for row in result["rows"]}
    assert list(rows) == list(SMOKE_ROWS)
    for row in rows.values():
        assert not row["error"], row
        assert row["seconds"] > 0 and row["gbps"] > 0 and row["fraction_of_raw"] > 0
        assert row["host_bytes"] > 0 and row["peak_rss_bytes"] > 0
    assert rows["raw-readinto"]["host_bytes"] == model["checkpoint_bytes"]
    assert rows["raw-readinto"]["warm_gbps"] > 0
    # layerstream's host store holds the streamed blocks, read from the files
    assert 0 < rows["layerstream"]["extra"]["host_bytes_from_files"] <= rows["layerstream"]["host_bytes"]
    assert result["drop_ok"] and result["max_cached_fraction_before"] == 0.0


def test_flags_that_do_not_apply_are_refused(layerstream_cli):
    done = layerstream_cli("bench", "--cold-start", "--model", "wan14b")
    assert done.returncode == 2 and "--model does not apply with --cold-start" in done.stderr
    done = layerstream_cli("bench", "--read-mechanisms")
    assert done.returncode == 2 and "need --cold-start" in done.stderr


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"rows": ("raw-readinto", "warp-drive")}, "rows = "),
        ({"models": ("sd3",)}, "models = "),
        ({"device": "tpu"}, "device = "),
        ({"repeats": 0}, "repeats = "),
    ],
)
def test_bad_settings_are_refused_naming_them(settings, message):
    with pytest.raises(ColdStartConfigError, match=message):
        ColdStartConfig(**settings)


@pytest.mark.parametrize("row", ["raw-preadv-2", "mmap-copy", "fastsafetensors", "diffusers-float32", "diffusers-group"])
def test_other_rows_measure_in_process(cold_start_dir, row):
    folder = cold_start_dir / SMALL_WAN.folder_name
    result = measure_row(row, folder, torch.device("cpu"))
    gc.collect()  # what the row loaded maps the files: let it go before other tests drop the page cache
    if isinstance(result, str):  # a row whose library is missing says so
        assert row == "fastsafetensors" and "not installed" in result
        return
    assert result.seconds > 0 and result.drop_ok
    assert result.host_bytes > 0
    if row == "diffusers-float32":  # diffusers' default upcasts the bf16 checkpoint
        assert result.host_bytes > 1.5 * result.checkpoint_bytes
    if row == "diffusers-group":
        assert "baseline only" in result.note


def test_drop_page_cache_empties_the_cache_for_the_files(cold_start_dir, tmp_path):
    # fresh copies: their pages are dirty (just written) and nothing maps them
    files = []
    for source in checkpoint_files(cold_start_dir / SMALL_WAN.folder_name):
        files.append(tmp_path / f"{source.parent.name}.safetensors")
        files[-1].write_bytes(source.read_bytes())
    assert cached_fraction(files) > 0.9
    assert drop_page_cache(files)
    assert cached_fraction(files) == 0.0
