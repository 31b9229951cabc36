"""More behaviours of vllm-omni's offloader that plans and models written for it rely on (issue 26 items 2, 3, 5, 9):
on-demand components that stream, on-demand only where selected in layer mode, declared-but-absent components
skipped, and every field of vllm-omni's current `OffloadPlan`."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch
from plan_toys import raises_naming
from test_plan_cli import fake_loader, run_plan  # noqa: F401 - fake_loader is a fixture
from torch import nn

from layerstream import OffloadPlan, enable_offload
from layerstream.offload import plan_placement
from layerstream.plan.offload_plan import UNSUPPORTED_FIELDS
from layerstream.plan.resolver import resolve_offload_plan
from tests.runtime.runtime_toys import ToyDiT, ToyTextEncoder, run, toy_inputs

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast

DIM = 32
DIT = {"mode": "layer", "components": ["dit"]}
TEXT = {"mode": "layer", "components": ["text_encoder"]}
BOTH = {"mode": "layer", "components": ["dit", "text_encoder"]}
MODULE_ALL = {"mode": "module", "components": ["dit", "text_encoder", "vae"]}


class Staged:
    """The two calls through which a vllm-omni pipeline manages a component's residency, recorded."""

    def load_to_device(self):
        self.calls.append("load_to_device")
        self.to("cpu")  # the test's device

    def offload_to_cpu(self):
        self.calls.append("offload_to_cpu")
        self.to("cpu")


class StagedTextEncoder(Staged, ToyTextEncoder):
    def __init__(self):
        super().__init__(dim=DIM)
        self.calls: list[str] = []


class StagedVAE(Staged, nn.Module):
    def __init__(self):
        super().__init__()
        self.post = nn.Linear(DIM, DIM)
        self.calls: list[str] = []

    def decode(self, h):
        return self.post(h)


