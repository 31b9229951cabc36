"""`layerstream plan` prices the lossless form at what the checkpoint holds: where the model's folder has its
weights, a sample of the DiT's coded bytes gives the fraction (`models.coded_fraction`), and for a Hub id not
downloaded, the same sample read by ranged requests from the stand-in Hub (`models.hub_sample`); the plan says
that it sampled. A skeleton with no readable weights, or a Hub whose ranges cannot be read, keeps the fixed
estimate, and says why."""

from __future__ import annotations

import json

import pytest
import torch

from hub_standin import select_standin_hub, serving_standin_hub
from layerstream.cli.main import main
from layerstream.models import coded_fraction, hub_sample
from layerstream.models.coded_fraction import SampleBudget, sample_coded_fraction
from layerstream.models.loading import load_pipeline
from layerstream.runtime.packing.lossless_code import ESTIMATED, ESTIMATED_CODED_FRACTION, estimated_code, pricing_at

REPO = "test-org/tiny-wan-bf16"
SMALL_SAMPLE = SampleBudget(64, 2, 256)
"""Runs shorter than tiny-wan's tensors: a sample of them, not all their bytes."""
LOSSLESS_DIT = json.dumps({"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"storage_dtype": "lossless"}}})


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory):
    """tiny-wan (two experts) saved in bfloat16, the first expert's weights spread as trained ones are (a scale per
    element), the second's as initialised."""
    folder = tmp_path_factory.mktemp("models") / "tiny-wan-bf16"
    pipe = load_pipeline("tiny-wan", dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in pipe.transformer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.03 * torch.exp(torch.randn(p.shape, generator=g)))
    pipe.save_pretrained(folder)
    return folder, pipe


def _coded_fraction_of(*modules) -> float:
    """The stored fraction of the modules' 16-bit tensors that the lossless form codes, coded for real."""
    from layerstream.runtime.packing.lossless_code import plan_code

    stored = total = 0
    for p in (p for m in modules for p in m.parameters()):
        if p.numel() >= coded_fraction.MIN_ELEMENTS:
            code = plan_code(p.detach().reshape(-1).view(torch.int16), "bfloat16")
            stored += code.nbytes if code is not None else 2 * p.numel()
            total += 2 * p.numel()
    return stored / total


def test_a_sample_of_the_weights_estimates_what_the_code_stores(bf16_folder):
    folder, pipe = bf16_folder
    sampled = sample_coded_fraction(folder, {"transformer"}, budget=SMALL_SAMPLE)
    assert sampled is not None and sampled.sampled and "sampled" in sampled.source and "transformer" in sampled.source
    assert sampled.value == pytest.approx(_coded_fraction_of(pipe.transformer), abs=0.02)
    assert sample_coded_fraction(folder, {"vae"}) is None  # float32 weights: nothing the code would hold
    assert sample_coded_fraction(folder / "missing", {"transformer"}) is None


def test_a_truncated_file_is_left_out_not_an_error(bf16_folder, tmp_path):
    folder, _ = bf16_folder
    component = tmp_path / "transformer"
    component.mkdir()
    data = next((folder / "transformer").glob("*.safetensors")).read_bytes()
    (component / "diffusion_pytorch_model.safetensors").write_bytes(data[: len(data) // 2])  # still downloading
    sampled = sample_coded_fraction(tmp_path, {"transformer"})
    assert sampled is None or 0.5 < sampled.value < 1.0  # the tensors whose bytes are all there, or none


def test_a_skeleton_is_priced_at_the_sampled_fraction_inside_pricing_at():
    assert estimated_code(1 << 20, "bfloat16").nbytes == pytest.approx(ESTIMATED_CODED_FRACTION * (2 << 20), rel=1e-3)
    with pricing_at(ESTIMATED.__class__(0.6, True, "sampled")):
        assert estimated_code(1 << 20, "bfloat16").nbytes == pytest.approx(0.6 * (2 << 20), rel=1e-3)
    assert estimated_code(1 << 20, "bfloat16").nbytes == pytest.approx(ESTIMATED_CODED_FRACTION * (2 << 20), rel=1e-3)


def test_the_plan_of_a_folder_says_it_sampled_and_prices_the_blocks_at_it(bf16_folder, capsys):
    folder, pipe = bf16_folder
    assert main(["plan", str(folder), "--diffusion-offload-config", LOSSLESS_DIT, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    fraction = report["lossless_fraction"]
    both = _coded_fraction_of(pipe.transformer, pipe.transformer_2)  # the DiT: both experts
    assert fraction["sampled"] and fraction["value"] == pytest.approx(both, abs=0.02)
    assert main(["plan", str(folder), "--diffusion-offload-config", LOSSLESS_DIT]) == 0
    assert "lossless priced at" in capsys.readouterr().out


def test_a_tiny_model_without_a_checkpoint_keeps_the_estimate_and_says_so(capsys):
    assert main(["plan", "tiny-wan", "--diffusion-offload-config", LOSSLESS_DIT]) == 0
    out = capsys.readouterr().out
    assert f"lossless priced at {ESTIMATED_CODED_FRACTION:.3f}x, an estimate" in out


def test_the_machine_plan_prices_lossless_at_the_sample(bf16_folder, capsys):
    folder, _ = bf16_folder
    # a reserve of 4 GB given: 0.3 MB of device budget, every block streams (the reserve is otherwise the request's estimate)
    argv = ["plan", str(folder), "--device-memory", "4.0003", "--activation-reserve-gb", "4", "--host-memory", "4", "--device-tflops", "1000", "--link-gbps", "0.001"]
    assert main([*argv, "--height", "32", "--width", "32", "--num-frames", "5"]) == 0
    out = capsys.readouterr().out
    assert '"storage_dtype": "lossless"' in out and "lossless priced at" in out and "sampled from the checkpoint" in out


# --- a Hub id not downloaded: ranged reads of its files ------------------------------------------------------


@pytest.fixture(scope="module")
def standin():
    with serving_standin_hub() as hub:
        yield hub


@pytest.fixture
def hub(standin, bf16_folder, tmp_path, monkeypatch):
    """The stand-in Hub serving the bfloat16 tiny-wan, online, with an empty cache; the Hub's sample as small as
    `SMALL_SAMPLE`."""
    select_standin_hub(standin, monkeypatch, tmp_path)
    standin.add_repo(REPO, bf16_folder[0])
    monkeypatch.setattr(hub_sample, "HUB_SAMPLE", SMALL_SAMPLE)
    return standin


def _sample_requests(hub) -> list:
    """The weight files' requests of the sample: huggingface_hub's header read for the skeleton (its first 100 kB)
    aside."""
    return [r for r in hub.weight_requests() if r.range != "bytes=0-100000"]


def test_the_plan_of_a_hub_id_samples_by_ranged_reads_what_the_files_give_here(hub, bf16_folder, capsys):
    folder, _ = bf16_folder
    assert main(["plan", REPO, "--diffusion-offload-config", LOSSLESS_DIT, "--json"]) == 0
    fraction = json.loads(capsys.readouterr().out)["lossless_fraction"]
    here = sample_coded_fraction(folder, {"transformer", "transformer_2"}, budget=SMALL_SAMPLE)
    assert fraction["sampled"] and fraction["value"] == here.value and "by ranged reads from the Hub" in fraction["source"]
    dit_bytes = sum(p.stat().st_size for c in ("transformer", "transformer_2") for p in (folder / c).glob("*.safetensors"))
    sampled = _sample_requests(hub)
    assert sampled and all(r.range and r.nbytes for r in sampled) and sum(r.nbytes for r in sampled) < dit_bytes / 4
    assert not any(f.endswith(".safetensors") for f in hub.downloaded())


def test_a_hub_that_ignores_ranges_is_left_at_its_first_answer_and_the_estimate_says_why(hub, capsys):
    hub.ignore_range = True
    assert main(["plan", REPO, "--diffusion-offload-config", LOSSLESS_DIT]) == 0
    out = capsys.readouterr().out
    assert f"lossless priced at {ESTIMATED_CODED_FRACTION:.3f}x, an estimate" in out
    assert "the Hub's weights were not sampled" in out and "without Content-Range (the whole file); stopped reading" in out
    assert [r.range for r in _sample_requests(hub)] == ["bytes=0-7"]  # no request after the first whole-file answer


def test_offline_or_an_error_answer_keeps_the_estimate_and_says_why(hub, monkeypatch):
    hub.add_repo("test-org/gated", hub.repos[REPO].commits[hub.repos[REPO].refs["main"]], gated=True)
    commit = hub.repos[REPO].refs["main"]
    unknown = hub_sample.hub_coded_fraction(REPO, "0" * 40, {"transformer"})
    gated = hub_sample.hub_coded_fraction("test-org/gated", hub.repos["test-org/gated"].refs["main"], {"transformer"})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    offline = hub_sample.hub_coded_fraction(REPO, commit, {"transformer"})
    for fraction, why in [(unknown, "the Hub answered 404"), (gated, "the Hub answered 401"), (offline, "HF_HUB_OFFLINE is set")]:
        assert not fraction.sampled and fraction.value == ESTIMATED_CODED_FRACTION and why in fraction.source, fraction
    assert _sample_requests(hub) == []
