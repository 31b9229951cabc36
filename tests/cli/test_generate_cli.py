"""`layerstream generate` as a user runs it: its exit code, its files and its messages.

The main job and the data-parallel ranks run as subprocesses, as does one error (what only a real process
shows: the exit status, nothing but one line on stderr, no traceback); the other commands run through `main`
in this process (`layerstream_cli`), which gives the same exit code, stdout and stderr without an interpreter
and a torch import per command."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import imageio.v3 as iio
import pytest


def generate(*args, cwd=None, timeout=300):
    env = dict(os.environ)
    return subprocess.run(
        [sys.executable, "-m", "layerstream", "generate", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=timeout,
    )


def test_default_model_writes_output_and_matches_resident(tmp_path):
    result = generate("--steps", "2", "--compare-resident", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["identical_to_resident"] is True
    assert summary["model"] == "tiny-wan"
    # what was made, with the model's defaults filled in: enough to make it again
    assert summary["prompt"] == "a red fox running through fresh snow, cinematic" and summary["seed"] == 0
    assert (summary["width"], summary["height"], summary["num_frames"]) == (64, 64, 9)
    output = summary["output"]
    assert os.path.dirname(output) == str(tmp_path) and output.endswith(".mp4")
    frames = iio.imread(output, index=None)
    assert frames.ndim == 4 and frames.shape[0] == 9
    assert summary["bytes_streamed"] > 0 and summary["num_transfers"] > 0
    # plain progress lines when stderr is not a terminal
    assert "step 1/2" in result.stderr and "step 2/2" in result.stderr


def test_table_summary_and_image_output(tmp_path, layerstream_cli):
    out = tmp_path / "flux.png"
    result = layerstream_cli("generate", "--model", "tiny-flux", "--steps", "2", "--output", str(out), "--diffusion-offload-config",
                      '{"mode": "layer", "components": ["dit", "text_encoder"]}', "--seed", "7", "--prompt", "a small cat",
                      "--width", "48", "--vae-use-tiling", "auto")
    assert result.returncode == 0, result.stderr
    assert iio.imread(out).shape == (64, 48, 3)
    for label in ("time per step", "device bytes", "host bytes", "bytes streamed", "stall time", str(out)):
        assert label in result.stdout
    # how the VAE decoded is always said (a tiled decode changes bits); the CPU has no device memory to read
    assert "untiled (vae_use_tiling auto, vae_use_slicing auto: no device memory to read)" in result.stdout
    rows = {line.split()[0]: " ".join(line.split()[1:]) for line in result.stdout.splitlines()[1:]}
    assert rows["prompt"] == "a small cat" and rows["seed"] == "7" and rows["size"] == "48x64 (width x height)"


def test_the_disk_tier_shows_what_it_read_and_stays_identical_to_resident(tmp_path, layerstream_cli):
    config = '{"mode": "layer", "components": ["dit"], "host_budget_gb": 0.0001, "disk_dir": "%s"}' % (tmp_path / "spill")
    result = layerstream_cli("generate", "--steps", "2", "--compare-resident", "--output", str(tmp_path / "wan.gif"),
                      "--diffusion-offload-config", config)  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = {line.split("  ")[1].strip(): line.split("  ", 2)[-1].strip() for line in result.stdout.splitlines()[1:]}
    assert rows["identical to resident"] == "yes"
    assert rows["read from disk"].endswith(" stalled on the disk") and not rows["read from disk"].startswith("0 B")


def test_gif_output_and_trace(tmp_path, layerstream_cli):
    out = tmp_path / "wan.gif"
    trace = tmp_path / "trace.json"
    result = layerstream_cli("generate", "--steps", "1", "--output", str(out), "--trace", str(trace))
    assert result.returncode == 0, result.stderr
    assert iio.imread(out, index=None).shape[0] == 9
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("ph") == "X" for e in events)
    assert (tmp_path / "trace.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--diffusion-offload-config", "{not json"], "--diffusion-offload-config"),
        (["--diffusion-offload-config", '{"mode": "layer", "components": ["unet"]}'], "components[0]"),
        (["--diffusion-offload-config", '{"mode": "layer", "components": ["dit"], "bogus": 1}'], "bogus"),
        (["--model", "/nonexistent/model/folder"], "/nonexistent/model/folder"),
        (["--model", "Wan-AI/Wan2.2-T2V-A14B-Diffusers"], "download"),
        (["--output", "out.txt"], "out.txt"),
        (["--steps", "0"], "--steps"),
        (["--link-gbps", "-1"], "--link-gbps"),
        (["--model", "tiny-flux", "--num-frames", "5"], "--num-frames"),
        (["--device", "nosuchdevice"], "--device"),
        (["--nproc", "0"], "--nproc"),
    ],
)
def test_error_paths_give_one_line_and_exit_code_2(tmp_path, layerstream_cli, args, needle):
    steps = [] if "--steps" in args else ["--steps", "1"]
    result = layerstream_cli("generate", *args, *steps, cwd=tmp_path)  # an unexpected exception fails the test
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.error_lines
    assert len(lines) == 1 and needle in lines[0], result.stderr


def test_model_folder_without_model_index(tmp_path, layerstream_cli):
    (tmp_path / "empty").mkdir()
    result = layerstream_cli("generate", "--model", str(tmp_path / "empty"))
    assert result.returncode == 2 and "model_index.json" in result.stderr


def test_an_error_in_a_real_process_is_one_line_exit_2_and_no_traceback(tmp_path):
    """The promise the in-process error tests above cannot see: the process's own exit status, and its stderr
    holding the one error line (no traceback, no warning from a library import)."""
    result = generate("--diffusion-offload-config", '{"mode": "layer", "components": ["dit"], "bogus": 1}', "--steps", "1", cwd=tmp_path)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stderr.splitlines() == [line for line in result.stderr.splitlines() if line.startswith("layerstream: error:")]
    assert len(result.stderr.splitlines()) == 1 and "bogus" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.xdist_group("serving_ranks")  # torchrun on a port chosen by free_port: with the serving rank groups
@pytest.mark.parametrize("model", ["tiny-wan"])
def test_data_parallel_ranks_share_weights_and_match_resident(tmp_path, model, monkeypatch, layerstream_cli):
    """Two ranks on a fresh model cache (rank 0 builds the tiny model once); the allgather transfers run on a
    group of their own, so gathering the summaries never interleaves with the copy thread's transfers. (An
    image model on ranks: `serve --nproc 2`'s tests, tests/server/test_multirank_server.py.)"""
    from layerstream.models.cache import CACHE_ENV_VAR

    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path / "cache"))
    result = generate("--model", model, "--nproc", "2", "--steps", "1", "--compare-resident", "--json", cwd=tmp_path, timeout=240)
    assert result.returncode == 0, result.stderr
    summaries = json.loads(result.stdout)  # only rank 0 prints, covering every rank
    assert [s["rank"] for s in summaries] == [0, 1]
    assert all(s["identical_to_resident"] is True for s in summaries)
    assert summaries[0]["config"]["layer_options"]["dit"]["weight_transfer"] == "allgather"
    assert len({s["output"] for s in summaries}) == 2 and all(os.path.exists(s["output"]) for s in summaries)
    single = json.loads(layerstream_cli("generate", "--model", model, "--steps", "1", "--json", cwd=tmp_path).stdout)
    # each rank keeps half of the streamed host bytes (plus per-block alignment padding)
    assert all(s["host_bytes"] <= single["host_bytes"] / 2 + 64 * 6 for s in summaries)


