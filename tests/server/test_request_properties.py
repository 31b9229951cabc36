"""Property tests of the request edge, drawn from the field table (`FIELD_BOUNDS`) and each family's declared
``extra_params`` (`FAMILY_ARGUMENTS`), valid and hostile: a JSON body, a multipart form, a url-encoded form, the
synchronous endpoint, the command line and `Omni` answer no 5xx (and raise nothing but a named refusal), every
refusal names a hostile field it was given, and an accepted request runs at most the forwards it was priced.
On tiny-wan; the paths that generate draw few examples."""

from __future__ import annotations

import contextlib
import json
import math
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from layerstream.models.call_arguments import FAMILY_ARGUMENTS, CallArgument
from layerstream.omni import Omni
from layerstream.models.request_fields import FIELD_BOUNDS
from layerstream.request import GenerationError, GenerationRequest
from layerstream.server.app import create_app
from layerstream.server.jobs.manager import JobManager
from layerstream.server.jobs.settings import HistorySettings
from layerstream.server.jobs.store import JobStore
from layerstream.server.service import GenerationService
from layerstream.server.settings import ServeSettings

FEW = settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
SOME = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
VALID = {  # tiny-wan's small requests: each field within its bound and cheap to run
    "num_inference_steps": st.integers(1, 2), "num_frames": st.sampled_from([1, 5]), "guidance_scale": st.floats(0, 8),
    "flow_shift": st.floats(0.5, 20), "seed": st.integers(0, 1000), "fps": st.integers(1, FIELD_BOUNDS["fps"].le),
    "guidance_scale_2": st.floats(0, 8), "boundary_ratio": st.floats(0, 1),  # tiny-wan has two experts
}  # fmt: skip
NOT_TAKEN = ("true_cfg_scale",)
"""Fields tiny-wan cannot take (its call has no true_cfg_scale): any value of them is hostile there."""


DEEP = "<nested past the limit>"
"""Stands for arrays nested 40 deep in a JSON body (within its parser's bound) and 5,000 deep in a form's JSON
text (a RecursionError, and a 500, in a parser without a depth limit)."""


def _deep(value: Any, depth: int) -> Any:
    if value == DEEP:
        nested: list = []
        for _ in range(depth - 1):  # built without recursion: json.loads itself would recurse that deep
            nested = [nested]
        return nested
    return {k: _deep(v, depth) for k, v in value.items()} if isinstance(value, dict) else value


def hostile_number(name: str) -> st.SearchStrategy:
    """Values the field's bound refuses: past either end, a text, an array, a boolean, a huge integer."""
    bound = FIELD_BOUNDS[name]
    low = bound.ge - 1 if bound.ge is not None else bound.gt
    outside = [low] + ([bound.le + 1] if bound.le is not None else [])
    if bound.kind is int:
        outside.append(0.5 + (bound.ge or 0))
    return st.sampled_from([*outside, "x", [1], True, 10**30])


def argument_values(argument: CallArgument, steps: int, *, valid: bool) -> st.SearchStrategy:
    """Values a declared call argument takes (`valid`), or ones it refuses."""
    if not valid:
        wrong = {"text": [["a", "b"], 1], "boolean": ["yes", 1], "object": [{"hidden_states": 1}, [1]]}.get(argument.kind)
        return st.sampled_from(wrong or [argument.high + 1, argument.low - 1, "x", [argument.low]])
    if argument.kind == "integer":
        return st.integers(int(argument.low), int(argument.high))
    if argument.kind == "number":
        return st.floats(argument.low, argument.high)
    if argument.kind == "boolean":
        return st.booleans()
    if argument.kind == "text":
        return st.text(max_size=20)
    if argument.kind == "object":
        return st.fixed_dictionaries({}, optional={k: argument_values(v, steps, valid=True) for k, v in argument.keys.items()})
    top = argument.high  # "steps": strictly decreasing, each in (low, high]
    return st.just([top * (steps - i) / steps for i in range(steps)])


