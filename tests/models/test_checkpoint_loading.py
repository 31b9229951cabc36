"""Cold start on a real-width checkpoint: dtypes as saved, streamed blocks read straight from the files into the
host store, no mapping of the files left behind, outputs bit-identical to the folder loaded resident.

The folder is a Wan 2.2 pipeline whose two transformers have the real Wan 1.3B width (12 heads of 128, FFN
8960) with 2 blocks each, saved in bfloat16 and sharded so that blocks span several files; the text encoder
and VAE are the tiny ones. Generations are one frame at 32x32 so that the forwards stay cheap on a CPU.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")

from layerstream import Omni, enable_offload  # noqa: E402
from layerstream.models.loading import ModelLoadError, load_pipeline  # noqa: E402
from layerstream.models.saved_dtypes import read_safetensors_header  # noqa: E402

DIT = {"mode": "layer", "components": ["dit"]}
REQUEST = dict(prompt="a fox", height=32, width=32, num_frames=1, num_inference_steps=2, seed=0)


@pytest.fixture(scope="module")
def wan_folder(real_width_wan_folder) -> Path:
    return real_width_wan_folder  # tests/conftest.py: shared with the exit tests, never written to here


@dataclasses.dataclass(frozen=True)
class ResidentRun:
    """The folder loaded resident (no offload) and run once on `REQUEST`: what streamed runs must equal."""

    raw: np.ndarray
    block_weight_dtypes: set[torch.dtype]
    """The dtypes of the transformer blocks' 2-D weights as loaded."""


@pytest.fixture(scope="module")
def resident_run(wan_folder) -> ResidentRun:
    """One resident load and generation, shared by the tests that compare a streamed run with it: the same
    folder and request give the same bits, so a second resident run would only repeat the first."""
    resident = Omni(model=str(wan_folder), offload=False)
    dtypes = {p.dtype for p in resident.pipeline.transformer.blocks.parameters() if p.dim() == 2}
    raw = np.asarray(resident.generate(**REQUEST, keep_raw=True).raw)
    resident.close()
    del resident
    gc.collect()  # the resident pipeline's own views of the files go with it
    return ResidentRun(raw, dtypes)


def _copy_with_one_file_of_its_own(folder: Path, copy: Path, victim: str) -> Path:
    """`folder` at `copy`, every file a hard link to the original except `victim` (a path inside the folder),
    which is copied: the test can truncate it without touching the shared folder, and the other ~400 MB are
    not written again. Returns the victim's path in the copy."""
    import shutil

    shutil.copytree(folder, copy, copy_function=os.link)
    own = copy / victim
    own.unlink()
    shutil.copyfile(folder / victim, own)
    return own


def _transformer_file(folder: Path, index: int) -> str:
    """The path, inside the folder, of the transformer's `index`-th safetensors file in sorted order."""
    return str(sorted((folder / "transformer").glob("*.safetensors"))[index].relative_to(folder))


def _block_checkpoint_bytes(folder: Path, component: str) -> tuple[int, int]:
    """(bytes, tensors) the checkpoint stores for the component's blocks."""
    nbytes = count = 0
    for path in (folder / component).glob("*.safetensors"):
        for name, entry in read_safetensors_header(path).items():
            if name.startswith("blocks."):
                nbytes += entry["data_offsets"][1] - entry["data_offsets"][0]
                count += 1
    return nbytes, count


def _mapped_files_under(folder: Path) -> list[str]:
    return [line for line in Path("/proc/self/maps").read_text().splitlines() if str(folder) in line]


