"""The server's batching with a transformer from a GGUF file (`components=`): two queued requests run as one
pipeline call, each answered with its own PNG, equal to `Omni` generating each alone up to the last bits of a
batched matmul (`tests/omni/test_generate_batch.py`'s tolerance), served in this process; /health names the file
by its name alone."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("gguf")

from layerstream import Omni  # noqa: E402
from layerstream.models import ensure_tiny_model  # noqa: E402
from layerstream.server.schemas import ImageGenerationRequest  # noqa: E402
from layerstream.server.service import GenerationService  # noqa: E402
from layerstream.server.settings import ServeSettings  # noqa: E402
from serve_harness import decode_png  # noqa: E402
from tests.models.single_files import write_gguf  # noqa: E402

SHAPE = dict(height=32, width=32, num_inference_steps=2)


def test_two_queued_requests_on_a_gguf_transformer_share_one_call_with_their_own_outputs(tmp_path):
    from diffusers import FluxTransformer2DModel

    state = FluxTransformer2DModel.from_pretrained(ensure_tiny_model("tiny-flux"), subfolder="transformer").state_dict()
    write_gguf(tmp_path / "flux.gguf", state, {"ff": "Q4_0", "": "Q8_0"}, arch="flux")
    components = {"transformer": str(tmp_path / "flux.gguf")}
    omni = Omni("tiny-flux", {"mode": "layer", "components": ["dit"]}, device="cpu", components=components)
    asked = [("a red fox", 1), ("a grey cat", 2)]
    alone = [omni.generate(prompt, seed=seed, **SHAPE).frames[0] for prompt, seed in asked]
    service = GenerationService(omni, ServeSettings(port=0, shutdown_timeout=0, max_batch_size=2, batch_wait_ms=30_000))
    assert service.facts["model_source"]["components"] == {"transformer": "flux.gguf"}  # its name, never its path
    service.start()
    try:
        bodies = [ImageGenerationRequest(prompt=p, size="32x32", num_inference_steps=2, seed=s) for p, s in asked]
        jobs = [service.submit(service.prepare(body)) for body in bodies]  # the second fills the batch: it starts
        outputs = [job.future.result(120) for job in jobs]
    finally:
        stopped = service.stop()
        omni.close()
    assert stopped and [o.usage.batch_size for o in outputs] == [2, 2]
    for output, single in zip(outputs, alone):
        (png,) = output.files
        batched = decode_png(png).astype(int)
        assert batched.shape == single.shape and np.abs(batched - single).max() <= 1  # rounding of a last bit
    assert np.abs(decode_png(outputs[0].files[0]).astype(int) - decode_png(outputs[1].files[0])).max() > 8
