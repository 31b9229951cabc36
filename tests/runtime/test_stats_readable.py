"""`handle.stats()` reads well: a multi-line summary, and a bare model's component has a name."""

from __future__ import annotations

import pytest
import torch

from layerstream import enable_offload
from runtime_toys import ToyDiT, make_my_pipeline, run, toy_inputs

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast


def test_a_bare_model_is_named_and_stats_print_as_a_summary():
    model = ToyDiT(dim=32, num_blocks=4).eval()
    handle = enable_offload(model, {"mode": "layer", "components": ["dit"]}, device="cpu")
    run(model, (torch.randn(2, 32),))
    stats = handle.stats()
    assert list(stats.per_component) == ["<model>"] and list(stats.residency) == ["<model>"]
    text = str(stats)
    lines = text.splitlines()
    assert len(lines) >= 4 and all(len(line) <= 120 for line in lines), text
    assert lines[0].startswith("offload (cpu-thread): 2 slots")
    assert f"{stats.num_transfers} transfers" in text and "<model>: 4 streamed + 0 resident blocks" in text
    assert repr(stats).startswith("OffloadStats(")  # the full dataclass repr stays available
    handle.disable()


def test_pipeline_components_keep_their_paths():
    pipe = make_my_pipeline()
    handle = enable_offload(pipe, {"mode": "layer", "components": ["dit", "text_encoder"]}, device="cpu")
    run(pipe, toy_inputs())
    per = handle.stats().per_component
    assert per["transformer"].num_streamed_blocks == 4 and per["prompt_model"].num_streamed_blocks == 3
    handle.disable()
