"""Weights shared between a streamed block and another module are refused at enable, naming both owners.

The common kind of tying is one Parameter object held by a block and by a resident module (an output head
tied to a block's projection). Its two occurrences have the same byte extent, so a check that sorted spans
by (start, end, owner) compared ``None`` (resident) against a block path and crashed with a TypeError.
"""

from __future__ import annotations

import pytest
from torch import nn

from layerstream import LayerstreamError, enable_offload
from layerstream.errors import OffloadError
from runtime_toys import make_my_pipeline, run, toy_inputs

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast

DIT = {"mode": "layer", "components": ["dit"]}


def _state(module: nn.Module) -> dict[str, tuple[nn.Parameter, int]]:
    named = list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers())
    return {name: (t, t.data_ptr()) for name, t in named}


def _assert_refused_untouched(pipe: nn.Module, *names: str) -> OffloadError:
    before = _state(pipe)
    hooks_before = [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in pipe.modules()]
    with pytest.raises(OffloadError, match="shares memory") as caught:
        enable_offload(pipe, DIT, device="cpu")
    message = str(caught.value)
    for name in names:
        assert name in message, message
    after = _state(pipe)
    assert before.keys() == after.keys()
    assert all(before[k][0] is after[k][0] and before[k][1] == after[k][1] for k in before)
    assert hooks_before == [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in pipe.modules()]
    return caught.value


def test_parameter_tied_between_a_block_and_a_resident_module_is_refused_naming_both():
    pipe = make_my_pipeline()
    # the very same Parameter object in both places: both occurrences have the same byte extent
    pipe.transformer.head.weight = pipe.transformer.blocks[2].proj.weight
    error = _assert_refused_untouched(
        pipe, "transformer.head.weight", "transformer.blocks.2.proj.weight", "a resident module",
        "streamed block transformer.blocks.2",
    )  # fmt: skip
    assert isinstance(error, LayerstreamError) and isinstance(error, ValueError)


def test_tied_bias_between_a_resident_module_and_a_block_is_refused():
    pipe = make_my_pipeline()
    pipe.transformer.embed.bias = pipe.transformer.blocks[0].out.bias  # same size (dim), same Parameter
    _assert_refused_untouched(pipe, "transformer.embed.bias", "transformer.blocks.0.out.bias")


def test_parameter_tied_between_two_blocks_is_refused():
    pipe = make_my_pipeline()
    pipe.transformer.blocks[3].proj.weight = pipe.transformer.blocks[1].proj.weight
    _assert_refused_untouched(pipe, "transformer.blocks.1.proj.weight", "transformer.blocks.3.proj.weight")


def test_ties_among_resident_modules_stream_as_before():
    pipe = make_my_pipeline()
    pipe.transformer.head.bias = pipe.transformer.embed.bias  # both resident: nothing streamed shares it
    ids, x = toy_inputs()
    expected = run(pipe, (ids, x))
    handle = enable_offload(pipe, DIT, device="cpu")
    try:
        assert run(pipe, (ids, x)).equal(expected)
    finally:
        handle.disable()
