"""`load_pipeline`: tiny names and local folders load; everything else fails with one clear line, offline."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from layerstream.models import (
    ModelLoadError,
    ensure_tiny_model,
    is_tiny_model_name,
    load_pipeline,
    pipeline_kind,
    resolve_model_folder,
)
from layerstream.models.loading import hub_offline
from layerstream.models.manifest import MANIFEST_NAME

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast

WHAT_MODEL_IS = "a local diffusers-format folder, or a Hugging Face Hub id (org/name)"


def test_tiny_names():
    assert is_tiny_model_name("tiny-wan") and is_tiny_model_name("tiny-flux") and is_tiny_model_name("tiny-qwen-image")
    assert not is_tiny_model_name("tiny-sdxl") and not is_tiny_model_name(None)


def test_local_folder_loads_like_a_tiny_name(tmp_path):
    folder = tmp_path / "my-wan"
    shutil.copytree(ensure_tiny_model("tiny-wan"), folder)
    assert resolve_model_folder(folder) == folder
    pipe = load_pipeline(str(folder))
    assert type(pipe).__name__ == "WanPipeline" and pipeline_kind(pipe) == "video"


def test_dtype_casts_every_component():
    pipe = load_pipeline("tiny-flux", dtype=torch.bfloat16)
    assert pipeline_kind(pipe) == "image"
    for name in ("transformer", "text_encoder", "text_encoder_2", "vae"):
        assert getattr(pipe, name).dtype == torch.bfloat16, name


def test_dtype_must_be_a_torch_dtype():
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        load_pipeline("tiny-flux", dtype="bfloat16")


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist") as error:
        load_pipeline(str(tmp_path / "nowhere"))
    assert WHAT_MODEL_IS in str(error.value) and "\n" not in str(error.value)


def test_a_hub_id_offline_with_nothing_cached_is_one_line(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # so that "Wan-AI/..." is certainly not a relative path here
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))  # the suite runs with HF_HUB_OFFLINE=1
    with pytest.raises(ModelLoadError) as error:
        load_pipeline("Wan-AI/Wan2.2-T2V-A14B-Diffusers")
    message = str(error.value)
    assert message.startswith("model Wan-AI/Wan2.2-T2V-A14B-Diffusers: HF_HUB_OFFLINE is set and no snapshot")
    assert "unset HF_HUB_OFFLINE" in message and "\n" not in message


def test_folder_without_model_index(tmp_path):
    (tmp_path / "transformer").mkdir()
    with pytest.raises(ModelLoadError, match="has no model_index.json"):
        load_pipeline(tmp_path)


def test_file_and_empty_string(tmp_path):
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="is a file"):
        load_pipeline(str(file))
    with pytest.raises(ModelLoadError, match="model is empty"):
        load_pipeline("")
    with pytest.raises(TypeError, match="tiny model name, a folder path or a Hub id"):
        load_pipeline(42)


def test_loader_failure_names_the_folder(tmp_path):
    folder = tmp_path / "broken"
    shutil.copytree(ensure_tiny_model("tiny-qwen-image"), folder)
    (folder / MANIFEST_NAME).unlink()  # a downloaded folder: no checksums, so diffusers is the one to fail
    (folder / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ModelLoadError, match=f"cannot load the pipeline in {folder}") as error:
        load_pipeline(folder)
    assert error.value.__cause__ is not None and "\n" not in str(error.value)


def test_hub_offline_blocks_requests_and_restores_state(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with hub_offline():
        assert os.environ["HF_HUB_OFFLINE"] == "1" and constants.is_offline_mode()
    assert "HF_HUB_OFFLINE" not in os.environ and not constants.HF_HUB_OFFLINE


def test_tiny_model_blocked_by_a_foreign_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("LAYERSTREAM_CACHE", str(tmp_path))
    blocker = tmp_path / "models" / "tiny-wan-v1"
    blocker.mkdir(parents=True)
    (blocker / "notes.txt").write_text("not a model")
    with pytest.raises(ModelLoadError, match=f"cannot build tiny model tiny-wan: .*{blocker}.*delete it"):
        load_pipeline("tiny-wan")


def test_missing_component_folder_is_named_before_diffusers_reads(tmp_path):
    folder = tmp_path / "partial-wan"
    shutil.copytree(ensure_tiny_model("tiny-wan"), folder)
    shutil.rmtree(folder / "transformer_2")  # an interrupted download
    with pytest.raises(ModelLoadError) as error:
        load_pipeline(folder)
    message = str(error.value)
    assert "transformer_2 (diffusers.WanTransformer3DModel)" in message and "no transformer_2/ folder" in message
    assert "download the model again" in message and "config.json" not in message and "\n" not in message


def test_optional_component_saved_as_null_is_not_required(tmp_path):
    folder = tmp_path / "flux"
    shutil.copytree(ensure_tiny_model("tiny-flux"), folder)
    index = json.loads((folder / "model_index.json").read_text())
    assert index["image_encoder"] == [None, None]  # diffusers' marker of a component saved without
    assert resolve_model_folder(folder) == folder


def test_unreadable_model_index(tmp_path):
    (tmp_path / "model_index.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot read model_index.json: JSONDecodeError"):
        load_pipeline(tmp_path)


def test_damaged_copy_of_a_built_folder_names_the_file_and_the_fix(tmp_path):
    folder = tmp_path / "my-wan"
    shutil.copytree(ensure_tiny_model("tiny-wan"), folder)
    weights = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-8] ^= 0x01  # one flipped bit in the last tensor: still a valid safetensors file
    weights.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError) as error:
        load_pipeline(folder)
    message = str(error.value)
    assert "transformer/diffusion_pytorch_model.safetensors does not match the checksum" in message
    assert f"delete {MANIFEST_NAME}" in message and "download the model again" in message
