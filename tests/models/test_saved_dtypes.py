"""With no dtype given, every component loads in the dtype its checkpoint stores, through Omni and generate."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")

from layerstream import Omni  # noqa: E402
from layerstream.models.loading import load_pipeline  # noqa: E402
from layerstream.models.saved_dtypes import saved_dtypes, stored_dtype  # noqa: E402


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-wan-bf16")
    load_pipeline("tiny-wan", dtype=torch.bfloat16).save_pretrained(folder)
    return folder


def test_saved_dtypes_are_read_from_the_headers(bf16_folder):
    dtypes = saved_dtypes(bf16_folder)
    assert set(dtypes) == {"transformer", "transformer_2", "text_encoder", "vae"}
    assert set(dtypes.values()) == {torch.bfloat16}
    assert stored_dtype(bf16_folder / "scheduler") is None  # no weights, no opinion


def test_omni_keeps_the_saved_dtype_and_says_so(bf16_folder):
    omni = Omni(model=str(bf16_folder), diffusion_offload_config={"mode": "layer", "components": ["dit"]})
    assert omni.component_dtypes() == {name: "bfloat16" for name in ("vae", "text_encoder", "transformer", "transformer_2")}
    weights = [p for p in omni.pipeline.text_encoder.parameters() if p.dim() == 2]
    assert {p.dtype for p in weights} == {torch.bfloat16}
    omni.close()
    cast = Omni(model=str(bf16_folder), dtype="float32", offload=False)  # a dtype given still casts everything
    assert set(cast.component_dtypes().values()) == {"float32"}


def test_generate_reports_the_dtype_of_each_component(bf16_folder, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "layerstream", "generate", "--model", str(bf16_folder), "--steps", "1",
         "--height", "32", "--width", "32", "--num-frames", "5", "--output", str(tmp_path / "out.gif"), "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    summary = summary[0] if isinstance(summary, list) else summary
    assert summary["dtypes"]["transformer"] == "bfloat16" and summary["dtypes"]["vae"] == "bfloat16"
