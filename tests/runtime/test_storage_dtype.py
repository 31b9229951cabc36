"""`layer_options.<component>.storage_dtype`: streamed blocks are stored and moved in float8 and cast back on the
device. The output is bit-identical to diffusers' layerwise casting of the same model resident; the bytes moved
per forward are about half those of a bfloat16 model streamed as it is; enabling stays a transaction."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from layerstream import OffloadError, UnsupportedUseError, enable_offload  # noqa: E402
from layerstream.config.offload_config import OffloadConfigError  # noqa: E402
from layerstream.plan.resolved import lookup  # noqa: E402
from layerstream.runtime.forms.float8 import float8_forms  # noqa: E402
from layerstream.runtime.stores.local_store import LocalHostStore  # noqa: E402
from tests.runtime.tiny_pipelines import dit_components, generate, load  # noqa: E402

FP8 = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


def _config(storage_dtype: str, components=("dit",)) -> dict:
    options = {name: {"storage_dtype": storage_dtype} for name in components}
    return {"mode": "layer", "components": list(components), "layer_options": options}


def _cast_resident(pipe, storage_dtype: torch.dtype, config: dict) -> None:
    """diffusers' layerwise casting of each component `config` streams, limited to its streamed blocks:
    storage_dtype rounds only the bytes that cross the link (on tiny Wan's DiTs that is everything diffusers
    casts; Flux also casts its embedders, which stay resident)."""
    from diffusers.hooks import apply_layerwise_casting

    from layerstream.plan.resolver import resolve_offload_plan
    from layerstream.runtime.forms.cast_rule import skip_patterns_for

    for comp in resolve_offload_plan(pipe, config).streamed:
        module = lookup(pipe, comp.path)
        blocks = tuple(p[len(comp.path) + 1 :] + "." for stack in comp.stacks for p in stack.block_paths)
        # the tensors themselves, not copies: a resident layer keeps its storage, and with it its address
        original = {
            name: ({n: p.data for n, p in sub._parameters.items() if p is not None}, dict(sub._buffers))
            for name, sub in module.named_modules()
        }
        compute_dtype = next(module.parameters()).dtype
        apply_layerwise_casting(module, storage_dtype, compute_dtype, skip_modules_pattern=skip_patterns_for(module))
        for sub_name, sub in module.named_modules():
            registry = getattr(sub, "_diffusers_hook", None)
            if registry is None or registry.get_hook("layerwise_casting") is None or (sub_name + ".").startswith(blocks):
                continue
            # a resident layer: keep it exactly as loaded, storage included (the hook's casts are then no-ops)
            registry.get_hook("layerwise_casting").storage_dtype = compute_dtype
            params, buffers = original[sub_name]
            for n, data in params.items():
                sub._parameters[n].data = data
            sub._buffers.update(buffers)


def _snapshot(pipe) -> dict[str, torch.Tensor]:
    return {f"{c}.{k}": v.clone() for c in dit_components(pipe) for k, v in getattr(pipe, c).state_dict().items()}


@pytest.mark.parametrize(
    "storage_dtype, components",
    [("float8_e4m3fn", ("dit",)), ("float8_e5m2", ("dit",)), ("float8_e4m3fn", ("dit", "text_encoder"))],
    ids=["e4m3fn-dit", "e5m2-dit", "e4m3fn-dit+text"],
)
@pytest.mark.parametrize("kind", ["wan", "flux"])
def test_fp8_storage_is_bit_identical_to_diffusers_layerwise_casting(kind, storage_dtype, components):
    resident, streamed = load(kind), load(kind)
    config = _config(storage_dtype, components)
    _cast_resident(resident, FP8[storage_dtype], config)
    with torch.no_grad():
        expected = generate(resident, kind)
        handle = enable_offload(streamed, config, device="cpu")
        assert torch.equal(generate(streamed, kind), expected)
        assert torch.equal(generate(streamed, kind), expected)  # steady state too
        stats = handle.stats()
        assert stats.max_materialized_blocks <= stats.num_slots
        handle.disable()
        # disable gives the weights back in their own dtype, rounded to float8 as stored: the same output
        for name in dit_components(streamed):
            assert all(p.dtype == torch.float32 for p in getattr(streamed, name).parameters())
        assert all(c.storage_dtype == storage_dtype for c in handle.plan.streamed)
        assert torch.equal(generate(streamed, kind), expected)


# diffusers' rule keeps every layer under a "norm" name in its dtype: on Wan those are small (the ratio is about
# 0.5), but Flux's adaptive norms hold a large Linear each (norm1.linear: dim x 6 dim), which stays bfloat16
BYTES_RATIO = {"wan": (0.5, 0.56), "flux": (0.5, 0.7)}


@pytest.mark.parametrize("kind", ["wan", "flux"])
def test_fp8_storage_moves_half_the_bytes_of_bfloat16(kind):
    plain, cast = load(kind).to(torch.bfloat16), load(kind).to(torch.bfloat16)
    with torch.no_grad():
        plain_handle = enable_offload(plain, {"mode": "layer", "components": ["dit"]}, device="cpu")
        generate(plain, kind, num_inference_steps=1)
        cast_handle = enable_offload(cast, _config("float8_e4m3fn"), device="cpu")
        generate(cast, kind, num_inference_steps=1)
    full, low = plain_handle.stats(), cast_handle.stats()
    assert full.num_transfers == low.num_transfers
    ratio = low.bytes_transferred / full.bytes_transferred
    low_bound, high_bound = BYTES_RATIO[kind]
    assert low_bound <= ratio < high_bound, ratio
    assert low.host_bytes / full.host_bytes == pytest.approx(ratio, abs=0.01)
    plain_handle.disable()
    cast_handle.disable()


def test_state_dict_gives_the_stored_dtype_and_load_state_dict_rounds_into_it():
    pipe = load("flux")
    before = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    with torch.no_grad():
        handle = enable_offload(pipe, _config("float8_e4m3fn"), device="cpu")
    state = pipe.transformer.state_dict()
    for key, value in state.items():  # the host store's own bytes (its buffers are slices of larger allocations)
        expected = before[key].to(value.dtype) if value.dtype == torch.float8_e4m3fn else before[key]
        assert torch.equal(value.view(torch.uint8), expected.view(torch.uint8)), key
    assert state["transformer_blocks.0.attn.to_q.weight"].dtype == torch.float8_e4m3fn
    assert state["transformer_blocks.0.attn.to_q.bias"].dtype == torch.float8_e4m3fn
    assert state["transformer_blocks.0.norm1.linear.weight"].dtype == torch.float32  # "norm": never cast
    new = {k: torch.full(v.shape, 0.3, dtype=torch.float32) if v.dtype == torch.float8_e4m3fn else v for k, v in state.items()}
    pipe.transformer.load_state_dict(new)
    handle.disable()
    for key, value in pipe.transformer.state_dict().items():  # every loaded tensor, after the host copies are gone
        expected = torch.full_like(value, 0.3).to(torch.float8_e4m3fn).float() if key in new and state[key].dtype == torch.float8_e4m3fn else before[key]
        assert value.dtype == before[key].dtype and torch.equal(value, expected), key


def test_a_failed_enable_gives_back_the_original_tensors_exactly():
    pipe = load("wan")
    before = _snapshot(pipe)
    first_param = pipe.transformer.blocks[0].attn1.to_q.weight
    first_ptr = first_param.data_ptr()

    class FailingStore(LocalHostStore):
        def stage_(self, layout, device, pin):
            if len(self.blocks) == 1:
                raise RuntimeError("injected staging failure")
            return super().stage_(layout, device, pin)

    def stores(path):
        return FailingStore(float8_forms(lookup(pipe, path), torch.float8_e4m3fn).form)

    with pytest.raises(OffloadError, match="injected staging failure"):
        enable_offload(pipe, _config("float8_e4m3fn"), device="cpu", store_factory=stores)
    after = _snapshot(pipe)
    assert after.keys() == before.keys()
    for key, value in before.items():
        assert after[key].dtype == value.dtype and torch.equal(after[key], value), key
    assert pipe.transformer.blocks[0].attn1.to_q.weight is first_param
    assert first_param.data_ptr() == first_ptr  # the very same storage, not a rounded copy


def test_input_gradients_through_fp8_blocks_match_diffusers_layerwise_casting():
    resident, streamed = load("flux"), load("flux")
    _cast_resident(resident, torch.float8_e4m3fn, _config("float8_e4m3fn"))
    for pipe in (resident, streamed):
        pipe.transformer.requires_grad_(False)
    handle = enable_offload(streamed, _config("float8_e4m3fn"), device="cpu")
    grads = []
    for pipe in (resident, streamed):
        block = pipe.transformer.single_transformer_blocks[0]
        dim = pipe.transformer.config.num_attention_heads * pipe.transformer.config.attention_head_dim
        hidden = torch.randn(1, 8, dim, generator=torch.Generator().manual_seed(1), requires_grad=True)
        context = torch.randn(1, 4, dim, generator=torch.Generator().manual_seed(2))
        temb = torch.randn(1, dim, generator=torch.Generator().manual_seed(3))
        out = block(hidden_states=hidden, encoder_hidden_states=context, temb=temb)
        outputs = out if isinstance(out, tuple) else (out,)
        sum(o.square().sum() for o in outputs).backward()
        grads.append(hidden.grad)
    assert torch.equal(grads[0], grads[1])
    handle.disable()


def test_lora_on_fp8_blocks_is_refused_before_anything_changes():
    pipe = load("flux")
    handle = enable_offload(pipe, _config("float8_e4m3fn"), device="cpu")
    with pytest.raises(UnsupportedUseError, match="storage_dtype"):
        pipe.transformer.fuse_lora()
    handle.disable()


def test_an_unknown_storage_dtype_is_a_config_error():
    with pytest.raises(OffloadConfigError, match=r"layer_options\.dit\.storage_dtype = 'bfloat16'.*float8_e4m3fn"):
        enable_offload(load("flux"), _config("bfloat16"), device="cpu")
