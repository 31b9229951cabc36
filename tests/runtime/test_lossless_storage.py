"""`storage_dtype: "lossless"`: streamed blocks are stored and moved in a lossless code and decoded in the slot.
The embedded tiny models are float32, so every test here loads them in bfloat16 or float16 (the dtypes that are
coded): outputs are bit-identical to the resident pipeline and to streaming the same weights uncompressed, the
stored bytes are fewer, and `state_dict()`, `load_state_dict()`, LoRA fusing and `disable()` see the real values."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from layerstream import UnsupportedUseError, enable_offload  # noqa: E402
from layerstream.models.loading import load_pipeline  # noqa: E402
from layerstream.models.tiny import TINY_MODELS  # noqa: E402
from layerstream.runtime.forms.lossless import LosslessForm  # noqa: E402
from layerstream.runtime.stores.local_store import LocalBlock  # noqa: E402

DITS = {"tiny-wan": ("transformer", "transformer_2"), "tiny-flux": ("transformer",), "tiny-qwen-image": ("transformer",)}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _load(model: str, dtype: torch.dtype):
    pipe = load_pipeline(model, dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _config(components, storage_dtype: str | None = "lossless", **top) -> dict:
    options = {c: {"storage_dtype": storage_dtype} for c in components} if storage_dtype else {}
    return {"mode": "layer", "components": list(components), "layer_options": options, **top}


def _generate(pipe, model: str) -> torch.Tensor:
    kwargs = dict(TINY_MODELS[model].default_kwargs)
    steps = 1 if model == "tiny-flux" else 2  # Wan 2.2: a step for each expert; Qwen-Image's scheduler needs two
    kwargs.update(num_inference_steps=steps, output_type="latent", generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = pipe(prompt="a fox", **kwargs)
    return (out.frames if hasattr(out, "frames") else out.images).clone()


def _weights(pipe, model: str) -> dict[str, torch.Tensor]:
    return {f"{c}.{k}": v.clone() for c in DITS[model] for k, v in getattr(pipe, c).state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


CASES = [(m, c, "bf16") for m in DITS for c in (("dit",), ("dit", "text_encoder"))] + [(m, ("dit", "text_encoder"), "fp16") for m in DITS]


@pytest.fixture(scope="module")
def resident():
    """One pipeline per (model, dtype), with its resident output and weights, shared by the cases below (each
    disables what it enables, and checks the original bits are back)."""
    loaded: dict[tuple[str, str], tuple] = {}

    def get(model: str, dtype: str):
        if (model, dtype) not in loaded:
            pipe = _load(model, DTYPES[dtype])
            loaded[(model, dtype)] = (pipe, _generate(pipe, model), _weights(pipe, model))
        return loaded[(model, dtype)]

    return get


@pytest.mark.parametrize("model, components, dtype", CASES, ids=[f"{m}-{'+'.join(c)}-{d}" for m, c, d in CASES])
def test_lossless_streaming_is_bit_identical_to_resident_and_to_streaming_uncompressed(resident, model, components, dtype):
    pipe, expected, original = resident(model, dtype)
    plain_stats = None
    if dtype == "bf16" and len(components) == 2:  # streaming the same weights uncompressed, once per model
        plain_handle = enable_offload(pipe, _config(components, None), device="cpu")
        assert torch.equal(_generate(pipe, model), expected)
        plain_stats = plain_handle.stats()
        plain_handle.disable()
    handle = enable_offload(pipe, _config(components), device="cpu")
    assert torch.equal(_generate(pipe, model), expected)
    stats = handle.stats()
    if model == "tiny-wan" and dtype == "bf16" and len(components) == 1:
        assert torch.equal(_generate(pipe, model), expected)  # steady state too (both experts, learned order)
    assert stats.max_materialized_blocks <= stats.num_slots
    coded_blocks = [b for b in handle.streamer.blocks if isinstance(b.host, LocalBlock) and isinstance(b.host.form, LosslessForm)]
    assert len(coded_blocks) == len(handle.streamer.blocks)  # every streamed block, the encoder's too
    assert stats.lossless_decoded_bytes == sum(b.host.layout.nbytes for b in coded_blocks)
    assert stats.lossless_stored_bytes == sum(b.host.link_bytes for b in coded_blocks)
    # fewer bytes kept and moved (the tiny models' many tensors under 4 KiB stay raw; float16's coded byte holds
    # the sign and two mantissa bits too)
    ratio = stats.lossless_stored_bytes / stats.lossless_decoded_bytes
    assert ratio < (0.97 if dtype == "bf16" else 0.995), ratio
    assert stats.host_bytes < sum(b.host.layout.nbytes for b in handle.streamer.blocks)
    if plain_stats is not None:
        assert stats.num_transfers == plain_stats.num_transfers
        assert stats.bytes_transferred < plain_stats.bytes_transferred
        assert stats.host_bytes < plain_stats.host_bytes
    handle.disable()
    assert _same(_weights(pipe, model), original)  # the original bits back (and with them the resident output)


def test_state_dict_gives_the_real_values_and_load_state_dict_takes_new_ones():
    model = "tiny-flux"
    resident, coded = _load(model, torch.bfloat16), _load(model, torch.bfloat16)
    original = _weights(coded, model)
    handle = enable_offload(coded, _config(("dit",)), device="cpu")
    assert _same(_weights(coded, model), original)
    # new values with other exponents (doubled: every exponent one up), loaded into both pipelines
    doubled = {k: v * 2 if v.is_floating_point() else v for k, v in resident.transformer.state_dict().items()}
    resident.transformer.load_state_dict(doubled)
    coded.transformer.load_state_dict(doubled)
    assert torch.equal(_generate(coded, model), _generate(resident, model))
    assert _same(_weights(coded, model), _weights(resident, model))
    handle.disable()
    assert _same(_weights(coded, model), _weights(resident, model))


def test_values_the_code_cannot_hold_are_refused_and_the_store_keeps_its_own():
    model = "tiny-flux"
    coded = _load(model, torch.bfloat16)
    handle = enable_offload(coded, _config(("dit",)), device="cpu")
    expected, before = _generate(coded, model), _weights(coded, model)
    noise = {}
    for k, v in coded.transformer.state_dict().items():
        bits = torch.randint(-(1 << 15), 1 << 15, v.shape, generator=torch.Generator().manual_seed(1), dtype=torch.int32)
        noise[k] = bits.to(torch.int16).view(torch.bfloat16) if v.dtype == torch.bfloat16 and v.numel() >= 4096 else v
    with pytest.raises(UnsupportedUseError, match="do not fit the lossless code"):
        coded.transformer.load_state_dict(noise)
    first = next(b for b in handle.streamer.blocks if b.component == "transformer")
    assert _same({k: v for k, v in _weights(coded, model).items() if first.path.split(".", 1)[1] in k},
                 {k: v for k, v in before.items() if first.path.split(".", 1)[1] in k})  # fmt: skip
    handle.disable()
    del expected


def test_lora_fused_on_lossless_blocks_matches_the_resident_pipeline(tmp_path):
    pytest.importorskip("peft")
    from tiny_pipelines import write_lora_file

    model = "tiny-flux"
    resident, coded = _load(model, torch.bfloat16), _load(model, torch.bfloat16)
    lora = write_lora_file(resident, tmp_path, seed=1)
    handle = enable_offload(coded, _config(("dit",)), device="cpu")
    for pipe in (resident, coded):
        pipe.load_lora_weights(str(lora), adapter_name="first")
    assert torch.equal(_generate(coded, model), _generate(resident, model))
    for pipe in (resident, coded):
        pipe.fuse_lora()  # a fuse codes every changed block again
    assert torch.equal(_generate(coded, model), _generate(resident, model))
    for pipe in (resident, coded):
        pipe.unfuse_lora()
        pipe.unload_lora_weights()
    assert torch.equal(_generate(coded, model), _generate(resident, model))
    handle.disable()
    assert torch.equal(_generate(coded, model), _generate(resident, model))


def test_float32_blocks_are_kept_as_they_are():
    coded = _load("tiny-flux", torch.float32)
    handle = enable_offload(coded, _config(("dit",)), device="cpu")
    stats = handle.stats()
    assert stats.lossless_stored_bytes >= stats.lossless_decoded_bytes  # nothing to code: raw bytes
    handle.disable()