class StagedPipeline(nn.Module):
    """A vllm-omni style pipeline whose text encoder and VAE are on demand (the plan is the instance's)."""

    _dit_modules = ["transformer"]
    _encoder_modules = ["text_encoder"]
    _vae_modules = ["vae"]

    def __init__(self, plan: OffloadPlan, vae: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.text_encoder = StagedTextEncoder()
        self.transformer = ToyDiT(dim=DIM)
        self.vae = StagedVAE() if vae else None
        self._offload_plan = plan

    def forward(self, ids, x):
        context = self.text_encoder(ids).mean(dim=1, keepdim=True)
        h = self.transformer(x + context)
        return self.vae.decode(h) if self.vae is not None else h


ON_DEMAND = frozenset({"text_encoder", "vae"})
STREAMING_ENCODER = OffloadPlan(on_demand_component_paths=ON_DEMAND, encoder_block_attrs={"text_encoder": ("encoder.layers",)})
BLOCKLESS_ENCODER = OffloadPlan(on_demand_component_paths=ON_DEMAND)


def _calls(pipe: StagedPipeline) -> dict[str, list[str]]:
    return {"text_encoder": pipe.text_encoder.calls, "vae": pipe.vae.calls}


# --- item 2: on-demand components that stream ---------------------------------------------------------------


def test_a_selected_on_demand_encoder_with_blocks_streams_them():
    pipe = StagedPipeline(STREAMING_ENCODER).eval()
    inputs = toy_inputs(dim=DIM)
    expected = run(pipe, inputs)
    comp = resolve_offload_plan(pipe, BOTH).component("text_encoder")
    assert (comp.action, comp.on_demand, comp.num_blocks) == ("stream", True, 3)
    assert "offload_to_cpu() at enable" in comp.reason
    handle = enable_offload(pipe, BOTH, device="cpu")
    assert _calls(pipe) == {"text_encoder": ["offload_to_cpu"], "vae": []}  # the unselected VAE is left alone
    for _ in range(2):
        assert torch.equal(run(pipe, inputs), expected)
    stats = handle.stats()
    assert stats.per_component["text_encoder"].num_streamed_blocks == 3
    assert stats.per_component["text_encoder"].num_transfers >= 3
    assert stats.max_materialized_blocks <= stats.num_slots
    assert pipe.text_encoder.calls == ["offload_to_cpu"]  # once, at enable: never per call
    handle.disable()
    assert _calls(pipe) == {"text_encoder": ["offload_to_cpu", "load_to_device"], "vae": []}
    assert torch.equal(run(pipe, inputs), expected)


def test_a_selected_on_demand_encoder_without_blocks_is_a_valid_selection():
    pipe = StagedPipeline(BLOCKLESS_ENCODER).eval()
    inputs = toy_inputs(dim=DIM)
    expected = run(pipe, inputs)
    alone = resolve_offload_plan(pipe, TEXT)  # the only text encoder is on demand: the pipeline manages it
    assert (alone.component("text_encoder").action, alone.component("text_encoder").on_demand) == ("on_demand", True)
    assert not alone.streamed
    handle = enable_offload(pipe, BOTH, device="cpu")
    assert handle.plan.component("text_encoder").action == "on_demand"
    assert _calls(pipe) == {"text_encoder": ["offload_to_cpu"], "vae": []}
    assert torch.equal(run(pipe, inputs), expected)
    assert handle.stats().per_component["transformer"].num_streamed_blocks == 4
    handle.disable()
    assert _calls(pipe) == {"text_encoder": ["offload_to_cpu", "load_to_device"], "vae": []}


def test_a_failed_enable_hands_an_on_demand_component_back_to_the_pipeline(monkeypatch):
    from layerstream.runtime.modes import layer_mode

    pipe = StagedPipeline(STREAMING_ENCODER).eval()
    inputs = toy_inputs(dim=DIM)
    expected = run(pipe, inputs)

    def fail_staging(*args, **kwargs):  # fails after offload_to_cpu() was called
        raise RuntimeError("no host memory today")

    monkeypatch.setattr(layer_mode, "_stage_blocks", fail_staging)
    with pytest.raises(Exception, match="no host memory today"):
        enable_offload(pipe, BOTH, device="cpu")
    assert pipe.text_encoder.calls == ["offload_to_cpu", "load_to_device"]  # the rollback gave it back
    assert torch.equal(run(pipe, inputs), expected)


# --- item 3: on demand only where selected, in layer mode ---------------------------------------------------


def test_unselected_on_demand_components_stay_resident():
    pipe = StagedPipeline(STREAMING_ENCODER).eval()
    inputs = toy_inputs(dim=DIM)
    expected = run(pipe, inputs)
    plan = resolve_offload_plan(pipe, DIT)
    for path in ("text_encoder", "vae"):
        assert (plan.component(path).action, plan.component(path).on_demand) == ("resident", False)
        assert "not selected" in plan.component(path).reason
    handle = enable_offload(pipe, DIT, device="cpu")
    assert torch.equal(run(pipe, inputs), expected)
    assert handle.stats().per_component["text_encoder"].device_bytes > 0
    handle.disable()
    assert _calls(pipe) == {"text_encoder": [], "vae": []}


def test_module_mode_swaps_on_demand_components_like_any_other():
    pipe = StagedPipeline(STREAMING_ENCODER).eval()
    inputs = toy_inputs(dim=DIM)
    expected = run(pipe, inputs)
    plan = resolve_offload_plan(pipe, MODULE_ALL)
    assert {c.path: (c.action, c.on_demand) for c in plan.components} == {
        "text_encoder": ("swap", False), "transformer": ("swap", False), "vae": ("swap", False),
    }  # fmt: skip
    handle = enable_offload(pipe, MODULE_ALL, device="cpu")
    assert torch.equal(run(pipe, inputs), expected)
    per = handle.stats().per_component
    assert per["text_encoder"].num_transfers == per["vae"].num_transfers == 1
    handle.disable()
    assert _calls(pipe) == {"text_encoder": [], "vae": []}


# --- item 5: declared but absent is skipped -----------------------------------------------------------------

ABSENT_PLAN = OffloadPlan(block_attrs={"transformer": ("blocks",), "transformer.language_model": ("layers",)})


def test_declared_but_absent_components_are_skipped_with_a_debug_line(caplog):
    pipe = StagedPipeline(ABSENT_PLAN, vae=False).eval()  # _vae_modules names "vae", which is None
    inputs = toy_inputs(dim=DIM)
    expected = run(pipe, inputs)
    with caplog.at_level(logging.DEBUG, logger="layerstream.plan"):
        plan = resolve_offload_plan(pipe, DIT)
    assert {a.path: a.declared_in for a in plan.absent} == {
        "transformer.language_model": "_offload_plan.block_attrs",  # a dotted path whose middle is missing
        "vae": "_vae_modules",
    }
    assert {a.path: a.why for a in plan.absent}["vae"] == "it is None"
    assert "language_model" in {a.path: a.why for a in plan.absent}["transformer.language_model"]
    assert [c.path for c in plan.components] == ["text_encoder", "transformer"]
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert any("transformer.language_model" in m and "absent" in m for m in logged), logged
    assert plan.to_dict()["absent"][0]["path"] in ("transformer.language_model", "vae")
    handle = enable_offload(pipe, DIT, device="cpu")
    assert torch.equal(run(pipe, inputs), expected)
    handle.disable()


def test_a_diffusers_pipelines_optional_component_left_none_is_declared_absent(tiny):
    pipe = tiny.pipeline("WanPipeline", transformer="wan", text_encoder="umt5")  # transformer_2 is None
    plan = resolve_offload_plan(pipe, DIT)
    assert "transformer_2" in {a.path for a in plan.absent}
    assert [c.path for c in plan.streamed] == ["transformer"]


def test_plan_shows_the_declared_absent_row(capsys, fake_loader):  # noqa: F811 - the fixture
    fake_loader["staged"] = StagedPipeline(ABSENT_PLAN, vae=False)
    code, out, err = run_plan(capsys, "staged", "--diffusion-offload-config", json.dumps(DIT))
    assert (code, err) == (0, "")
    rows = [line for line in out.splitlines() if line.startswith(("vae ", "transformer.language_model "))]
    assert len(rows) == 2 and all("declared, absent" in row for row in rows), out
    assert "vae                         declared, absent: declared in _vae_modules, but it is None; skipped" in out
    code, out, err = run_plan(capsys, "staged", "--json", "--diffusion-offload-config", json.dumps(DIT))
    assert {a["path"] for a in json.loads(out)["absent"]} == {"vae", "transformer.language_model"}


# --- item 9: the fields of vllm-omni's current OffloadPlan --------------------------------------------------


def test_every_current_field_left_at_its_default_resolves_as_before():
    defaults = OffloadPlan(
        components=(), phases=(), resident_paths=(), legacy_selections=(), encoder_host_resident_table_attrs={},
        layerwise_resident_layers={}, on_demand_component_paths=frozenset(), block_attrs={}, offload_submodules={},
        resident_dit_paths=frozenset(), encoder_component_types={}, encoder_block_attrs={},
        encoder_dlo_weight_replication=frozenset(),
    )  # fmt: skip
    assert defaults == OffloadPlan()
    pipe = StagedPipeline(defaults)
    assert resolve_offload_plan(pipe, DIT).components == resolve_offload_plan(StagedPipeline(OffloadPlan()), DIT).components


@pytest.mark.parametrize("name", sorted(UNSUPPORTED_FIELDS))
def test_a_field_whose_feature_layerstream_lacks_is_refused_naming_it(name):
    value = {"text_encoder": ("shared",)} if name == "encoder_host_resident_table_attrs" else ("spec",)
    pipe = StagedPipeline(OffloadPlan(**{name: value}))
    with raises_naming("StagedPipeline", f"_offload_plan.{name}", "does not support", "remove it"):
        resolve_offload_plan(pipe, DIT)


def _residency(pipe, config) -> tuple[int, str]:
    choice = plan_placement(pipe, resolve_offload_plan(pipe, config)).residency["transformer"]
    return len(choice.resident_block_paths), choice.reason


def test_the_models_declared_resident_layers_apply_unless_the_config_names_resident_layers():
    pipe = StagedPipeline(OffloadPlan(layerwise_resident_layers={"transformer": 2})).eval()
    assert _residency(pipe, DIT)[0] == 2  # the model's count (no resident_dit_paths needed: it declared it)
    assert "layerwise_resident_layers" in resolve_offload_plan(pipe, DIT).component("transformer").reason
    for resident, kept in ((1, 1), (0, 0), (10, 4)):  # the config's resident_layers wins, an explicit 0 too
        assert _residency(pipe, {**DIT, "layer_options": {"dit": {"resident_layers": resident}}})[0] == kept
    assert _residency(pipe, {**DIT, "layer_options": {"dit": {"prefetch_depth": 2}}})[0] == 2  # not named: the model's
    inputs = toy_inputs(dim=DIM)
    expected = run(pipe, inputs)
    handle = enable_offload(pipe, DIT, device="cpu")
    assert torch.equal(run(pipe, inputs), expected)
    assert "2/4 blocks resident" in handle.stats().residency["transformer"]
    assert handle.stats().per_component["transformer"].num_resident_blocks == 2
    handle.disable()
    assert torch.equal(run(pipe, inputs), expected)


def test_one_declared_resident_count_applies_to_every_resident_dit():
    pipe = StagedPipeline(OffloadPlan(layerwise_resident_layers=3, resident_dit_paths={"transformer"}))
    assert _residency(pipe, DIT)[0] == 3
    with raises_naming("StagedPipeline", "layerwise_resident_layers = 3", "resident_dit_paths"):
        resolve_offload_plan(StagedPipeline(OffloadPlan(layerwise_resident_layers=3)), DIT)
    with raises_naming("StagedPipeline", "text_encoder", "layerwise_resident_layers", "only DiTs"):
        resolve_offload_plan(StagedPipeline(OffloadPlan(layerwise_resident_layers={"text_encoder": 1})), DIT)


class TwoDiTPipeline(StagedPipeline):
    _dit_modules = ["transformer", "transformer_2"]

    def __init__(self, plan: OffloadPlan):
        super().__init__(plan)
        self.transformer_2 = ToyDiT(dim=DIM)

    def forward(self, ids, x):
        return self.transformer_2(super().forward(ids, x))


def test_resident_paths_keep_components_and_unmoved_modules_on_the_device():
    pipe = TwoDiTPipeline(OffloadPlan(resident_paths=("transformer_2",))).eval()
    inputs = toy_inputs(dim=DIM)
    expected = run(pipe, inputs)
    for config in (DIT, {"mode": "module", "components": ["dit"]}):
        second = resolve_offload_plan(pipe, config).component("transformer_2")  # selected, yet kept on the device
        assert second.action == "resident" and "resident_paths" in second.reason
    handle = enable_offload(pipe, DIT, device="cpu")
    assert torch.equal(run(pipe, inputs), expected)
    per = handle.stats().per_component
    assert per["transformer"].num_streamed_blocks == 4 and per["transformer_2"].num_streamed_blocks == 0
    handle.disable()
    assert torch.equal(run(pipe, inputs), expected)
    kept = StagedPipeline(dataclasses.replace(STREAMING_ENCODER, resident_paths=("text_encoder",)))
    with raises_naming("StagedPipeline", "text_encoder", "declared resident"):
        resolve_offload_plan(kept, TEXT)  # the only text encoder is kept resident: nothing can stream
    outside_blocks = StagedPipeline(OffloadPlan(resident_paths=("transformer.embed", "transformer.missing")))
    plan = resolve_offload_plan(outside_blocks, DIT)  # the embedding stays on the device anyway; a missing one is absent
    assert plan.component("transformer").action == "stream"
    assert [a.path for a in plan.absent] == ["transformer.missing"]
    with raises_naming("StagedPipeline", "transformer.blocks.1.proj", "resident_paths", "transformer.blocks.1"):
        resolve_offload_plan(StagedPipeline(OffloadPlan(resident_paths=("transformer.blocks.1.proj",))), DIT)
