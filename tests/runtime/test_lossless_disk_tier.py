"""`storage_dtype: "lossless"` with the disk tier (`host_budget_gb`): the budget is spent in coded bytes, blocks on
disk are coded once at enable into checked spill files (from memory, and from the checkpoint's own files, so the
disk reads shrink too), and the output is bit-identical to resident (and so to lossless without a budget, which
`test_lossless_storage.py` checks against the same resident output)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")

from layerstream import enable_offload  # noqa: E402
from layerstream.models.loading import load_pipeline  # noqa: E402
from layerstream.runtime.packing.layout import BlockLayout  # noqa: E402
from layerstream.runtime.stores.disk.sources import HEADER_BYTES  # noqa: E402
from layerstream.runtime.forms.lossless import lossless_forms  # noqa: E402
from layerstream.runtime.stores.local_store import LocalHostStore  # noqa: E402
from tiny_pipelines import generate  # noqa: E402

CPU = torch.device("cpu")
EXPERTS = ("transformer", "transformer_2")


def _config(budget_bytes: float | None = None, disk_dir: Path | None = None) -> dict:
    config = {"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"storage_dtype": "lossless"}}}
    if budget_bytes is not None:
        config["host_budget_gb"] = budget_bytes / 1e9
        config["disk_dir"] = str(disk_dir)
    return config


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory) -> Path:
    """tiny Wan 2.2 saved in bfloat16: loaded from it, its DiTs' weights are lazy views of bfloat16 files."""
    folder = tmp_path_factory.mktemp("tiny-wan-bf16")
    load_pipeline("tiny-wan", dtype=torch.bfloat16).save_pretrained(folder)
    return folder


def _wan(source: str, folder: Path):
    pipe = load_pipeline(str(folder)) if source == "checkpoint" else load_pipeline("tiny-wan", dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _stored(pipe) -> dict[str, int]:
    store = LocalHostStore(lossless_forms().form)
    return {
        f"{name}.blocks.{i}": store.host_nbytes(BlockLayout(f"{name}.blocks.{i}", b, CPU))
        for name in EXPERTS
        for i, b in enumerate(getattr(pipe, name).blocks)
    }


def _weights(pipe) -> dict[str, torch.Tensor]:
    return {f"{n}.{k}": v.clone() for n in EXPERTS for k, v in getattr(pipe, n).state_dict().items()}


@pytest.fixture(scope="module")
def expected(bf16_folder) -> torch.Tensor:
    """The resident output (the same bfloat16 weights from memory and from the folder: one output for both)."""
    return generate(_wan("checkpoint", bf16_folder), "wan")


@pytest.mark.parametrize("source", ["checkpoint", "in-memory"])
def test_tiny_wan_lossless_with_a_budget_between_one_expert_and_both_is_bit_identical(tmp_path, bf16_folder, expected, source):
    pipe = _wan(source, bf16_folder)
    original = _weights(pipe)
    stored = _stored(pipe)
    one_expert = sum(n for p, n in stored.items() if p.startswith("transformer."))
    budget = one_expert * 3 // 2
    handle = enable_offload(pipe, _config(budget, tmp_path), device="cpu")
    tier = handle.placement.host_tier
    assert tier.pool is not None
    assert tier.host_nbytes == sum(stored[p] for p in tier.host_block_paths) + tier.pool.nbytes <= budget
    # every disk block is spilled once, coded, even where the checkpoint holds its bytes
    spilled = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert len(spilled) == len(tier.from_disk_paths)
    assert sorted(f.stat().st_size - HEADER_BYTES for f in spilled) == sorted(stored[p] for p in tier.from_disk_paths)
    for _ in range(2 if source == "checkpoint" else 1):  # transformer, then transformer_2; then both again
        assert torch.equal(generate(pipe, "wan"), expected)
    stats = handle.stats()
    assert stats.disk_bytes_read > 0 and stats.host_bytes <= budget
    decoded = {b.path: b.host.layout.nbytes for b in handle.streamer.blocks}
    assert all(stored[p] < decoded[p] for p in stored)
    assert stats.lossless_stored_bytes == sum(stored.values()) and stats.lossless_decoded_bytes == sum(decoded.values())
    handle.disable()
    assert not any(p.is_file() for p in tmp_path.rglob("*"))
    after = _weights(pipe)
    assert after.keys() == original.keys() and all(torch.equal(after[k], v) for k, v in original.items())