def extra_params(declared: dict[str, CallArgument], steps: int) -> st.SearchStrategy:
    """(an extra_params object, the hostile field it holds or None): declared keys with values they take, and at
    most one hostile part: an undeclared key, a refused value, or nesting past the depth limit."""
    valid = st.fixed_dictionaries({}, optional={k: argument_values(v, steps, valid=True) for k, v in declared.items()})
    wrong_value = st.sampled_from(sorted(declared)).flatmap(
        lambda key: argument_values(declared[key], steps, valid=False).map(lambda value: ({key: value}, f"extra_params.{key}"))
    )
    unknown = st.sampled_from(["latents", "prompt_embeds", "ip_adapter_image_embeds", "shift", "prompt_2"]).map(
        lambda key: ({key: [1]}, f"extra_params.{key}")
    )
    deep = st.just(({"a": DEEP}, "extra_params"))
    hostile = st.one_of(wrong_value, unknown, deep)
    return st.tuples(valid, st.one_of(st.just(({}, None)), hostile)).map(lambda t: ({**t[0], **t[1][0]}, t[1][1]))


@st.composite
def requests(draw, declared: dict[str, CallArgument]) -> tuple[dict[str, Any], set[str]]:
    """(a request's fields, the hostile ones): each field valid, absent or (one of them, at most) hostile."""
    fields = {name: draw(value) for name, value in VALID.items() if draw(st.booleans())}
    hostile: set[str] = set()
    wrong = draw(st.sampled_from([None, *VALID, *NOT_TAKEN]))
    if wrong is not None:
        fields[wrong] = draw(hostile_number(wrong)) if wrong in VALID else draw(st.floats(0.1, 1.0))
        hostile.add(wrong)
    steps = fields["num_inference_steps"] if isinstance(fields.get("num_inference_steps"), int) else 4
    params, wrong_param = draw(extra_params(declared, max(1, min(steps, 1000))))
    if params:
        fields["extra_params"] = params
    if wrong_param:
        hostile.add(wrong_param)
    return fields, hostile


def _forward_counter(pipeline) -> list[int]:
    """A counter of both experts' forwards (one output each: these calls are unbatched)."""
    counted = [0]
    for expert in (pipeline.transformer, pipeline.transformer_2):
        expert.register_forward_pre_hook(lambda *_: counted.__setitem__(0, counted[0] + 1))
    return counted


def _named(error: dict) -> set[str]:
    return {error["param"]} | {detail["param"] for detail in error.get("details") or [] if detail.get("param")}


def _names_one_of(named: set[str], hostile: set[str]) -> bool:
    return any(p == field or p.startswith((f"{field}.", f"{field}[")) or field.startswith(f"{p}.") for p in named for field in hostile)


@contextlib.contextmanager
def _served(tmp_path_factory):
    """tiny-wan served in this process with the job API; `forwards` counts its transformers' forwards."""
    omni = Omni("tiny-wan", device="cpu")
    counted = _forward_counter(omni.pipeline)
    service = GenerationService(omni, ServeSettings(port=0, shutdown_timeout=0))
    jobs = JobManager(service, JobStore(HistorySettings(data_dir=tmp_path_factory.mktemp("data"))))
    try:
        with TestClient(create_app(service, jobs, ui=False), base_url="http://127.0.0.1") as client:
            yield SimpleNamespace(client=client, omni=omni, forwards=counted, declared=dict(omni.rules.call_arguments))
    finally:
        omni.close()


# one server for the job endpoint's tests, one for the synchronous endpoint's: jobs running in the background
# would count into the synchronous requests' forwards
@pytest.fixture(scope="module")
def job_server(tmp_path_factory):
    with _served(tmp_path_factory) as served:
        yield served


@pytest.fixture(scope="module")
def sync_server(tmp_path_factory):
    with _served(tmp_path_factory) as served:
        yield served


def _as_form(fields: dict[str, Any]) -> dict[str, str]:
    def text(value: Any) -> str:
        if isinstance(value, dict):  # extra_params: JSON text, the deep part spliced in as text
            return json.dumps(value).replace(json.dumps(DEEP), "[" * 5000 + "]" * 5000)
        return json.dumps(value) if isinstance(value, (list, bool)) else str(value)

    return {k: text(v) for k, v in fields.items()}


def _check(answer, hostile: set[str]) -> None:
    assert answer.status_code < 500, answer.text
    if answer.status_code == 429:  # accepted, but the queue is full: checked before queueing, so nothing hostile
        assert not hostile, (hostile, answer.text)
    elif answer.status_code >= 400:
        named = _named(answer.json()["error"])
        assert None not in named and named, answer.text  # a refusal names its field
        if hostile:
            assert _names_one_of(named, hostile), (hostile, answer.text)
    else:
        assert not hostile, (hostile, answer.text)


