"""`layerstream plan` prices the lossless form at what the checkpoint holds: where the model's folder has its
weights, a sample of the DiT's coded bytes gives the fraction (`models.coded_fraction`), and the plan says that
it sampled; a skeleton with no readable weights keeps the fixed estimate, and says so."""

from __future__ import annotations

import json

import pytest
import torch

from layerstream.cli.main import main
from layerstream.models import coded_fraction
from layerstream.models.coded_fraction import sample_coded_fraction
from layerstream.models.loading import load_pipeline
from layerstream.runtime.packing.lossless_code import ESTIMATED, ESTIMATED_CODED_FRACTION, estimated_code, pricing_at

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


def test_a_sample_of_the_weights_estimates_what_the_code_stores(bf16_folder, monkeypatch):
    folder, pipe = bf16_folder
    monkeypatch.setattr(coded_fraction, "RUN_ELEMENTS", 512)  # a sample smaller than the tensors: runs, not all
    sampled = sample_coded_fraction(folder, {"transformer"})
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
    argv = ["plan", str(folder), "--device-memory", "4.0003", "--host-memory", "4", "--device-tflops", "1000", "--link-gbps", "0.001"]
    assert main([*argv, "--height", "32", "--width", "32", "--num-frames", "5"]) == 0
    out = capsys.readouterr().out
    assert '"storage_dtype": "lossless"' in out and "lossless priced at" in out and "sampled from the checkpoint" in out
