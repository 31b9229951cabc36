"""Components from files (`components=`, ``--component``): the spelling of a file (a local path, or
``hf://owner/repo/path[@revision]`` downloaded alone from the Hub), and one clear error naming the component for
each kind of bad input, raised before the model is loaded."""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("gguf")

from hub_standin import select_standin_hub, serving_standin_hub  # noqa: E402
from layerstream.models import ModelLoadError, ensure_tiny_model, load_pipeline  # noqa: E402
from layerstream.models.component_files import HubFile, check_component_specs, parse_component_flags  # noqa: E402
from tests.models.single_files import wan_original_keys, write_gguf  # noqa: E402


@pytest.mark.fast
@pytest.mark.parametrize(
    ("components", "message"),
    [
        ({"transformer": "high.bin"}, r"component transformer = 'high.bin': the file must end in .gguf or .safetensors"),
        ({"transformer": "hf://org/repo"}, r"component transformer = 'hf://org/repo': a Hub file is spelled hf://owner/repo/path"),
        ({"transformer": "hf://org/repo/f.gguf@"}, r"component transformer = .*@': a Hub file is spelled"),
        ({"transformer": "hf://org//f.gguf"}, r"a Hub file is spelled"),
        ({"transformer": ""}, r"component transformer = '': expected a file path or hf://"),
        ({"": "a.gguf"}, r"components: key '' is not a component name"),
    ],
)
def test_a_badly_spelled_component_is_one_line_naming_it(components, message):
    with pytest.raises(ModelLoadError, match=message) as info:
        check_component_specs(components)
    assert "\n" not in str(info.value)


@pytest.mark.fast
def test_the_hub_spelling_and_the_flags():
    assert HubFile.parse("transformer", "hf://city/Wan-GGUF/high/Wan-Q4_K_M.gguf@v2") == HubFile("city/Wan-GGUF", "high/Wan-Q4_K_M.gguf", "v2")
    assert HubFile.parse("transformer", "hf://city/Wan-GGUF/w.gguf") == HubFile("city/Wan-GGUF", "w.gguf", None)
    assert check_component_specs({"transformer": "hf://a/b/c.gguf"}) == {"transformer": "hf://a/b/c.gguf"}
    assert parse_component_flags(["transformer=a.gguf", "transformer_2 = b.gguf"]) == {"transformer": "a.gguf", "transformer_2": "b.gguf"}
    with pytest.raises(ModelLoadError, match=r"--component 'a.gguf': expected NAME=FILE"):
        parse_component_flags(["a.gguf"])
    with pytest.raises(ModelLoadError, match=r"--component transformer is given twice"):
        parse_component_flags(["transformer=a.gguf", "transformer=b.gguf"])
    with pytest.raises(TypeError, match="components must be a dict"):
        check_component_specs(["transformer=a.gguf"])


@pytest.fixture(scope="module")
def expert_gguf(tmp_path_factory):
    """The tiny Wan's high-noise expert as a Q8_0 GGUF file in the original key names."""
    from diffusers import WanTransformer3DModel

    folder = tmp_path_factory.mktemp("gguf")
    state = WanTransformer3DModel.from_pretrained(ensure_tiny_model("tiny-wan"), subfolder="transformer").state_dict()
    write_gguf(folder / "high.gguf", wan_original_keys(state), {"": "Q8_0"})
    del state["blocks.2.ffn.net.2.weight"]
    write_gguf(folder / "short.gguf", wan_original_keys(state), {"": "Q8_0"})
    return folder


def test_wrong_names_and_files_are_one_line_naming_the_component(expert_gguf, tmp_path):
    cases = [
        ({"transformer_3": expert_gguf / "high.gguf"}, r"component transformer_3: the pipeline in \S+ has no such component \(it has scheduler, text_encoder, tokenizer, transformer, transformer_2, vae\)"),
        ({"vae": expert_gguf / "high.gguf"}, r"component vae: the pipeline in \S+ has no such component|component vae: "),
        ({"tokenizer": expert_gguf / "high.gguf"}, r"component tokenizer is a transformers\.\w+, which diffusers cannot load from a single file"),
        ({"transformer": tmp_path / "none.gguf"}, r"component transformer = '\S+none.gguf': no such file"),
        ({"transformer": expert_gguf / "short.gguf"}, r"component transformer: \S+short.gguf lacks 1 weight\(s\) the model needs, e\.g\. blocks\.2\.ffn\.net\.2\.weight"),
    ]
    for components, message in cases[2:]:
        with pytest.raises(ModelLoadError, match=message) as info:
            load_pipeline("tiny-wan", components={k: str(v) for k, v in components.items()})
        assert "\n" not in str(info.value)
    with pytest.raises(ModelLoadError, match=cases[0][1]):
        load_pipeline("tiny-wan", components={k: str(v) for k, v in cases[0][0].items()})


