"""Robustness of layer mode: transactions, exceptions, odd call patterns, odd tensors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from layerstream import enable_offload
from layerstream.errors import OffloadError
from layerstream.runtime.stores.local_store import LocalHostStore
from runtime_toys import ToyDiT, make_my_pipeline, run, snapshot, toy_inputs

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast

DIT = {"mode": "layer", "components": ["dit"]}


def _tensor_identity(module):
    return {k: (t, t.data_ptr()) for k, t in list(module.named_parameters()) + list(module.named_buffers())}


def test_shared_weight_between_block_and_resident_module_is_refused_before_anything_changes():
    pipe = make_my_pipeline()
    pipe.transformer.head.weight = nn.Parameter(pipe.transformer.blocks[1].out.weight.data[:, :32])  # a view: shared
    before = _tensor_identity(pipe)
    hooks_before = [len(m._forward_pre_hooks) for m in pipe.modules()]
    with pytest.raises(OffloadError, match=r"transformer\.(head|blocks\.1\.out)\.weight shares memory"):
        enable_offload(pipe, DIT, device="cpu")
    after = _tensor_identity(pipe)
    assert before.keys() == after.keys()
    assert all(before[k][0] is after[k][0] and before[k][1] == after[k][1] for k in before)
    assert hooks_before == [len(m._forward_pre_hooks) for m in pipe.modules()]


class FailingStore(LocalHostStore):
    """The local store, failing with `error` on the third block it stages (an injected store, test side)."""

    def __init__(self, error: BaseException):
        super().__init__()
        self.error = error
        self.num_staged = 0

    def stage_(self, layout, device, pin):
        self.num_staged += 1
        if self.num_staged == 3:
            raise self.error
        return super().stage_(layout, device, pin)


@pytest.mark.parametrize(
    "error, expected_type, match",
    [
        (RuntimeError("simulated copy failure"), OffloadError, "rolled back.*simulated copy failure"),
        (MemoryError("simulated host allocation failure"), MemoryError, "simulated host allocation failure"),
        (torch.OutOfMemoryError("simulated device allocation failure"), torch.OutOfMemoryError, "simulated device"),
    ],
)
def test_failure_midway_rolls_back(error, expected_type, match):
    pipe = make_my_pipeline()
    ids, x = toy_inputs()
    expected = run(pipe, (ids, x))
    state = snapshot(pipe)
    params = dict(pipe.named_parameters())
    store = FailingStore(error)
    with pytest.raises(expected_type, match=match) as raised:
        enable_offload(pipe, DIT, device="cpu", store_factory=lambda path: store)
    # resource errors come out as themselves (`except torch.OutOfMemoryError` still catches them), after the rollback
    assert type(raised.value) is type(error) or expected_type is OffloadError
    assert store.num_staged == 3
    assert all(p is params[k] for k, p in pipe.named_parameters())
    after = snapshot(pipe)
    assert all(torch.equal(state[k], after[k]) for k in state)
    assert all(not m._forward_pre_hooks and not m._forward_hooks and "forward" not in m.__dict__ for m in pipe.modules())
    assert torch.equal(run(pipe, (ids, x)), expected)
    handle = enable_offload(pipe, DIT, device="cpu")  # and it can still be enabled
    assert torch.equal(run(pipe, (ids, x)), expected)
    handle.disable()


def test_engine_failing_to_start_rolls_back_and_keeps_its_error_type():
    pipe = make_my_pipeline()
    ids, x = toy_inputs()
    expected = run(pipe, (ids, x))

    def engine_factory(device, num_slots):
        raise torch.OutOfMemoryError("simulated: no room for the copy stream")

    with pytest.raises(torch.OutOfMemoryError, match="no room"):
        enable_offload(pipe, DIT, device="cpu", engine_factory=engine_factory)
    assert torch.equal(run(pipe, (ids, x)), expected)
    assert all(not m._forward_pre_hooks and "forward" not in m.__dict__ for m in pipe.modules())


def test_enabling_twice_is_an_error():
    pipe = make_my_pipeline()
    handle = enable_offload(pipe, DIT, device="cpu")
    with pytest.raises(OffloadError, match="already enabled"):
        enable_offload(pipe, DIT, device="cpu")
    handle.disable()
    enable_offload(pipe, DIT, device="cpu").disable()


@pytest.mark.parametrize("second", [["dit"], ["text_encoder"]], ids="+".join)
def test_enabling_twice_names_the_earlier_enable_not_the_first_resident_component(second):
    """Every component of a plan is marked, the resident prompt_model (first in plan order) too: the error
    says the pipeline is already offloaded and what that enable streams, whatever the second one selects."""
    pipe = make_my_pipeline()
    handle = enable_offload(pipe, DIT, device="cpu")
    with pytest.raises(OffloadError) as error:
        enable_offload(pipe, {"mode": "layer", "components": second}, device="cpu")
    message = str(error.value)
    assert "offload is already enabled on this pipeline" in message
    assert "(layer mode, offloading transformer)" in message and "call disable() on its handle" in message
    assert "prompt_model" not in message
    handle.disable()


def test_enabling_over_a_component_enabled_on_its_own_names_that_component():
    pipe = make_my_pipeline()
    handle = enable_offload(pipe.transformer, DIT, device="cpu")
    with pytest.raises(OffloadError, match=r"already enabled on transformer, by an enable_offload on ToyDiT"):
        enable_offload(pipe, DIT, device="cpu")
    handle.disable()


def test_foreign_offload_hooks_are_refused():
    pipe = make_my_pipeline()
    pipe.transformer.blocks[0]._hf_hook = object()  # what accelerate's add_hook_to_module leaves behind
    with pytest.raises(OffloadError, match="accelerate hook"):
        enable_offload(pipe, DIT, device="cpu")
    del pipe.transformer.blocks[0]._hf_hook


def test_diffusers_group_offloading_is_refused():
    from diffusers import WanTransformer3DModel
    from diffusers.hooks import apply_group_offloading

    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, rope_max_seq_len=32,
    )
    apply_group_offloading(model, onload_device=torch.device("cpu"), offload_type="block_level", num_blocks_per_group=1)
    with pytest.raises(OffloadError, match="diffusers hooks"):
        enable_offload(model, DIT, device="cpu")


def test_exception_inside_a_block_leaves_next_forward_correct():
    pipe = make_my_pipeline()
    ids, x = toy_inputs()
    expected = run(pipe, (ids, x))
    handle = enable_offload(pipe, DIT, device="cpu")
    state = {"fail": True}

    def exploding(module, args):
        if state["fail"]:
            raise RuntimeError("boom")

    hook = pipe.transformer.blocks[2].register_forward_pre_hook(exploding)
    with pytest.raises(RuntimeError, match="boom"):
        run(pipe, (ids, x))
    state["fail"] = False
    assert torch.equal(run(pipe, (ids, x)), expected)
    assert handle.streamer.num_materialized == 0
    hook.remove()
    # an exception raised by the block's own forward, too
    original = pipe.transformer.blocks[1].forward
    pipe.transformer.blocks[1].forward = lambda h: (_ for _ in ()).throw(ValueError("inside"))
    with pytest.raises(ValueError, match="inside"):
        run(pipe, (ids, x))
    pipe.transformer.blocks[1].forward = original
    assert torch.equal(run(pipe, (ids, x)), expected)
    handle.disable()


@pytest.mark.parametrize(
    "pattern",
    [
        {"skip": (1,)},
        {"order": [3, 2, 1, 0]},
        {"order": [0, 0, 1, 2, 3]},
        {"order": [0, 2, 1, 3, 3]},
    ],
)
def test_skipped_repeated_and_reordered_blocks(pattern):
    torch.manual_seed(0)
    model = ToyDiT(dim=32, num_blocks=4).eval()
    x = torch.randn(2, 3, 32)
    model.order = pattern.get("order")
    skip = pattern.get("skip", ())
    expected = run(model, (x, skip))
    handle = enable_offload(model, DIT, device="cpu")
    for _ in range(3):
        assert torch.equal(run(model, (x, skip)), expected)
    handle.disable()


def test_prefetch_learns_the_actual_order():
    torch.manual_seed(0)
    model = ToyDiT(dim=32, num_blocks=5).eval()
    model.order = [4, 3, 2, 1, 0]
    x = torch.randn(2, 3, 32)
    handle = enable_offload(model, DIT, device="cpu")
    run(model, (x,))
    assert handle.stats().num_sync_loads >= 4  # declared order predicted wrong
    run(model, (x,))  # the wrap-around transition (last block -> first) is learned as this forward starts
    first = handle.stats().num_sync_loads
    for _ in range(3):
        run(model, (x,))
    assert handle.stats().num_sync_loads == first  # learned: every later block was prefetched
    model.order = [0, 1, 2, 3, 4]  # the order changes: relearned
    for _ in range(4):
        run(model, (x,))
    before = handle.stats().num_sync_loads
    run(model, (x,))
    assert handle.stats().num_sync_loads == before
    handle.disable()


class OddBlock(nn.Module):
    """Mixed dtypes, a transposed parameter, a view parameter, an integer buffer and a tied weight."""

    def __init__(self, dim=16):
        super().__init__()
        self.a = nn.Linear(dim, dim)
        self.b = nn.Linear(dim, dim)
        self.b.weight = self.a.weight  # tied inside the block
        self.t = nn.Parameter(torch.randn(dim, dim).T)  # non-contiguous
        base = torch.randn(3 * dim, dim)
        self.q = nn.Parameter(base[:dim])  # views of one storage
        self.k = nn.Parameter(base[dim : 2 * dim])
        self.bf16 = nn.Parameter(torch.randn(dim).to(torch.bfloat16))
        self.register_buffer("idx", torch.arange(dim, dtype=torch.int64).flip(0))
        self.register_buffer("flag", torch.tensor([True, False]))

    def forward(self, x):
        h = self.b(self.a(x)) + x @ self.t + x @ self.q.T - x @ self.k.T
        h = h[..., self.idx] * self.bf16.float()
        return h * self.flag.float().sum()


class OddModel(nn.Module):
    _layerwise_offload_blocks_attrs = ["blocks"]

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(OddBlock() for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_mixed_dtypes_views_transposed_and_tied_weights():
    torch.manual_seed(0)
    model = OddModel()
    x = torch.randn(2, 16)
    expected = run(model, (x,))
    strides = {k: (p.stride(), p.dtype) for k, p in model.named_parameters(remove_duplicate=False)}
    handle = enable_offload(model, DIT, device="cpu")
    assert torch.equal(run(model, (x,)), expected)
    assert torch.equal(run(model, (x,)), expected)
    handle.disable()
    assert torch.equal(run(model, (x,)), expected)
    assert strides == {k: (p.stride(), p.dtype) for k, p in model.named_parameters(remove_duplicate=False)}
    block = model.blocks[0]
    assert block.a.weight is block.b.weight
    assert not block.t.is_contiguous()