@pytest.mark.parametrize(
    "class_name, name, message",
    [
        ("WanPipeline", "fox.png", "makes a video; use a .mp4 or .gif file"),
        ("FluxPipeline", "cat.gif", "makes an image; use a .png file"),
    ],
)
def test_a_model_folders_kind_comes_from_its_model_index_before_loading(tmp_path, layerstream_cli, class_name, name, message):
    """The folder has no component subfolders, so loading it would fail with another error: the suffix error
    shows the kind was read from model_index.json before anything loaded."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model_index.json").write_text(json.dumps({"_class_name": class_name, "transformer": ["diffusers", "X"]}))
    result = layerstream_cli("generate", "--model", str(folder), "--output", str(tmp_path / name))
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"layerstream: error: --output {tmp_path / name}: {folder} {message}"]


def test_the_summary_shortens_a_long_prompt(tmp_path, layerstream_cli):
    prompt = "a small cat on a windowsill " * 300  # 8,400 characters: under the limit, far over a table row
    result = layerstream_cli("generate", "--model", "tiny-flux", "--steps", "1", "--prompt", prompt, "--output", str(tmp_path / "cat.png"))
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: " ".join(line.split()[1:]) for line in result.stdout.splitlines()[1:]}
    assert rows["prompt"] == " ".join(prompt[:80].split()) + "... (8,400 characters)"


@pytest.mark.fast
def test_time_per_step_leaves_out_the_first_steps_warm_up():
    from layerstream.pipeline_runner import RunStats

    def stats(*steps: float) -> RunStats:
        return RunStats(seconds=2.0, step_seconds=list(steps), bytes_transferred=0, num_transfers=0, num_sync_loads=0,
                        stall_seconds=0.0, device_bytes=0, host_bytes=0)  # fmt: skip

    assert stats(0.6, 0.008).seconds_per_step == 0.008  # the 2-step median was 0.304: half warm-up
    assert stats(0.6, 0.008, 0.01, 0.009).seconds_per_step == 0.009
    assert stats(0.6).seconds_per_step == 0.6 and stats().seconds_per_step == 2.0


def test_compare_resident_with_float8_storage_differs_by_design(tmp_path, layerstream_cli):
    config = '{"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"storage_dtype": "float8_e4m3fn"}}}'
    result = layerstream_cli("generate", "tiny-flux", "--steps", "2", "--compare-resident", "--output", str(tmp_path / "f.png"),
                             "--diffusion-offload-config", config)  # fmt: skip
    assert result.returncode == 0, result.stderr  # a difference asked for is not a failure
    row = next(line for line in result.stdout.splitlines() if "identical to resident" in line)
    # against the model in its own dtype (float32), not the pipeline disabling gives back (its weights rounded)
    max_abs = float(row.split("max abs ")[1].rstrip(")"))
    assert row.split("  ")[-1].startswith("float8_e4m3fn: differs by design (max abs ") and max_abs > 0
    assert "time per step" in result.stdout and "median after the first step (first step " in result.stdout