@pytest.fixture(scope="module")
def standin():
    with serving_standin_hub() as hub:
        yield hub


def test_a_hub_file_is_downloaded_alone_at_its_revision(standin, expert_gguf, tmp_path, monkeypatch):
    hub = select_standin_hub(standin, monkeypatch, tmp_path)
    repo = tmp_path / "repo"
    (repo / "high").mkdir(parents=True)
    (repo / "high" / "wan-Q8_0.gguf").write_bytes((expert_gguf / "high.gguf").read_bytes())
    (repo / "other.gguf").write_bytes(b"not fetched")
    hub.add_repo("test-org/wan-gguf", repo, branch="v1")
    pipe = load_pipeline("tiny-wan", components={"transformer": "hf://test-org/wan-gguf/high/wan-Q8_0.gguf@v1"})
    assert type(pipe.transformer.blocks[0].attn1.to_q.weight).__name__ == "GGUFParameter"
    assert hub.downloaded() == ["high/wan-Q8_0.gguf"]
    with pytest.raises(ModelLoadError, match=r"component transformer = 'hf://test-org/wan-gguf/high/wan-Q8_0.gguf': cannot download it: \w+"):
        load_pipeline("tiny-wan", components={"transformer": "hf://test-org/wan-gguf/high/wan-Q8_0.gguf"})  # main: no such branch
    # offline, the cached file is read without a request
    hub.requests.clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pipe = load_pipeline("tiny-wan", components={"transformer": "hf://test-org/wan-gguf/high/wan-Q8_0.gguf@v1"})
    assert hub.requests == [] and pipe.transformer.blocks[0].attn1.to_q.weight.dtype == torch.uint8


def test_generate_takes_component_flags(layerstream_cli, expert_gguf, tmp_path):
    """The summary records the file each component came from: the table names it, the JSON keeps it to make the
    output again."""
    out, high = tmp_path / "out.mp4", str(expert_gguf / "high.gguf")
    args = ("generate", "--model", "tiny-wan", "--component", f"transformer={high}", "--steps", "2", "--height", "32")
    args += ("--width", "32", "--num-frames", "5", "--output", str(out), "--device", "cpu")
    result = layerstream_cli(*args)
    assert result.returncode == 0, result.stderr
    assert out.stat().st_size > 0
    assert f"  from files             transformer {high}" in result.stdout.splitlines()
    as_json = layerstream_cli(*args, "--json")
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout)["source"]["components"] == {"transformer": high}
    bad = layerstream_cli("generate", "--model", "tiny-wan", "--component", "transformer", "--output", str(out))
    assert bad.returncode == 2
    assert bad.error_lines == ["layerstream: error: --component 'transformer': expected NAME=FILE, e.g. transformer=wan-high-Q4_K_M.gguf"]


def test_plan_prices_a_file_component_at_the_bytes_it_keeps(layerstream_cli, expert_gguf, tmp_path):
    """`plan --component` reads the file's header: the expert's blocks at their Q8_0 bytes, as enabling keeps them."""
    from layerstream import Omni

    path = str(expert_gguf / "high.gguf")
    result = layerstream_cli("plan", "tiny-wan", "--component", f"transformer={path}", "--json")
    assert result.returncode == 0, result.stderr
    planned = {c["path"]: c["block_bytes"] for c in json.loads(result.stdout)["components"]}
    omni = Omni("tiny-wan", {"mode": "layer", "components": ["dit"]}, device="cpu", components={"transformer": path})
    kept = omni.handle.stats().per_component
    assert planned["transformer"] < 0.4 * planned["transformer_2"]  # Q8_0 against float32
    assert abs(planned["transformer"] - kept["transformer"].host_bytes) < 0.05 * planned["transformer"], (planned, kept["transformer"].host_bytes)
    assert json.loads(result.stdout)["model_source"]["components"] == {"transformer": path}


def test_a_hub_model_with_a_file_component_downloads_no_weights_of_that_component(standin, expert_gguf, tmp_path, monkeypatch):
    hub = select_standin_hub(standin, monkeypatch, tmp_path)
    hub.add_repo("test-org/tiny-wan", ensure_tiny_model("tiny-wan"))
    pipe = load_pipeline("test-org/tiny-wan", components={"transformer": str(expert_gguf / "high.gguf")})
    fetched = hub.downloaded()
    assert "transformer_2/diffusion_pytorch_model.safetensors" in fetched and "transformer/config.json" in fetched
    assert not [f for f in fetched if f.startswith("transformer/") and f.endswith(".safetensors")], fetched
    assert pipe.transformer.blocks[0].attn1.to_q.weight.dtype == torch.uint8
    assert pipe.transformer.blocks[0].norm2.weight.dtype == torch.float32  # as the others are saved (no bfloat16)
    hub.requests.clear()  # offline, the snapshot without those weights is complete
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    load_pipeline("test-org/tiny-wan", components={"transformer": str(expert_gguf / "high.gguf")})
    assert hub.requests == []


