"""float8 storage (`storage_dtype`) with the disk tier (`host_budget_gb`): the host tier, the experts' host pool
and the disk hold float8 bytes. The budget is spent in float8 bytes (it holds more blocks than the model's own
dtype would), blocks on disk are written once at enable to checked spill files of their float8 bytes (the
checkpoint holds the wider dtype), and the output is bit-identical to float8 without a budget."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from layerstream import enable_offload
from layerstream.runtime.packing.layout import BlockLayout
from layerstream.runtime.forms.float8 import float8_forms
from layerstream.runtime.stores.local_store import LocalBlock, LocalHostStore
from layerstream.runtime.stores.disk.sources import HEADER_BYTES, SpillFileError
from runtime_toys import make_my_pipeline, run, snapshot, toy_inputs

CPU = torch.device("cpu")
FP8 = "float8_e4m3fn"


def _spill_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def _fp8_config(components, budget_bytes: float | None = None, disk_dir: Path | None = None) -> dict:
    config = {"mode": "layer", "components": list(components), "layer_options": {"dit": {"storage_dtype": FP8}}}
    if budget_bytes is not None:
        config["host_budget_gb"] = budget_bytes / 1e9
    if disk_dir is not None:
        config["disk_dir"] = str(disk_dir)
    return config


def _stored_nbytes(model, prefix: str) -> dict[str, int]:
    """Each block's float8 stored bytes and its bytes as it is, by path (what the placement prices)."""
    store = LocalHostStore(float8_forms(model, torch.float8_e4m3fn).form)
    return {f"{prefix}.{i}": store.host_nbytes(BlockLayout(f"{prefix}.{i}", b, CPU)) for i, b in enumerate(model.blocks)}


def _wan(source: str):
    pytest.importorskip("diffusers")
    from tiny_pipelines import load_wan

    return load_wan(source)


def _wan_fp8_reference(source: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """float8 with no budget: the output, and the weights disable gives back (rounded to float8)."""
    from tiny_pipelines import generate

    pipe = _wan(source)
    handle = enable_offload(pipe, _fp8_config(["dit"]), device="cpu")
    expected = generate(pipe, "wan")
    handle.disable()
    weights = {f"{name}.{k}": v for name in ("transformer", "transformer_2") for k, v in snapshot(getattr(pipe, name)).items()}
    return expected, weights


@pytest.mark.parametrize("source", ["checkpoint", "in-memory"])
def test_tiny_wan_float8_with_a_budget_between_one_expert_and_both_is_bit_identical(tmp_path, source):
    from tiny_pipelines import generate

    expected, expected_weights = _wan_fp8_reference(source)
    pipe = _wan(source)
    experts = {"transformer": pipe.transformer, "transformer_2": pipe.transformer_2}
    stored = {p: n for name, m in experts.items() for p, n in _stored_nbytes(m, f"{name}.blocks").items()}
    plain = {f"{name}.blocks.{i}": BlockLayout("b", b).nbytes for name, m in experts.items() for i, b in enumerate(m.blocks)}
    one_expert = sum(n for p, n in stored.items() if p.startswith("transformer."))
    budget = one_expert * 3 // 2  # more than one expert's float8 bytes, less than both
    assert one_expert < budget < sum(stored.values())
    handle = enable_offload(pipe, _fp8_config(["dit"], budget, tmp_path), device="cpu")
    tier = handle.placement.host_tier
    assert tier.pool is not None and tier.pool.members == ("transformer", "transformer_2")
    in_host = list(tier.host_block_paths) + list(tier.pool.block_paths)
    # priced in float8 bytes: the budget holds far more blocks than it would hold in the model's own dtype
    assert sum(plain[p] for p in in_host) > budget >= tier.host_nbytes
    assert tier.host_nbytes == sum(stored[p] for p in tier.host_block_paths) + tier.pool.nbytes

    # every block that lives on disk (the pooled ones included) is spilled once, in float8, even from a checkpoint
    spilled = _spill_files(tmp_path)
    assert len(spilled) == len(tier.from_disk_paths)
    assert sorted(f.stat().st_size - HEADER_BYTES for f in spilled) == sorted(stored[p] for p in tier.from_disk_paths)

    for _ in range(2):  # one request runs transformer, then transformer_2; the next one transformer again
        assert torch.equal(generate(pipe, "wan"), expected)
    stats = handle.stats()
    assert stats.host_bytes <= budget and stats.host_pool_bytes == tier.pool.nbytes  # the runtime's own accounting
    assert stats.disk_bytes_read > 0
    assert stats.disk_staging_bytes <= 3 * max(stored.values()) + 3 * 2 * 4096  # the ring holds float8 blocks
    handle.disable()
    assert _spill_files(tmp_path) == []
    after = {f"{name}.{k}": v for name, m in experts.items() for k, v in snapshot(m).items()}
    assert after.keys() == expected_weights.keys()
    assert all(torch.equal(after[k], v) for k, v in expected_weights.items())  # the float8-rounded weights back


def _toy_fp8_reference(components) -> torch.Tensor:
    pipe = make_my_pipeline()
    handle = enable_offload(pipe, _fp8_config(components), device="cpu")
    out = run(pipe, toy_inputs())
    handle.disable()
    return out


@pytest.mark.parametrize("fraction", [0.0, 0.5])
def test_a_float8_dit_and_a_packed_encoder_share_one_budget_and_one_disk(tmp_path, fraction):
    """The DiT in float8, the text encoder as it is, under one budget: one tiered store over both host stores."""
    components = ("dit", "text_encoder")
    expected = _toy_fp8_reference(components)
    pipe = make_my_pipeline()
    stored = _stored_nbytes(pipe.transformer, "transformer.blocks")
    encoder = {f"prompt_model.encoder.layers.{i}": BlockLayout("b", b).nbytes for i, b in enumerate(pipe.prompt_model.encoder.layers)}
    budget = max(1, int(fraction * (sum(stored.values()) + sum(encoder.values()))))
    handle = enable_offload(pipe, _fp8_config(components, budget, tmp_path), device="cpu")
    tier = handle.placement.host_tier
    if fraction == 0:
        assert len(tier.disk_block_paths) == 7 and not tier.host_block_paths  # every block on disk
    else:
        assert tier.disk_block_paths and tier.host_block_paths
    sizes = {**stored, **encoder}
    for _ in range(3):
        assert torch.equal(run(pipe, toy_inputs()), expected)
    stats = handle.stats()
    assert stats.host_bytes == sum(sizes[p] for p in tier.host_block_paths) <= budget
    kinds = {b.path: type(b.host.form if isinstance(b.host, LocalBlock) else b.host).__name__ for b in handle.streamer.blocks}
    for path in tier.host_block_paths:
        assert kinds[path] == ("Float8Form" if path.startswith("transformer.") else "PackedForm")
    assert all(kinds[p] == "DiskBlock" for p in tier.disk_block_paths)
    disk_links = {b.path: b.host.link_bytes for b in handle.streamer.blocks if b.path in tier.disk_block_paths}
    assert all(disk_links[p] == sizes[p] for p in disk_links)  # float8 bytes from disk, for the DiT's blocks
    handle.disable()
    assert _spill_files(tmp_path) == []


def test_a_failed_enable_gives_the_float8_disk_blocks_their_original_tensors_back(tmp_path):
    pipe = make_my_pipeline()
    before = snapshot(pipe)
    params = dict(pipe.named_parameters())
    pointers = {k: p.data_ptr() for k, p in params.items()}

    def failing_engine(device, num_slots):
        raise RuntimeError("no engine today")

    with pytest.raises(Exception, match="no engine today"):
        enable_offload(pipe, _fp8_config(["dit"], 1, tmp_path), device="cpu", engine_factory=failing_engine)
    assert _spill_files(tmp_path) == []
    after = snapshot(pipe)
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())  # not rounded
    assert all(p is params[k] and p.data_ptr() == pointers[k] for k, p in pipe.named_parameters())  # the very tensors


