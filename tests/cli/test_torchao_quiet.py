"""With torchao installed, the command line's stderr holds layerstream's own lines (issue 26 item 12): diffusers and
transformers would import torchao with their model classes (five warnings on a CPU-only machine), so the
command line defers it to a model saved quantized by torchao."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("torchao") is None:
    pytest.skip("torchao is not installed (the `torchao` extra, part of `all`)", allow_module_level=True)

from layerstream.models.optional_imports import model_needs_torchao  # noqa: E402

PROBE = (
    "import sys\n"
    "from layerstream.cli.main import main\n"
    "code = main(sys.argv[1:])\n"
    "imported = sys.modules.get('torchao') is not None\n"
    "print('PROBE', code, imported, 'diffusers.models.modeling_utils' in sys.modules)\n"
)
"""Runs the command line as `python -m layerstream` does, then says whether torchao and diffusers' model
classes were imported."""


def _cli(*args: str, cwd=None) -> tuple[int, bool, bool, str]:
    """(exit code, torchao imported, diffusers' model classes imported, stderr) of one command line run."""
    result = subprocess.run(
        [sys.executable, "-c", PROBE, *args], capture_output=True, text=True, cwd=cwd, env=dict(os.environ), timeout=600
    )
    probe = result.stdout.strip().splitlines()[-1].split()
    assert probe[0] == "PROBE", (result.stdout, result.stderr)
    assert result.returncode == 0, result.stderr  # the probe itself ends cleanly after reporting main's code
    return int(probe[1]), probe[2] == "True", probe[3] == "True", result.stderr


def test_an_error_after_diffusers_loads_is_one_line_without_torchao(tmp_path):
    folder = tmp_path / "unknown-pipeline"
    (folder / "transformer").mkdir(parents=True)
    index = {"_class_name": "NoSuchPipeline", "_diffusers_version": "0.42.1", "transformer": ["diffusers", "FluxTransformer2DModel"]}
    (folder / "model_index.json").write_text(json.dumps(index))
    (folder / "transformer" / "config.json").write_text(json.dumps({"_class_name": "FluxTransformer2DModel"}))
    code, torchao_imported, diffusers_imported, stderr = _cli("generate", "--model", str(folder), "--steps", "1", cwd=tmp_path)
    assert code == 2 and diffusers_imported  # the load got as far as diffusers' model classes
    assert stderr.splitlines() == [f"layerstream: error: cannot load the pipeline in {folder}: AttributeError: module diffusers has no attribute NoSuchPipeline"]
    assert not torchao_imported


def test_plan_of_an_unquantized_model_imports_no_torchao():
    code, torchao_imported, diffusers_imported, stderr = _cli("plan", "tiny-flux")
    assert code == 0 and diffusers_imported and not torchao_imported
    assert stderr == ""


def build_torchao_folder(folder: Path) -> None:
    """The tiny Flux pipeline with its transformer saved quantized by torchao (int8 weight-only), as diffusers
    saves a `TorchAoConfig` model."""
    from diffusers import FluxTransformer2DModel, TorchAoConfig
    from torchao.quantization import Int8WeightOnlyConfig

    from layerstream.models.loading import resolve_model_folder

    source = resolve_model_folder("tiny-flux")
    shutil.copytree(source, folder, ignore=shutil.ignore_patterns("layerstream-manifest.json", "transformer"))
    config = TorchAoConfig(Int8WeightOnlyConfig())
    model = FluxTransformer2DModel.from_pretrained(source / "transformer", quantization_config=config, torch_dtype=torch.float32)
    model.save_pretrained(folder / "transformer")


def _build_torchao_folder(folder: Path) -> None:
    """`build_torchao_folder` here where this process's diffusers found torchao (the suite has it look before
    any command line runs in process), else in a process of its own: diffusers records once whether it is there."""
    import diffusers.utils

    if diffusers.utils.is_torchao_available():
        build_torchao_folder(folder)
        return
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); from pathlib import Path; "
        "from test_torchao_quiet import build_torchao_folder; build_torchao_folder(Path(sys.argv[1]))"
    )
    built = _python(code, str(folder))
    assert built.returncode == 0, built.stderr


DEFER_THEN_IMPORT = (
    "import importlib.util, sys\n"
    "from layerstream.models.optional_imports import torchao_deferred\n"
    "with torchao_deferred('tiny-wan'):\n"
    "    assert importlib.util.find_spec('torchao') is None\n"
    "    try:\n"
    "        import torchao\n"
    "    except ImportError:\n"
    "        pass\n"
    "    else:\n"
    "        raise AssertionError('torchao imported while deferred')\n"
    "import torchao.quantization\n"
    "print('imported again')\n"
)


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=dict(os.environ), timeout=600)


def test_a_model_saved_quantized_by_torchao_gets_it(tmp_path):
    folder = tmp_path / "tiny-flux-int8"
    _build_torchao_folder(folder)
    assert model_needs_torchao(folder) and model_needs_torchao(str(folder))
    assert not model_needs_torchao("tiny-flux") and not model_needs_torchao(None)
    code, torchao_imported, _, _ = _cli("plan", str(folder))
    assert code == 0 and torchao_imported


def test_torchao_is_importable_again_after_the_deferral():
    result = _python(DEFER_THEN_IMPORT)
    assert result.returncode == 0 and result.stdout.strip() == "imported again", result.stderr


def test_loading_in_python_prints_nothing_of_the_libraries():
    """`Omni` loads with torchao installed: torchao's kernel-library failures, torch's deprecation of its enum
    registrations, diffusers' "Unable to import `torchao` Tensor objects" and the loading progress bars stay
    unsaid (`quiet_library_noise`), and the caller's logger levels are as they were after."""
    code = (
        "import logging\n"
        "from layerstream import Omni\n"
        "omni = Omni('tiny-flux')\n"
        "print('loaded', omni.kind, logging.getLogger('torchao').level, logging.getLogger('torch.utils._pytree').level)\n"
    )
    result = _python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "loaded image 0 0\n" and result.stderr == ""