def test_serve_and_plan_refuse_a_malformed_component_flag_before_anything_starts(layerstream_cli):
    for argv in (("serve", "tiny-wan", "--port", "1"), ("plan", "tiny-wan")):
        result = layerstream_cli(*argv, "--component", "transformer=weights.bin")
        assert result.returncode == 2
        assert result.error_lines == ["layerstream: error: component transformer = 'weights.bin': the file must end in .gguf or .safetensors"]


def test_a_quantized_block_is_priced_at_its_logical_flops(expert_gguf):
    from layerstream.machine.step_time import block_flops

    gguf = load_pipeline("tiny-wan", components={"transformer": str(expert_gguf / "high.gguf")})
    plain = load_pipeline("tiny-wan")
    assert gguf.transformer.blocks[0].attn1.to_q.weight.shape != plain.transformer.blocks[0].attn1.to_q.weight.shape
    assert block_flops(gguf.transformer.blocks[0], 64) == block_flops(plain.transformer.blocks[0], 64)


def test_plan_prices_dequantising_a_file_components_weights_at_every_call(expert_gguf):
    """A GGUF block's compute estimate adds its weights' dequantisation at the measured rate (Q8_0 on a CPU device),
    read from the file's header as from the loaded file; a step's compute counts it in every forward."""
    from layerstream.machine.figures import DEQUANT_GBPS_CPU, Machine
    from layerstream.machine.planner import plan_for_machine
    from layerstream.machine.step_time import dequant_seconds
    from layerstream.models.loading import load_skeleton

    components = {"transformer": str(expert_gguf / "high.gguf")}
    skeleton, _ = load_skeleton("tiny-wan", components=components)
    loaded = load_pipeline("tiny-wan", components=components)
    cpu = Machine(device_memory_gb=8, host_memory_gb=16, device_type="cpu")
    block = loaded.transformer.blocks[0]
    quantized = [m.weight for m in block.modules() if hasattr(getattr(m, "weight", None), "quant_type")]
    weights = sum(math.prod(w.quant_shape) for w in quantized)
    assert weights > 0 and dequant_seconds(skeleton.transformer.blocks[0], cpu) == dequant_seconds(block, cpu)
    assert dequant_seconds(block, cpu) == pytest.approx(2 * weights / (DEQUANT_GBPS_CPU["Q8_0"] * 1e9))
    assert dequant_seconds(loaded.transformer_2.blocks[0], cpu) == 0
    plain, _ = load_skeleton("tiny-wan")
    priced, unpriced = plan_for_machine(skeleton, cpu), plan_for_machine(plain, cpu)
    dequant = sum(dequant_seconds(b, cpu) for b in skeleton.transformer.blocks)
    added = priced.stage_seconds_per_step["compute"] - unpriced.stage_seconds_per_step["compute"]
    assert added == pytest.approx(cpu.forwards_per_step * dequant)
    assert "plus dequantising GGUF and fp8_scaled weights at every call" in priced.compute_source


def test_plan_reads_a_hub_file_header_by_ranges_and_downloads_nothing(standin, expert_gguf, tmp_path, monkeypatch, layerstream_cli):
    hub = select_standin_hub(standin, monkeypatch, tmp_path)
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "wan-Q8_0.gguf").write_bytes((expert_gguf / "high.gguf").read_bytes())
    hub.add_repo("test-org/wan-gguf", repo)
    local = layerstream_cli("plan", "tiny-wan", "--component", f"transformer={expert_gguf / 'high.gguf'}", "--json")
    remote = layerstream_cli("plan", "tiny-wan", "--component", "transformer=hf://test-org/wan-gguf/wan-Q8_0.gguf", "--json")
    assert remote.returncode == 0, remote.stderr
    assert json.loads(remote.stdout)["components"] == json.loads(local.stdout)["components"]
    reads = hub.weight_requests()
    assert reads and all(r.range is not None for r in reads), reads
    assert sum(r.nbytes for r in reads) <= (expert_gguf / "high.gguf").stat().st_size
    assert hub.downloaded() == [] and not list(tmp_path.rglob("hub-cache/**/*.gguf"))  # nothing fetched whole
