"""`price_request`: what one request costs its pipeline, in one unit, priced before it runs: the one price the
work cap (--max-work), the server's batches and `Omni.price` compare. A price may exceed a request's cost, never
fall short of it (tests count forwards).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from layerstream.models.model_rules import ModelRules

TEXT_TOKEN_WORK = 1024
"""A text token priced as a latent token of one forward: 16x16 pixels x 4 frames (Wan's VAE x its patch), and a
text encoder's layer costs about what a transformer block's does per token."""
DEFAULT_TEXT_TOKENS = 512
"""Tokens per text where the call declares no ``max_sequence_length`` (T5's and umT5's trained length)."""


@dataclass(frozen=True)
class WorkPrice:
    """The figures one request is priced by: the transformer's forwards over the pixels of every frame, and the
    tokens the text encoder reads (prompts, the negative one under guidance, each declared text argument of
    ``extra_params``, each padded to ``max_sequence_length``); and the price (`work`)."""

    pixels: int
    num_frames: int
    num_inference_steps: int
    passes: int  # transformer forwards per step and output: 2 under classifier-free guidance
    n: int
    texts: int  # per output
    tokens_per_text: int

    @property
    def forwards(self) -> int:
        """Forwards of the transformer, one output's each (a batched forward of k outputs counts k)."""
        return self.num_inference_steps * self.passes * self.n

    @property
    def work(self) -> int:
        return self.pixels * self.num_frames * self.forwards + TEXT_TOKEN_WORK * self.n * self.texts * self.tokens_per_text

    def describe(self) -> str:
        return (
            f"{self.pixels:,} pixels x {self.num_frames} frame(s) x {self.num_inference_steps} step(s) x {self.passes}"
            f" pass(es) x n={self.n} + {self.texts} text(s) x {self.tokens_per_text} token(s) x {TEXT_TOKEN_WORK}"
            f" = {self.work:,}"
        )


def price_request(rules: ModelRules, request: Any, *, max_side_pixels: int) -> WorkPrice:
    """The price of `request` (a `GenerationRequest`) on `rules`' model, its defaults filled in as the call will
    have them; a size the pipeline picks itself priced at the largest side it may pick, squared."""
    shape = rules.filled_for(request)
    passes = 2 if _guided(rules, request) else 1
    declared = rules.call_arguments
    texts = passes + sum(1 for key in request.extra_params if key in declared and declared[key].adds == "text")
    tokens = request.extra_params.get("max_sequence_length")
    if not isinstance(tokens, int) or tokens < 1:
        length = declared.get("max_sequence_length")
        tokens = int(length.high) if length is not None else DEFAULT_TEXT_TOKENS
    side = min(max_side_pixels, rules.geometry.max_side_pixels or max_side_pixels)  # what the model can make
    return WorkPrice(
        pixels=(shape.width or side) * (shape.height or side),
        num_frames=shape.num_frames or 1, num_inference_steps=shape.num_inference_steps, passes=passes, n=request.n,
        texts=texts, tokens_per_text=tokens,
    )  # fmt: skip


def _guided(rules: ModelRules, request: Any) -> bool:
    """Whether the call runs classifier-free guidance (two forwards a step), as diffusers decides: a scale above 1
    (unknown: assumed); where it goes through ``true_cfg_scale`` (Flux, Qwen-Image), with a negative prompt too."""
    guidance = request.guidance_scale if request.guidance_scale is not None else rules.default_guidance_scale
    if "true_cfg_scale" in rules.takes:  # the request's guidance goes there unless it gives true_cfg_scale itself
        scale = request.true_cfg_scale if request.true_cfg_scale is not None else guidance
        negative = request.negative_prompt if request.negative_prompt is not None else rules.default_negative_prompt
        return (scale is None or scale > 1) and negative is not None
    return any(scale is None or scale > 1 for scale in (guidance, request.guidance_scale_2 or guidance))
