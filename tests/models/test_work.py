"""`price_request`: an admitted request never costs more transformer forwards than it was priced, on every
embedded tiny model, with guidance on and off, a negative prompt or none, several outputs and a batch."""

from __future__ import annotations

import pytest

from layerstream.models.work import TEXT_TOKEN_WORK, price_request
from layerstream.omni import Omni
from layerstream.request import GenerationRequest

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast


def _count_forwards(pipeline) -> list[int]:
    """A counter of the transformers' forwards, one per output of each call's batch."""
    counted = [0]

    def hook(module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        counted[0] += hidden.shape[0]

    for name in ("transformer", "transformer_2"):
        if getattr(pipeline, name, None) is not None:
            getattr(pipeline, name).register_forward_pre_hook(hook, with_kwargs=True)
    return counted


CASES = {
    "tiny-wan": [{}, {"guidance_scale": 1.0}, {"n": 2, "num_inference_steps": 2}, {"negative_prompt": "blur"}],
    "tiny-flux": [{}, {"negative_prompt": "blur"}, {"true_cfg_scale": 2.0, "negative_prompt": "blur"}, {"guidance_scale": 1.0}],
    "tiny-qwen-image": [{}, {"guidance_scale": 1.0}, {"num_inference_steps": 2, "n": 2}],
}


@pytest.mark.parametrize("model", list(CASES))
def test_the_forwards_of_an_admitted_request_never_exceed_its_price(model):
    omni = Omni(model, offload=False)
    counted = _count_forwards(omni.pipeline)
    for fields in CASES[model]:
        request = GenerationRequest(prompt="a fox", **fields)
        price = omni.price(request)
        before = counted[0]
        for output in request.outputs():
            omni.run(output)
        assert counted[0] - before == price.forwards, (fields, price)  # exact on the tiny models: never more
    batch = [GenerationRequest(prompt=prompt, seed=seed, num_inference_steps=2) for seed, prompt in enumerate(["a", "b"])]
    before = counted[0]
    omni.run_batch(batch)
    assert counted[0] - before == sum(omni.price(request).forwards for request in batch)


def test_the_price_counts_guidance_outputs_and_the_texts():
    omni_rules = Omni("tiny-wan", offload=False).rules
    plain = price_request(omni_rules, GenerationRequest(prompt="a fox"), max_side_pixels=1024)
    assert (plain.pixels, plain.num_frames, plain.num_inference_steps, plain.passes, plain.texts) == (4096, 9, 4, 2, 2)
    assert plain.work == 4096 * 9 * 4 * 2 + 2 * 512 * TEXT_TOKEN_WORK == 1_343_488  # docs/serving.md says this figure
    unguided = price_request(omni_rules, GenerationRequest(prompt="a fox", guidance_scale=1.0), max_side_pixels=1024)
    assert (unguided.passes, unguided.texts) == (1, 1)
    shorter = price_request(omni_rules, GenerationRequest(prompt="a", n=3, extra_params={"max_sequence_length": 8}), max_side_pixels=1024)
    assert shorter.tokens_per_text == 8 and shorter.forwards == 4 * 2 * 3