def test_a_bf16_folder_loads_in_bf16_and_streams_from_the_files_bit_identically(wan_folder, resident_run):
    # the weights stay bf16 as saved (diffusers keeps the model's few _keep_in_fp32_modules, norms and
    # modulation tables, in float32 on purpose)
    assert resident_run.block_weight_dtypes == {torch.bfloat16}

    omni = Omni(model=str(wan_folder), diffusion_offload_config=DIT)
    stats = omni.stats()
    for component in ("transformer", "transformer_2"):
        ckpt_bytes, num_tensors = _block_checkpoint_bytes(wan_folder, component)
        host = stats.per_component[component].host_bytes
        # the checkpoint's bytes: alignment pads and the float32 norms are well under 1% on top
        assert ckpt_bytes <= host <= 1.01 * ckpt_bytes, (component, host, ckpt_bytes)
    # the streamed bytes came from the files, except the few float32 tensors diffusers upcast in memory
    assert stats.host_bytes_from_files >= 0.99 * stats.host_bytes, stats
    assert _mapped_files_under(wan_folder) == []  # nothing of the checkpoint stays mapped
    got = omni.generate(**REQUEST, keep_raw=True)
    assert np.array_equal(np.asarray(got.raw), resident_run.raw)
    omni.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_dtype_given_on_load_is_cast_from_the_files_exactly_as_diffusers_casts(wan_folder, dtype):
    """The bf16 transformers are read from the files and cast tensor by tensor; every tensor (weights, the
    float32 _keep_in_fp32_modules, buffers) equals diffusers' own load with the same dtype, bit for bit, no
    mapping of the files is left, and the streamed pipeline's output equals the resident one's."""
    from diffusers import DiffusionPipeline

    expected_pipe = DiffusionPipeline.from_pretrained(wan_folder, dtype=dtype, local_files_only=True)
    streamed_pipe = load_pipeline(str(wan_folder), dtype=dtype)
    # the cast transformers' views of their files were all replaced (the VAE, stored in float32, keeps its own)
    assert [line for line in _mapped_files_under(wan_folder) if "/transformer" in line] == []
    for component in ("transformer", "transformer_2", "vae", "text_encoder"):
        want = dict(getattr(expected_pipe, component).state_dict(keep_vars=True))
        got = dict(getattr(streamed_pipe, component).state_dict(keep_vars=True))
        assert want.keys() == got.keys(), component
        for name, tensor in want.items():
            assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), (component, name)
    assert {p.dtype for p in streamed_pipe.transformer.blocks.parameters() if p.dim() == 2} == {dtype}
    handle = enable_offload(streamed_pipe, DIT, device="cpu")
    from layerstream.models.tiny_components import LATENT_CHANNELS, TEXT_HIDDEN_SIZE

    g = torch.Generator().manual_seed(0)
    latents = torch.randn(1, LATENT_CHANNELS, 1, 4, 4, generator=g).to(dtype)
    prompt_embeds = torch.randn(1, 8, TEXT_HIDDEN_SIZE, generator=g).to(dtype)
    with torch.no_grad():
        want_out = expected_pipe.transformer(latents, torch.tensor([500]), prompt_embeds, return_dict=False)[0]
        got_out = streamed_pipe.transformer(latents, torch.tensor([500]), prompt_embeds, return_dict=False)[0]
    assert torch.equal(got_out, want_out)
    assert handle.stats().host_bytes_from_files == 0  # cast weights live in memory, not in the files
    handle.disable()


