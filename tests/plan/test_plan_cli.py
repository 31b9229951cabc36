"""`layerstream plan MODEL`: the table, --json, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import sys
import types

import pytest
from torch import nn

import layerstream.models
from layerstream.cli import plan_cmd
from layerstream.cli.main import main
from layerstream.offload import plan_placement
from layerstream.plan.resolver import resolve_offload_plan

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast

EXIT_USAGE = 2


def run_plan(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, out: str, err: str, *fragments: str) -> None:
    assert code == EXIT_USAGE
    assert out == ""
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith("layerstream: error: ")
    for fragment in fragments:
        assert fragment in err


@pytest.fixture
def fake_loader(monkeypatch):
    """Stand in for layerstream.models.loading: `load_pipeline(model)` and `load_skeleton(model)` return what
    the test put in `pipelines`."""
    module = types.ModuleType("layerstream.models.loading")

    class ModelLoadError(ValueError):
        pass

    pipelines: dict[str, object] = {}

    def load_pipeline(model: str, dtype=None):
        if model not in pipelines:
            raise ModelLoadError(f"model {model!r}: no such folder;\nexpected a local diffusers folder or 'tiny-wan'")
        return pipelines[model]

    def load_skeleton(model: str, **_):  # the test's pipeline stands for the skeleton
        return load_pipeline(model), {"model": model, "origin": "folder"}

    from layerstream.models import loading

    module.ModelLoadError = ModelLoadError
    module.is_tiny_model_name, module.pipeline_kind = loading.is_tiny_model_name, loading.pipeline_kind  # the rules read them
    module.load_pipeline = load_pipeline
    module.load_skeleton = load_skeleton
    monkeypatch.setitem(sys.modules, "layerstream.models.loading", module)
    monkeypatch.setattr(layerstream.models, "loading", module)  # `from layerstream.models import loading`
    return pipelines


# --- errors ------------------------------------------------------------------------------------------------


def _must_not_load(args):
    pytest.fail("the model was loaded before the config was checked")


def test_bad_json_config_is_reported_before_loading(capsys, monkeypatch):
    monkeypatch.setattr(plan_cmd, "_skeleton", _must_not_load)
    monkeypatch.setattr(plan_cmd, "_weights", _must_not_load)
    code, out, err = run_plan(capsys, "tiny-wan", "--diffusion-offload-config", "{not json")
    assert_one_line_error(code, out, err, "--diffusion-offload-config", "JSON")


def test_invalid_config_value_is_reported_before_loading(capsys, monkeypatch):
    monkeypatch.setattr(plan_cmd, "_skeleton", _must_not_load)
    monkeypatch.setattr(plan_cmd, "_weights", _must_not_load)
    config = '{"mode": "layer", "components": ["vae"]}'
    code, out, err = run_plan(capsys, "tiny-wan", "--diffusion-offload-config", config)
    assert_one_line_error(code, out, err, "components[0]", "'vae'")


def test_missing_folder(capsys, tmp_path):
    missing = tmp_path / "no-such-model"
    code, out, err = run_plan(capsys, str(missing))
    assert_one_line_error(code, out, err, str(missing))


def test_a_hub_id_offline_is_one_line(capsys):  # the suite runs with HF_HUB_OFFLINE=1 (tests/models/test_hub.py: online)
    code, out, err = run_plan(capsys, "some-org/some-model")
    assert_one_line_error(code, out, err, "some-org/some-model", "HF_HUB_OFFLINE is set")


def test_multi_line_load_errors_become_one_line(capsys, fake_loader):
    code, out, err = run_plan(capsys, "elsewhere")
    assert_one_line_error(code, out, err, "'elsewhere'", "no such folder; expected a local diffusers folder")


def test_resolution_errors_become_one_line(capsys, fake_loader):
    class NoDiTPipeline(nn.Module):
        def __init__(self):
            super().__init__()
            self.vae = nn.Linear(2, 2)

    fake_loader["broken"] = NoDiTPipeline()
    code, out, err = run_plan(capsys, "broken")
    assert_one_line_error(code, out, err, "NoDiTPipeline", "no dit component")


def test_missing_model_argument_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan"])
    assert exit_info.value.code == EXIT_USAGE


# --- output ------------------------------------------------------------------------------------------------


def test_table(capsys, fake_loader, tiny):
    components = {"transformer": "wan", "transformer_2": "wan_2", "text_encoder": "umt5", "vae": "wan_vae"}
    fake_loader["wan"] = tiny.pipeline("WanPipeline", **components)
    config = {"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"resident_layers": 1}}}
    code, out, err = run_plan(capsys, "wan", "--diffusion-offload-config", json.dumps(config))
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == "WanPipeline: mode 'layer', components dit"
    header = lines[2].split()
    assert header[:5] == ["component", "category", "source", "action", "blocks"]
    assert {"streamed", "resident"} <= set(header)
    rows = {line.split()[0]: line.split() for line in lines[4:8]}
    assert rows["transformer"][:5] == ["transformer", "dit", "builtin", "stream", "2"]
    assert "(1 resident)" in lines[4 + list(rows).index("transformer")]
    assert rows["text_encoder"][:4] == ["text_encoder", "text_encoder", "builtin", "resident"]
    assert rows["vae"][:4] == ["vae", "vae", "none", "resident"]
    assert any(line.startswith("total") for line in lines)
    assert any(line.startswith("device estimate: ") and "2 slots" in line for line in lines)
    assert " kB" in out and "KiB" not in out and "MiB" not in out  # decimal units, as the machine plan's


def test_json(capsys, fake_loader, tiny):
    from layerstream.models.generation_size import planned_generation
    from layerstream.models.model_rules import read_model_rules

    pipe = tiny.pipeline("WanPipeline", transformer="wan", text_encoder="umt5")
    fake_loader["wan"] = pipe
    config = {"mode": "layer", "components": ["dit", "text_encoder"]}
    code, out, err = run_plan(capsys, "wan", "--json", "--diffusion-offload-config", json.dumps(config))
    assert (code, err) == (0, "")
    plan = resolve_offload_plan(pipe, config)
    generation = planned_generation(read_model_rules(pipe, "wan"))  # the generation planned for: the model's rules
    placement = plan_placement(pipe, plan, generation=generation).to_dict()
    expected = {**plan.to_dict(), "generation": generation.to_dict(), "placement": placement, "residency": {}}
    assert json.loads(out) == {**expected, "model_source": {"model": "wan", "origin": "folder"}}


# --- the embedded tiny models, loaded for real --------------------------------------------------------------


def test_plan_tiny_wan(capsys):
    code, out, err = run_plan(capsys, "tiny-wan")
    assert code == 0, err
    assert out.startswith("WanPipeline: mode 'layer', components dit\n")
    rows = [line.split() for line in out.splitlines()]
    assert any(row[:4] == ["transformer", "dit", "builtin", "stream"] for row in rows)


@pytest.mark.parametrize("model", ["tiny-wan", "tiny-flux", "tiny-qwen-image"])
def test_plan_tiny_models_json(capsys, model):
    config = '{"mode": "layer", "components": ["dit", "text_encoder"]}'
    code, out, err = run_plan(capsys, model, "--json", "--diffusion-offload-config", config)
    assert code == 0, err
    data = json.loads(out)
    streamed = [c for c in data["components"] if c["action"] == "stream"]
    assert {c["category"] for c in streamed} == {"dit", "text_encoder"}
    assert {c["source"] for c in streamed} == {"builtin"}
    assert all(stack["num_blocks"] > 0 for c in streamed for stack in c["stacks"])


def test_plan_reports_the_auto_residency_choice_and_reason(capsys):
    config = {"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"resident_layers": "auto", "device_budget_gb": 0.0008}}}
    code, out, err = run_plan(capsys, "tiny-wan", "--diffusion-offload-config", json.dumps(config), "--json")
    assert code == 0, err
    residency = json.loads(out)["residency"]
    assert set(residency) == {"transformer", "transformer_2"}
    assert all("blocks resident" in text and "device_budget_gb=0.0008" in text for text in residency.values())
    code, out, err = run_plan(capsys, "tiny-wan", "--diffusion-offload-config", json.dumps({**config, "layer_options": {"dit": {"resident_layers": "auto"}}}))
    assert code == 0 and "decided at enable time" in out and "device_budget_gb" in out


def test_the_table_says_what_host_budget_auto_chose(capsys, monkeypatch):
    import layerstream.offload as offload
    from layerstream.host.memory import HostMemory

    config = json.dumps({"mode": "layer", "components": ["dit"], "host_budget_gb": "auto", "host_reserve_gb": 0})
    code, out, err = run_plan(capsys, "tiny-wan", "--diffusion-offload-config", config)
    assert code == 0, err
    assert 'host budget: host_budget_gb "auto": ' in out and "no disk tier" in out  # this machine holds it all
    code, out, err = run_plan(capsys, "tiny-wan", "--diffusion-offload-config", config, "--json")
    roomy = json.loads(out)["placement"]["host_budget"]
    free = sum(roomy["needs"].values()) + roomy["streamed_bytes"] // 3
    monkeypatch.setattr(offload, "read_host_memory", lambda: HostMemory(free))  # a third of the blocks fit
    code, out, err = run_plan(capsys, "tiny-wan", "--diffusion-offload-config", config)
    assert code == 0, err
    line = next(line for line in out.splitlines() if line.startswith("host budget: "))
    assert "MemAvailable" in line and "a budget of" in line and "the rest is read from disk" in line
    assert "host tier: " in out and "on disk" in out



def test_a_published_model_is_planned_from_the_catalogue_when_the_hub_cannot_be_asked(capsys):
    # the suite runs with HF_HUB_OFFLINE=1: the Hub cannot be asked, and the catalogue answers, saying so
    hub_id = "Wan-AI/Wan2.2-TI2V-5B-Diffusers"  # the smallest; tests/models/test_published.py plans every one
    code, out, err = run_plan(capsys, hub_id.lower(), "--device-memory", "24", "--host-memory", "64")
    assert code == 0, err
    first = out.splitlines()[0]
    assert first.startswith(f"{hub_id}: planned from layerstream's catalogue of its published dimensions (") and "HF_HUB_OFFLINE" in first


def test_a_revision_the_catalogue_does_not_describe_is_the_hub_s_error(capsys):
    code, out, err = run_plan(capsys, "Qwen/Qwen-Image", "--revision", "v2")
    assert_one_line_error(code, out, err, "Qwen/Qwen-Image", "HF_HUB_OFFLINE is set")