def test_a_damaged_float8_spill_file_is_an_error_naming_it(tmp_path):
    expected = _toy_fp8_reference(["dit"])
    pipe = make_my_pipeline()
    handle = enable_offload(pipe, _fp8_config(["dit"], 1, tmp_path), device="cpu")
    victim = _spill_files(tmp_path)[1]
    whole = victim.read_bytes()
    data = bytearray(whole)
    data[HEADER_BYTES + 40] ^= 0x01
    victim.write_bytes(bytes(data))
    with pytest.raises(Exception, match=victim.name) as info:
        run(pipe, toy_inputs())
    assert isinstance(info.value, SpillFileError) or isinstance(info.value.__cause__, SpillFileError)
    victim.write_bytes(whole)
    assert torch.equal(run(pipe, toy_inputs()), expected)
    handle.disable()


def test_the_accelerator_engine_casts_float8_disk_blocks_after_their_copy(tmp_path):
    """The accelerator engine (its CUDA calls recorded by a stand-in) runs the disk blocks' jobs: the stored
    float8 bytes reach the slot's staging region, then the casts fill the compute layout; bit-identical."""
    from layerstream.runtime.engines.copy_engine import AcceleratorCopyEngine
    from test_accelerator_protocol import Recorder

    expected = _toy_fp8_reference(["dit"])
    pipe = make_my_pipeline()
    stored = _stored_nbytes(pipe.transformer, "transformer.blocks")
    recorder = Recorder()
    handle = enable_offload(
        pipe,
        _fp8_config(["dit"], 2 * max(stored.values()), tmp_path),
        device="cpu",
        engine_factory=lambda device, n: AcceleratorCopyEngine(device, n, api=recorder),
    )
    assert len(handle.placement.host_tier.host_block_paths) == 2
    for _ in range(2):
        assert torch.equal(run(pipe, toy_inputs()), expected)
    handle.disable()
    assert _spill_files(tmp_path) == []