def test_peak_memory_of_load_and_enable_stays_near_the_host_store(wan_folder, tmp_path):
    """In a fresh process: peak RSS during load plus enable is at most 1.1x the host store plus the resident
    parts (over the process's baseline before it), as saved and with a cast to float32 on load (which doubles
    the host store, never holding the checkpoint's bytes beside it). One process for both loads: the first is
    closed and the peak reset (`/proc/self/clear_refs`) before the second."""
    script = tmp_path / "peak.py"
    script.write_text(
        "import gc, json, sys, torch\n"
        "from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel\n"
        "from transformers import UMT5EncoderModel\n"
        "from layerstream import Omni\n"
        "def kb(key):\n"
        "    for line in open('/proc/self/status'):\n"
        "        if line.startswith(key): return int(line.split()[1]) * 1024\n"
        "for dtype in (None, 'float32'):\n"
        "    gc.collect()\n"
        "    open('/proc/self/clear_refs', 'w').write('5')  # VmHWM back to the resident set now\n"
        "    base = kb('VmRSS')\n"
        f"    omni = Omni(model={str(wan_folder)!r}, dtype=dtype, diffusion_offload_config={{'mode': 'layer', 'components': ['dit']}})\n"
        "    s = omni.stats()\n"
        "    resident = sum(c.device_bytes for c in s.per_component.values())\n"
        f"    mapped = [l for l in open('/proc/self/maps') if {str(wan_folder)!r} in l]\n"
        "    print(json.dumps({'dtype': dtype, 'base': base, 'peak': kb('VmHWM'), 'host': s.host_bytes,\n"
        "                      'resident': resident, 'mapped': len(mapped)}))\n"
        "    omni.close()\n"
        "    del omni\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    runs = [json.loads(line) for line in out.stdout.strip().splitlines()[-2:]]
    assert [m["dtype"] for m in runs] == [None, "float32"]
    for m in runs:
        grown = m["peak"] - m["base"]
        # a cast on load holds one block in flight beside the host store (the cast weights, until packed): a
        # quarter of the store with these 4 blocks, under 2% with Wan's 60
        in_flight = 0 if m["dtype"] is None else m["host"] // 4
        assert grown <= 1.1 * m["host"] + m["resident"] + in_flight + 64 * 2**20, m  # 64 MiB for loader bookkeeping
        assert m["mapped"] == 0, m  # no checkpoint file left mapped
    assert runs[1]["host"] > 1.9 * runs[0]["host"]  # float32 doubles the store: the second load was measured


@pytest.mark.parametrize("dtype", [None, torch.float32])
def test_a_truncated_checkpoint_file_is_named_and_nothing_is_half_loaded(wan_folder, tmp_path, dtype):
    broken = tmp_path / "broken"
    victim = _copy_with_one_file_of_its_own(wan_folder, broken, _transformer_file(wan_folder, 1))
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    with pytest.raises(ModelLoadError, match=victim.name):
        load_pipeline(str(broken), dtype=dtype)


def test_a_file_truncated_before_the_cast_reads_it_is_named(wan_folder, tmp_path):
    """The cast on load reads each weight from its file: a file that shrank after diffusers mapped it fails
    the cast with the file's name (and `load_pipeline` then returns no pipeline at all)."""
    from diffusers import WanTransformer3DModel

    from layerstream.models.cast_on_load import CastReadError, cast_from_files_

    copy = tmp_path / "copy"
    victim = _copy_with_one_file_of_its_own(wan_folder, copy, _transformer_file(wan_folder, -1))
    model = WanTransformer3DModel.from_pretrained(copy / "transformer", dtype=torch.bfloat16, local_files_only=True)
    os.truncate(victim, 64)
    with pytest.raises(CastReadError, match=victim.name):
        cast_from_files_(model, torch.float32, what="transformer")


def test_a_file_truncated_after_loading_fails_enable_cleanly(wan_folder, tmp_path):
    """The weights are lazy views of the files: if a file shrinks between load and enable, enable reads it and
    fails naming it, and rolls back (the pipeline is as it was)."""
    copy = tmp_path / "copy"
    victim = _copy_with_one_file_of_its_own(wan_folder, copy, _transformer_file(wan_folder, -1))
    pipe = load_pipeline(str(copy))
    params = dict(pipe.transformer.named_parameters())
    os.truncate(victim, 64)  # pages not yet read now lie past the end of the file
    with pytest.raises(Exception, match=victim.name):
        enable_offload(pipe, DIT, device="cpu")
    assert all(p is params[k] for k, p in pipe.transformer.named_parameters())
    assert all(not m._forward_pre_hooks for m in pipe.transformer.modules())


def test_a_host_budget_of_one_block_reads_the_others_from_the_checkpoint(wan_folder, resident_run, tmp_path):
    """The disk tier on a folder: blocks beyond `host_budget_gb` are read from the checkpoint's own files at
    every use (no spill file is written), and the picture is bit-identical to the folder loaded resident. The
    two experts share the budget (a host pool of one block: each holds one block while it runs)."""
    ckpt_bytes, _ = _block_checkpoint_bytes(wan_folder, "transformer")  # two blocks; transformer_2 is the same size
    budget_gb = 1.02 * ckpt_bytes / 2 / 1e9  # one packed block (2% for pads and float32 norms)
    spill_dir = tmp_path / "spill"
    config = {**DIT, "host_budget_gb": budget_gb, "disk_dir": str(spill_dir)}
    omni = Omni(model=str(wan_folder), diffusion_offload_config=config)
    tier = omni.handle.placement.host_tier
    assert [sorted(p.split(".")[0] for p in entry) for entry in tier.pool.entries] == [["transformer", "transformer_2"]]
    assert sorted(p.split(".")[0] for p in tier.disk_block_paths) == ["transformer", "transformer_2"]
    got = omni.generate(**REQUEST, keep_raw=True)
    stats = omni.stats()
    assert stats.host_bytes <= budget_gb * 1e9, stats  # the pool, and the disk blocks' few float32 norms
    assert stats.disk_bytes_read >= 0.99 * ckpt_bytes / 2  # each disk block read once per forward at least
    assert not spill_dir.exists() or not any(spill_dir.rglob("*"))  # read from the checkpoint: nothing spilled
    omni.close()
    assert np.array_equal(np.asarray(got.raw), resident_run.raw)