@pytest.mark.parametrize("encoding", ["json", "multipart", "urlencoded"])
def test_the_job_endpoint_refuses_by_name_and_never_answers_5xx(job_server, encoding):
    """A job is queued only for a request with nothing hostile (then cancelled)."""
    served = job_server

    @SOME
    @given(drawn=requests(served.declared))
    def check(drawn):
        fields, hostile = drawn
        body = {"prompt": "a fox", **fields}
        post = {
            "json": lambda: served.client.post("/v1/videos", json=_deep(body, 40)),
            "multipart": lambda: served.client.post("/v1/videos", files={k: (None, v) for k, v in _as_form(body).items()}),
            "urlencoded": lambda: served.client.post("/v1/videos", data=_as_form(body)),
        }[encoding]
        answer = post()
        _check(answer, hostile)
        if answer.status_code == 200:
            served.client.delete(f"/v1/videos/{answer.json()['id']}")

    check()


def test_the_synchronous_endpoint_runs_what_it_accepts_within_its_price(sync_server):
    served = sync_server
    @FEW
    @given(drawn=requests(served.declared))
    def check(drawn):
        fields, hostile = drawn
        before = served.forwards[0]
        answer = served.client.post("/v1/videos/sync", json=_deep({"prompt": "a fox", **fields}, 40))
        _check(answer, hostile)
        if answer.status_code == 200:
            price = served.omni.price(GenerationRequest(prompt="a fox", **_deep(fields, 40)))
            assert served.forwards[0] - before <= price.forwards

    check()


def test_omni_raises_only_a_named_refusal_and_runs_within_its_price():
    omni = Omni("tiny-wan", offload=False)
    counted = _forward_counter(omni.pipeline)

    @FEW
    @given(drawn=requests(dict(omni.rules.call_arguments)))
    def check(drawn):
        fields, hostile = drawn
        if not isinstance(fields.get("fps", 0), int):  # a non-integer fps is not sent here: nor is it hostile then
            fields, hostile = {k: v for k, v in fields.items() if k != "fps"}, hostile - {"fps"}
        before = counted[0]
        try:
            request = GenerationRequest(prompt="a fox", **_deep(fields, 5000))
            omni.run(request)
        except GenerationError as e:
            assert e.field is not None and _names_one_of({e.field}, hostile), (hostile, str(e))
            return
        assert not hostile
        assert counted[0] - before <= omni.price(request).forwards

    check()


def test_the_command_line_exits_2_naming_the_flag_of_a_hostile_value(layerstream_cli, tmp_path):
    flags = {"num_inference_steps": "--steps", "num_frames": "--num-frames", "guidance_scale": "--guidance-scale",
             "flow_shift": "--flow-shift", "seed": "--seed", "fps": "--fps", "boundary_ratio": "--boundary-ratio"}  # fmt: skip

    @FEW
    @given(name=st.sampled_from(sorted(flags)), data=st.data())
    def check(name, data):
        value = data.draw(hostile_number(name)) if name in VALID else 0.5
        shown = json.dumps(value) if isinstance(value, list) else str(value)
        result = layerstream_cli("generate", "--model", "tiny-wan", "--prompt", "fox", flags[name], shown, "--output", str(tmp_path / "x.mp4"))
        assert result.returncode == 2 and flags[name] in result.stderr and len(result.error_lines) == 1, result

    check()


@pytest.mark.fast
@pytest.mark.parametrize("family", sorted(FAMILY_ARGUMENTS))
def test_every_familys_declared_values_are_taken_and_the_refused_ones_named(family):
    """The declaration's own check, for each family: what the strategies draw as valid is taken, what they draw
    as refused is named by its key."""
    declared = dict(FAMILY_ARGUMENTS[family])

    @SOME
    @given(key=st.sampled_from(sorted(declared)), steps=st.integers(1, 8), data=st.data())
    def check(key, steps, data):
        argument = declared[key]
        good = data.draw(argument_values(argument, steps, valid=True))
        assert argument.problem(good, steps) is None, (key, good)
        bad = data.draw(argument_values(argument, steps, valid=False))
        assert argument.problem(bad, steps) is not None, (key, bad)
        assert not (isinstance(bad, float) and math.isnan(bad))

    check()
