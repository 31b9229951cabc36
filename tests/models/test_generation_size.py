"""The generation the host reserve of `host_budget_gb: "auto"` is sized to: the model's defaults where no request
is known (an embedded tiny model's small size, not its diffusers pipeline's 480x832 x 81 frames), the command
line's request, or the largest request a server's caps allow."""

from __future__ import annotations

import pytest

from layerstream.host.reserve import FLOOR_NBYTES, host_reserve_for
from layerstream.models.generation_size import generation_size_for, server_requests
from layerstream.models.size import GenerationSize
from layerstream.models.loading import load_pipeline
from layerstream.models.model_rules import read_model_rules
from layerstream.omni import Omni
from layerstream.plan.resolver import resolve_offload_plan
from layerstream.config.offload_config import parse_offload_config
from layerstream.server.settings import ServeSettings

AUTO = {"mode": "layer", "components": ["dit"], "host_budget_gb": "auto"}


@pytest.fixture(scope="module")
def tiny_wan():
    return load_pipeline("tiny-wan")


def test_without_a_request_it_is_the_models_defaults(tiny_wan):
    rules = read_model_rules(tiny_wan, "tiny-wan")
    size = generation_size_for(rules)
    assert (size.height, size.width, size.num_frames) == (rules.default_height, rules.default_width, rules.default_num_frames)
    assert size.height < 480 and size.source == "the model's defaults"  # not the diffusers pipeline's own defaults


def test_a_request_gives_its_own_size_and_the_model_the_rest(tiny_wan):
    rules = read_model_rules(tiny_wan, "tiny-wan")
    size = generation_size_for(rules, GenerationSize(height=128, source="the request's size"))
    assert (size.height, size.width, size.num_frames) == (128, rules.default_width, rules.default_num_frames)
    assert size.source == "the request's size"


def test_a_servers_caps_give_the_largest_request_they_allow(tiny_wan):
    rules = read_model_rules(tiny_wan, "tiny-wan")
    settings = ServeSettings(max_side_pixels=256, max_frames=33, max_work=256 * 256 * 33 * 10)
    size = generation_size_for(rules, server_requests(settings))
    assert (size.height, size.width, size.num_frames) == (256, 256, 33)  # every cap reached, none passed
    tight = generation_size_for(rules, server_requests(ServeSettings(max_side_pixels=256, max_frames=33, max_work=256 * 256 * 10)))
    assert tight.num_frames == 9 and tight.height * tight.width * tight.num_frames <= 256 * 256 * 10  # the work cap: frames first
    assert (tight.num_frames - 1) % rules.frame_multiple == 0 and tight.height % rules.size_multiple == 0
    assert "server" in size.source


def test_the_reserve_grows_with_the_generation_it_is_sized_to(tiny_wan):
    rules = read_model_rules(tiny_wan, "tiny-wan")
    plan = resolve_offload_plan(tiny_wan, parse_offload_config(AUTO))
    default = host_reserve_for(tiny_wan, plan, None, device_is_host=True, generation=generation_size_for(rules))
    asked = GenerationSize(height=720, width=1280, num_frames=81, source="the request's size")
    large = generation_size_for(rules, asked)
    served = host_reserve_for(tiny_wan, plan, None, device_is_host=True, generation=large)
    assert default.nbytes == FLOOR_NBYTES and "size: the model's defaults" in default.describe()
    assert served.nbytes > 3e9 and "720x1280 x 81 frames" in served.describe() and "size: the request's size" in served.describe()


def test_omni_sizes_the_auto_reserve_to_its_models_defaults():
    omni = Omni(model="tiny-wan", diffusion_offload_config=AUTO)
    try:
        reason = omni.stats().host_budget
        size = generation_size_for(omni.rules)
        assert f"estimated for {size.height}x{size.width} x {size.num_frames} frames" in reason
        assert "size: the model's defaults" in reason and "reserve (estimated) 0.15 GB" in reason
    finally:
        omni.close()
