"""`GenerationRequest`: frozen, checked once when built (an error names the field, the value and what is
allowed), `to_dict` parsing back, and the command line, the server and `Omni.generate` building the same
request from the same arguments."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from layerstream.models.output_limits import MAX_PROMPT_CHARS, MAX_SEED
from layerstream.request import GenerationError, GenerationRequest

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast


def test_a_request_is_frozen():
    request = GenerationRequest(prompt="a fox")
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.seed = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("fields", "named", "allowed"),
    [
        ({"num_inference_steps": 0}, "num_inference_steps = 0", "an integer from 1 to 1000"),
        ({"height": 32.0}, "height = 32.0", "an integer >= 1"),
        ({"num_frames": True}, "num_frames = True", "an integer >= 1"),
        ({"n": 0}, "n = 0", "an integer >= 1"),
        ({"fps": -1}, "fps = -1", "an integer from 1 to 120"),
        ({"fps": 121}, "fps = 121", "an integer from 1 to 120"),
        ({"guidance_scale": float("nan")}, "guidance_scale = nan", "a number from 0 to 100"),
        ({"guidance_scale": -1.0}, "guidance_scale = -1.0", "a number from 0 to 100"),
        ({"guidance_scale": 100.5}, "guidance_scale = 100.5", "a number from 0 to 100"),
        ({"timeout": 0}, "timeout = 0", "a number of seconds > 0 and at most 86400"),
        ({"seed": -1}, "seed = -1", f"an integer from 0 to {MAX_SEED}"),
        ({"seed": "2"}, "seed = '2'", "an integer"),
        ({"seed": MAX_SEED, "n": 2}, f"seed = {MAX_SEED}", f"from 0 to {MAX_SEED - 1} (output i of n = 2 uses seed + i)"),
        ({"prompt": None}, "prompt = None", "a text"),
        ({"negative_prompt": "x" * (MAX_PROMPT_CHARS + 1)}, "negative_prompt = a text of 10,001 characters", "at most 10,000"),
    ],
)
def test_a_bad_value_is_refused_naming_the_field_the_value_and_what_is_allowed(fields, named, allowed):
    with pytest.raises(GenerationError) as raised:
        GenerationRequest(**{"prompt": "a fox", **fields})
    message = str(raised.value)
    assert message.startswith(f"{named} is not valid; expected ") and allowed in message
    assert raised.value.field == named.split(" = ")[0]


def test_replacing_a_field_checks_it_again():
    request = GenerationRequest(prompt="a fox")
    with pytest.raises(GenerationError, match="width = 0"):
        dataclasses.replace(request, width=0)


def test_to_dict_parses_back_and_unknown_keys_are_refused():
    request = GenerationRequest(
        prompt="a fox", negative_prompt="blur", height=32, width=48, num_frames=5, num_inference_steps=3,
        guidance_scale=4.5, seed=7, n=2, fps=8, max_side_pixels=512, timeout=30.0,
    )  # fmt: skip
    data = request.to_dict()
    assert data["seed"] == 7 and data["n"] == 2 and set(data) == {f.name for f in dataclasses.fields(request)}
    assert GenerationRequest.from_dict(data) == request
    with pytest.raises(GenerationError, match="num_inference_step is not a generation argument"):
        GenerationRequest.from_dict({**data, "num_inference_step": 3})
    with pytest.raises(GenerationError, match="fps = 0"):
        GenerationRequest.from_dict({**data, "fps": 0})


def test_outputs_and_batch_shape():
    request = GenerationRequest(prompt="a fox", seed=10, n=3, height=32, timeout=5.0)
    assert request.seeds == (10, 11, 12)
    assert [(o.seed, o.n) for o in request.outputs()] == [(10, 1), (11, 1), (12, 1)]
    other = GenerationRequest(prompt="a cat", seed=1, fps=8, height=32)
    assert request.batch_shape() == other.batch_shape()  # prompt, seed, n, fps and timeout may differ in a batch
    assert request.batch_shape() != dataclasses.replace(other, height=48).batch_shape()
    # extra_params is part of the shape (the server's batching key): only equal ones share a pipeline call
    euler = dataclasses.replace(other, extra_params={"sample_solver": "euler"})
    assert euler.batch_shape() != other.batch_shape() != dataclasses.replace(other, extra_params={"sample_solver": "unipc"})
    assert euler.batch_shape() == dataclasses.replace(request, extra_params={"sample_solver": "euler"}).batch_shape()
    assert {euler.batch_shape(): 1}[dataclasses.replace(euler, seed=5).batch_shape()] == 1  # hashable, by value


# --- extra_params: vllm-omni's extra call arguments, a JSON object ---------------------------------------------


def test_extra_params_is_a_frozen_json_object_equal_by_value():
    given = {"attention_kwargs": {"scale": 0.5}, "sigmas": [1.0, 0.5]}
    request = GenerationRequest(prompt="a fox", extra_params=given)
    given["sigmas"].append(0.1)  # the request holds its own copy ...
    handed = request.extra_params["sigmas"]
    handed.append(0.0)  # ... and hands out fresh ones
    assert request.extra_params == {"attention_kwargs": {"scale": 0.5}, "sigmas": [1.0, 0.5]}
    assert GenerationRequest(prompt="a fox", extra_params={}) == GenerationRequest(prompt="a fox", extra_params=None)
    assert GenerationRequest(prompt="a fox").extra_params == {} and GenerationRequest.from_dict(request.to_dict()) == request
    assert request.to_dict()["extra_params"] == {"attention_kwargs": {"scale": 0.5}, "sigmas": [1.0, 0.5]}


@pytest.mark.parametrize(
    ("extra_params", "named", "allowed"),
    [
        ([["sample_solver", "euler"]], "extra_params", "a JSON object of call arguments"),
        ({"sigmas": [1.0, float("nan")]}, "extra_params.sigmas[1]", "a JSON value (null, a boolean, a finite number"),
        ({"attention_kwargs": {1: 2}}, "extra_params.attention_kwargs.1", "an object with text keys"),
        ({"num_inference_steps": 30}, "extra_params.num_inference_steps", "the num_inference_steps field itself"),
        ({"flow_shift": 5.0}, "extra_params.flow_shift", "the flow_shift field itself"),
        ({"generator": 3}, "extra_params.generator", "seed instead"),
        ({"num_videos_per_prompt": 2}, "extra_params.num_videos_per_prompt", "n instead"),
        ({"output_type": "pil"}, "extra_params.output_type", "encodes it itself"),
    ],
)
def test_extra_params_refuses_what_is_no_json_object_and_the_keys_the_request_sets(extra_params, named, allowed):
    with pytest.raises(GenerationError) as raised:
        GenerationRequest(prompt="a fox", extra_params=extra_params)
    assert str(raised.value).startswith(f"{named} = ") and allowed in str(raised.value)
    assert raised.value.field == named


def test_extra_params_nested_past_the_limit_is_refused_without_recursing():
    deep: list = []
    for _ in range(5000):  # a value built in Python: no parser bounded it
        deep = [deep]
    with pytest.raises(GenerationError, match=r"^extra_params = a value nested deeper than 32 is not valid; expected at most 32 levels"):
        GenerationRequest(prompt="a fox", extra_params={"a": deep})
    within = {"a": [[[1]]]}
    assert GenerationRequest(prompt="a fox", extra_params=within).extra_params == within


def test_json_text_is_read_within_a_depth_and_a_size_limit():
    from layerstream.json_object import MAX_JSON_CHARS, JsonLimitError, read_json_text

    assert read_json_text('{"a": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["}') == {"a": "[" * 36}  # brackets in a text: no depth
    assert read_json_text(b"[" * 32 + b"]" * 32) == eval("[" * 32 + "]" * 32)
    with pytest.raises(JsonLimitError, match="deeper than 32 levels, the limit"):
        read_json_text("[" * 33 + "]" * 33)
    with pytest.raises(JsonLimitError, match="deeper than 32 levels"):
        read_json_text("[" * 100_000)  # never closed: refused for its depth before the parser sees it
    with pytest.raises(JsonLimitError, match=f"too long; at most {MAX_JSON_CHARS:,}"):
        read_json_text(" " * MAX_JSON_CHARS + "1")
    with pytest.raises(ValueError, match="Expecting value"):
        read_json_text("[1,]")


# --- the three entry points build one request ----------------------------------------------------------------


class _CapturingOmni:
    """Stands in for `Omni` as `self`: `generate` builds the request and hands it to `run`, which keeps it."""

    def run(self, request, *, on_step=None, keep_raw=False):
        self.request = request
        return request


def _from_cli(argv: list[str]) -> GenerationRequest:
    from layerstream.cli.generate_cmd import add_arguments, request_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return request_from_args(parser.parse_args(argv))


def _from_omni(*args, **kwargs) -> GenerationRequest:
    from layerstream.omni import Omni

    return Omni.generate(_CapturingOmni(), *args, **kwargs)


def test_the_cli_the_server_and_omni_build_the_same_request():
    from layerstream.server.jobs.requests import VideoJobForm
    from layerstream.server.schemas import ImageGenerationRequest, VideoGenerationRequest

    cli = _from_cli([
        "--prompt", "a fox", "--negative-prompt", "blur", "--width", "48", "--height", "32", "--num-frames", "5",
        "--steps", "3", "--guidance-scale", "4.5", "--seed", "7", "--fps", "8", "--extra-params", '{"sample_solver": "euler"}',
    ])  # fmt: skip
    body = VideoGenerationRequest.model_validate_json(
        '{"prompt": "a fox", "negative_prompt": "blur", "size": "48x32", "num_frames": 5, "num_inference_steps": 3,'
        ' "guidance_scale": 4.5, "seed": 7, "fps": 8, "extra_params": {"sample_solver": "euler"}}'
    )
    server = body.generation_request(seed=body.seed)
    omni = _from_omni(
        "a fox", "blur", width=48, height=32, num_frames=5, num_inference_steps=3, guidance_scale=4.5, seed=7, fps=8,
        extra_params={"sample_solver": "euler"},
    )  # fmt: skip
    assert cli == server == omni
    form = VideoJobForm.model_validate({"prompt": "a fox", "extra_params": '{"sample_solver": "euler"}'})
    assert form.extra_params == omni.extra_params  # a form's field is the object's JSON text
    # and with every default left to the model
    image_body = ImageGenerationRequest.model_validate_json('{"prompt": "a cat", "seed": 0}')
    assert _from_cli(["--prompt", "a cat"]) == image_body.generation_request(seed=0) == _from_omni("a cat")


def test_the_cli_names_the_flag_of_a_value_the_request_refuses():
    from layerstream.cli.common import CliError
    from layerstream.cli.generate_cmd import request_from_args

    args = argparse.Namespace(
        prompt="a fox", negative_prompt=None, height=None, width=None, num_frames=None, num_inference_steps=None,
        guidance_scale=None, seed=-1, fps=16, max_side_pixels=2048,
    )  # fmt: skip
    with pytest.raises(CliError, match=r"^--seed: -1 is not allowed \(an integer from 0 to"):
        request_from_args(args)


# each body's own caps beyond the request's table, and why: serving policies, not what a request may be
SERVER_CAPS = {"n": "MAX_IMAGES_PER_REQUEST: outputs per request", "width": "the size's six digits", "height": "the size's six digits"}


def _schema_bounds(prop: dict) -> dict:
    """A body property's bounds as pydantic's `Field` takes them (ge, gt, le), from its JSON schema."""
    node = next((n for n in prop.get("anyOf", [prop]) if n.get("type") in ("integer", "number")), {})
    names = {"minimum": "ge", "exclusiveMinimum": "gt", "maximum": "le"}
    return {names[k]: v for k, v in node.items() if k in names}


def test_every_edge_takes_the_request_tables_bounds():
    """The HTTP bodies (synchronous and job, JSON and form), the command line's flags and `Omni.generate` take
    each field within `FIELD_BOUNDS`, so a bound cannot differ between edges."""
    from layerstream.cli.main import build_parser
    from layerstream.models.request_fields import FIELD_BOUNDS
    from layerstream.server.jobs.requests import ImageJobForm, ImageJobRequest, VideoJobForm, VideoJobRequest
    from layerstream.server.schemas import ImageEditRequest, ImageGenerationRequest, VideoGenerationRequest

    bodies = (ImageGenerationRequest, VideoGenerationRequest, ImageEditRequest, VideoJobRequest, ImageJobRequest, VideoJobForm, ImageJobForm)
    for body in bodies:
        for name, prop in body.model_json_schema()["properties"].items():
            if name in FIELD_BOUNDS and name not in SERVER_CAPS:
                expected = {k: v for k, v in FIELD_BOUNDS[name].schema().items() if k != "allow_inf_nan"}
                assert _schema_bounds(prop) == expected, (body.__name__, name)
    parser = build_parser()
    for flag, name in (("--steps", "num_inference_steps"), ("--guidance-scale", "guidance_scale"), ("--fps", "fps")):
        too_large = FIELD_BOUNDS[name].le + 1
        with pytest.raises(SystemExit):
            parser.parse_args(["generate", flag, str(too_large)])


def test_the_table_has_a_row_per_field_and_each_edge_spells_it_from_there():
    from layerstream.cli.generate_cmd import _FLAGS
    from layerstream.models.model_rules import OPTIONAL_FIELDS
    from layerstream.models.request_fields import OMNI_KEYWORDS, REQUEST_FIELDS
    from layerstream.server.schemas import VideoGenerationRequest

    assert list(REQUEST_FIELDS) == [f.name for f in dataclasses.fields(GenerationRequest)]
    assert set(_FLAGS) == set(OMNI_KEYWORDS) == set(REQUEST_FIELDS) - {"n", "timeout"}  # the server's alone
    assert _FLAGS["num_inference_steps"] == "--steps" and _FLAGS["max_side_pixels"] == "--max-size"
    body = set(VideoGenerationRequest.model_fields)
    assert body & set(REQUEST_FIELDS) == set(REQUEST_FIELDS) - {"height", "width", "max_side_pixels"}  # size, --max-size
    assert OPTIONAL_FIELDS == ("negative_prompt", "guidance_scale_2", "true_cfg_scale", "boundary_ratio", "flow_shift")
    with pytest.raises(GenerationError, match="^n is not a generation argument; expected one of boundary_ratio"):
        _from_omni("a fox", n=2)  # Omni makes one output a call: run_batch for more


@pytest.mark.parametrize("tail", ["", "\\", "x"])
def test_an_unclosed_string_is_matched_to_the_end_so_the_depth_scan_stays_linear(tail):
    """A pattern that fails on an unclosed string is retried from every later quote: a 1 MiB body of escaped
    quotes took hours. Matched to the end instead, every quote is looked at once."""
    import json

    from layerstream.json_object import _STRINGS, read_json_text

    text = '"' + '\\"' * 1000 + tail
    assert _STRINGS.match(text).end() == len(text)
    with pytest.raises(json.JSONDecodeError):
        read_json_text(text)


def test_an_integer_past_a_floats_range_is_weighed_never_an_overflow():
    from layerstream.cli.common import positive_int
    from layerstream.models.request_fields import FieldBound

    huge = 10**400  # math.isfinite(huge) raises OverflowError
    assert not FieldBound(int, ge=1, le=1000).admits(huge) and FieldBound(int, ge=1).admits(huge)
    with pytest.raises(GenerationError, match="num_inference_steps"):
        GenerationRequest(prompt="x", num_inference_steps=huge)
    assert positive_int("1" * 400) == int("1" * 400)  # a flag's value: parsed, the model's rules weigh it later
