"""`benchmarks/cold_start.py` on the small folders: the output's shape and the facts that do not depend on
speed (the page cache was dropped, host bytes against the checkpoint's). No timing is asserted.

Every row runs in a process of its own that imports torch (and diffusers): the script's test keeps to the smoke
rows on the small Wan folder, written here first so that the script only measures; the other rows are
measured in this process.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")

from tests.benchmark_modules import benchmark_module  # noqa: E402

cold_start = benchmark_module("cold_start")
folders = benchmark_module("checkpoint_folders")
page_cache = benchmark_module("page_cache")
SMALL_WAN = folders.SMALL_WAN


@pytest.fixture(scope="module")
def cold_start_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cold-start")
    folders.cached_checkpoint_folder(SMALL_WAN, root)
    return root


def test_smoke_reports_every_row_from_cold_files(cold_start_dir, tmp_path, capsys):
    code = cold_start.main(["--smoke", "--device", "cpu", "--dir", str(cold_start_dir), "--out", str(tmp_path)])
    stdout = capsys.readouterr().out
    assert code == 0
    assert "| raw-readinto |" in stdout and "| layerstream |" in stdout
    assert "Page cache: dropped before every row" in stdout
    assert (tmp_path / "results.md").read_text() == stdout.removesuffix("\n")
    result = json.loads((tmp_path / "results.json").read_text())
    (model,) = result["models"]
    assert model["model"] == "wan" and model["checkpoint_bytes"] > 0
    rows = {row["row"]: row for row in result["rows"]}
    assert list(rows) == list(cold_start.SMOKE_ROWS)
    for row in rows.values():
        assert not row["error"], row
        assert row["seconds"] > 0 and row["gbps"] > 0 and row["fraction_of_raw"] > 0
        assert row["host_bytes"] > 0 and row["peak_rss_bytes"] > 0
    assert rows["raw-readinto"]["host_bytes"] == model["checkpoint_bytes"]
    assert rows["raw-readinto"]["warm_gbps"] > 0
    # layerstream's host store holds the streamed blocks, read from the files
    assert 0 < rows["layerstream"]["extra"]["host_bytes_from_files"] <= rows["layerstream"]["host_bytes"]
    assert result["drop_ok"] and result["max_cached_fraction_before"] == 0.0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "wan14b"], "unrecognized arguments: --model"),  # the folders have fixed shapes
        (["--read-mechanisms", "--rows", "raw-readinto"], "--read-mechanisms names the rows itself"),
        (["--models", "sd3"], "models = "),
    ],
)
def test_flags_that_do_not_apply_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        cold_start.main(argv)
    assert exited.value.code == 2 and message in capsys.readouterr().err


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
    with pytest.raises(cold_start.ColdStartConfigError, match=message):
        cold_start.ColdStartConfig(**settings)


@pytest.mark.parametrize("row", ["raw-preadv-2", "mmap-copy", "fastsafetensors", "diffusers-float32", "diffusers-group"])
def test_other_rows_measure_in_process(cold_start_dir, row):
    folder = cold_start_dir / SMALL_WAN.folder_name
    result = benchmark_module("cold_start_rows").measure_row(row, folder, torch.device("cpu"))
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
    for source in folders.checkpoint_files(cold_start_dir / SMALL_WAN.folder_name):
        files.append(tmp_path / f"{source.parent.name}.safetensors")
        files[-1].write_bytes(source.read_bytes())
    assert page_cache.cached_fraction(files) > 0.9
    assert page_cache.drop_page_cache(files)
    assert page_cache.cached_fraction(files) == 0.0
