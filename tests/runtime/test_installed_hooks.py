"""`handle.hooks()` names everything enable installed: every streamed block's call, each component's wrapper,
the state-dict hooks, the guards and the pipeline's ownership; after `disable()` nothing is left installed."""

from __future__ import annotations

import pytest

pytest.importorskip("diffusers")

from layerstream import enable_offload  # noqa: E402
from layerstream.runtime.modes.hooks import PIPELINE  # noqa: E402
from tests.runtime.tiny_pipelines import DIT, load  # noqa: E402

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast


def test_hooks_lists_every_streamed_block_and_is_empty_after_disable():
    pipe = load("wan")
    cls = type(pipe)
    handle = enable_offload(pipe, DIT, device="cpu")
    hooks = handle.hooks()
    blocks = [f"{dit}.blocks.{i}" for dit in ("transformer", "transformer_2") for i in range(len(getattr(pipe, dit).blocks))]
    by_name: dict[str, set[str]] = {}
    for hook in hooks:
        by_name.setdefault(hook.name, set()).add(hook.module_path)
        assert hook.what and str(hook).startswith(f"{hook.module_path}: {hook.name} (")
    assert by_name["block_call"] == set(blocks)
    assert by_name["component_call"] == {"transformer", "transformer_2"}
    assert by_name["state_dict"] == set(blocks) and by_name["load_state_dict.pre"] == set(blocks)
    assert {"transformer", "transformer_2", PIPELINE} | set(blocks) == by_name["guard"]
    assert by_name["ownership"] == {PIPELINE}
    assert len({(h.module_path, h.name) for h in hooks}) == len(hooks)  # each named once
    assert "block_call" in repr(handle.backend.hooks)

    handle.disable()
    assert handle.hooks() == ()
    assert type(pipe) is cls
    for block in (b for dit in ("transformer", "transformer_2") for b in getattr(pipe, dit).blocks):
        assert "_compiled_call_impl" not in block.__dict__  # the block call is gone
        assert not block._state_dict_hooks and not block._load_state_dict_pre_hooks
    assert "forward" not in pipe.transformer.__dict__ and "__deepcopy__" not in pipe.__dict__


def test_module_mode_lists_its_swaps():
    pipe = load("wan")
    handle = enable_offload(pipe, {"mode": "module", "components": ["dit"]}, device="cpu")
    names = {(h.module_path, h.name) for h in handle.hooks()}
    assert ("transformer", "swap.forward") in names and ("transformer_2", "swap.forward") in names
    assert (PIPELINE, "ownership") in names
    handle.disable()
    assert handle.hooks() == ()
    assert "forward" not in pipe.transformer.__dict__
