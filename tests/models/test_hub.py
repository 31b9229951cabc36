"""Hub ids wherever a model is taken, against the stand-in Hub on loopback: download, offline reuse, only the
files the pipeline loads, revisions, each failure as one line, the free-space check, and plans made from the
Hub's metadata alone."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hub_standin import select_standin_hub, serving_standin_hub
from layerstream.cli.main import main
from layerstream.models import ModelLoadError, ensure_tiny_model, load_pipeline, resolve_model
from layerstream.models.hub import select_files

REPO = "test-org/tiny-wan"


@pytest.fixture(scope="module")
def standin():
    with serving_standin_hub() as hub:
        yield hub


@pytest.fixture
def hub(standin, tmp_path, monkeypatch):
    """The stand-in Hub, selected through HF_ENDPOINT, with an empty cache of this test's own and a clear
    request log; online (the suite is offline otherwise)."""
    select_standin_hub(standin, monkeypatch, tmp_path)
    standin.add_repo(REPO, ensure_tiny_model("tiny-wan"))
    return standin


def _one_line_exit_2(capsys, argv) -> str:
    assert main(argv) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("layerstream: downloading ")]
    assert len(err) == 1 and err[0].startswith("layerstream: error: "), err
    return err[0]


def test_a_hub_id_downloads_then_loads_offline_with_no_request(hub, monkeypatch):
    source = resolve_model(REPO)
    assert source.origin == "hub" and source.commit == hub.repos[REPO].refs["main"]
    assert source.to_dict() == {**source.to_dict(), "model": REPO, "origin": "hub", "revision": "main"}
    wanted = select_files(_repo_files(hub), _index())
    in_snapshot = sorted(p.relative_to(source.folder).as_posix() for p in source.folder.rglob("*") if p.is_file())
    assert in_snapshot == sorted(wanted) and set(hub.downloaded()) <= set(wanted)  # a file of a known blob is linked
    assert "layerstream-manifest.json" not in in_snapshot  # not part of what the pipeline loads

    hub.requests.clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    again = resolve_model(REPO)
    pipe = load_pipeline(again)
    assert hub.requests == [] and again.folder == source.folder and type(pipe).__name__ == "WanPipeline"


def test_online_reuse_downloads_nothing_again(hub):
    resolve_model(REPO)
    hub.requests.clear()
    resolve_model(REPO)
    assert hub.downloaded() == [] and [r.path for r in hub.requests if "/api/models/" in r.path]


def test_omni_takes_a_hub_id_and_makes_the_same_video_as_the_folder(hub):
    from layerstream import Omni

    from_hub = Omni(model=REPO)
    from_folder = Omni(model="tiny-wan")
    size = {"height": 32, "width": 32, "num_frames": 5}  # a Hub copy of a tiny model has a real model's defaults
    a = from_hub.generate("a fox", num_inference_steps=2, seed=3, guidance_scale=1.0, **size)
    b = from_folder.generate("a fox", num_inference_steps=2, seed=3, guidance_scale=1.0, **size)
    assert from_hub.source.origin == "hub" and torch.equal(torch.as_tensor(a.frames), torch.as_tensor(b.frames))


def test_only_one_weight_format_and_the_variant_asked_for_are_fetched(hub, tmp_path):
    folder = tmp_path / "both-formats"
    shutil.copytree(ensure_tiny_model("tiny-wan"), folder)
    weights = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    state = load_file(weights)
    torch.save(state, folder / "transformer" / "diffusion_pytorch_model.bin")
    save_file({k: v.to(torch.float16) for k, v in state.items()}, folder / "transformer" / "diffusion_pytorch_model.fp16.safetensors")
    hub.add_repo("test-org/both", folder)

    resolve_model("test-org/both")
    fetched = [f for f in hub.downloaded() if f.startswith("transformer/")]
    assert fetched == ["transformer/config.json", "transformer/diffusion_pytorch_model.safetensors"]

    hub.requests.clear()
    fp16 = resolve_model("test-org/both", variant="fp16")
    assert [f for f in hub.downloaded() if f.startswith("transformer/")] == ["transformer/diffusion_pytorch_model.fp16.safetensors"]
    pipe = load_pipeline(fp16)  # diffusers reads the variant, and the plain weights of the other components
    assert pipe.transformer.dtype == torch.float16


def test_file_selection_rules():
    index = {"_class_name": "X", "transformer": ["diffusers", "M"], "text_encoder": ["transformers", "T"], "unused": [None, None]}
    names = [
        "model_index.json", "README.md", "unused/config.json",
        "transformer/config.json",
        "transformer/diffusion_pytorch_model.safetensors.index.json",
        "transformer/diffusion_pytorch_model-00001-of-00002.safetensors",
        "transformer/diffusion_pytorch_model-00002-of-00002.safetensors",
        "transformer/diffusion_pytorch_model.safetensors.index.fp16.json",
        "transformer/diffusion_pytorch_model.fp16-00001-of-00001.safetensors",
        "transformer/diffusion_pytorch_model.bin",
        "text_encoder/config.json", "text_encoder/pytorch_model.bin", "text_encoder/flax_model.msgpack",
    ]  # fmt: skip
    plain = select_files(names, index)
    assert plain == [
        "model_index.json",
        "transformer/config.json",
        "transformer/diffusion_pytorch_model-00001-of-00002.safetensors",
        "transformer/diffusion_pytorch_model-00002-of-00002.safetensors",
        "transformer/diffusion_pytorch_model.safetensors.index.json",
        "text_encoder/config.json",
        "text_encoder/pytorch_model.bin",  # no safetensors: the .bin, never the flax weights
    ]
    fp16 = select_files(names, index, variant="fp16")
    assert [n for n in fp16 if n.startswith("transformer/")] == [
        "transformer/config.json",
        "transformer/diffusion_pytorch_model.fp16-00001-of-00001.safetensors",
        "transformer/diffusion_pytorch_model.safetensors.index.fp16.json",
    ]
    only_variant = ["model_index.json", "transformer/config.json", "transformer/diffusion_pytorch_model.fp16.safetensors"]
    with pytest.raises(ModelLoadError, match="only in the variant.* fp16; pass --variant fp16"):
        select_files(only_variant, {"transformer": ["diffusers", "M"]})


def test_a_revision_is_pinned_and_reported(hub, tmp_path, capsys):
    other = tmp_path / "v1"
    shutil.copytree(ensure_tiny_model("tiny-wan"), other)
    (other / "scheduler" / "scheduler_config.json").write_text(
        json.dumps({**json.loads((other / "scheduler" / "scheduler_config.json").read_text()), "flow_shift": 7.0})
    )
    commit = hub.add_repo(REPO, other, branch="v1")
    source = resolve_model(REPO, revision="v1")
    assert source.commit == commit and source.revision == "v1"
    assert json.loads((source.folder / "scheduler" / "scheduler_config.json").read_text())["flow_shift"] == 7.0
    assert resolve_model(REPO).commit != commit  # main is another commit

    out = tmp_path / "fox.gif"
    small = ["--height", "32", "--width", "32", "--num-frames", "5", "--guidance-scale", "1"]
    hub.requests.clear()
    assert main(["generate", "--model", REPO, "--revision", "v1", "--steps", "1", *small, "--output", str(out), "--json"]) == 0
    assert [r.path for r in hub.requests if r.range is not None] == []  # checked on the cached snapshot: no header read
    summary = json.loads(capsys.readouterr().out)
    summary = summary[0] if isinstance(summary, list) else summary
    assert summary["source"] == {"model": REPO, "origin": "hub", "folder": str(source.folder), "revision": "v1", "commit": commit}


@pytest.mark.parametrize(
    ("model", "revision", "expected"),
    [
        ("test-org/missing", None, "test-org/missing: no such repository on the Hub at .*log in .*HF_TOKEN"),
        (REPO, "v9", "revision 'v9' does not exist; pass a branch, tag or commit"),
        ("test-org/gated", None, "test-org/gated: the repository is gated .*accept its terms at .*HF_TOKEN"),
    ],
)
def test_hub_failures_are_one_line(hub, capsys, model, revision, expected):
    hub.add_repo("test-org/gated", ensure_tiny_model("tiny-wan"), gated=True)
    with pytest.raises(ModelLoadError, match=expected):
        resolve_model(model, revision=revision)
    argv = ["generate", "--model", model, "--steps", "1", *(["--revision", revision] if revision else [])]
    line = _one_line_exit_2(capsys, argv)
    assert model in line
    assert hub.weight_requests() == []


def test_no_network_and_no_cache_is_one_line_and_a_cached_copy_still_runs(hub, monkeypatch, capsys):
    resolve_model(REPO)  # cached now
    with socket.socket() as s:  # a port nothing listens on: the Hub cannot be reached
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setenv("HF_ENDPOINT", closed)
    assert resolve_model(REPO).origin == "hub"  # the cached snapshot, without the network
    line = _one_line_exit_2(capsys, ["generate", "--model", "test-org/never-fetched", "--steps", "1"])
    assert "cannot be reached" in line and "no snapshot of revision main is cached" in line
    with pytest.raises(ModelLoadError) as error:  # in Python: one exception, no chain of the network's
        resolve_model("test-org/never-fetched")
    assert error.value.__cause__ is None and error.value.__context__ is None
    assert str(error.value).endswith("; connect to the network to download it")  # HF_HUB_OFFLINE is not set


def test_too_little_free_space_is_refused_before_any_weight_byte(hub, monkeypatch):
    import layerstream.models.hub as hub_module

    class Usage:
        total, used, free = 10**12, 10**12 - 1000, 1000

    monkeypatch.setattr(hub_module.shutil, "disk_usage", lambda path: Usage)
    with pytest.raises(ModelLoadError, match=r"the download needs [\d.]+ [kMG]?B but the cache.s filesystem .* has [\d.]+ [kMG]?B free"):
        resolve_model(REPO)
    assert hub.weight_requests() == []


def test_a_snapshot_with_only_metadata_is_refused_naming_the_component(hub, monkeypatch, capsys):
    assert main(["plan", REPO]) == 0  # fills the snapshot with JSON files only
    capsys.readouterr()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="no complete weights for component text_encoder"):
        resolve_model(REPO)


def test_plan_from_the_hub_fetches_no_weight_file_and_equals_the_folders_plan(hub, capsys):
    assert main(["plan", REPO, "--json"]) == 0
    from_hub = json.loads(capsys.readouterr().out)
    ranged = [r for r in hub.weight_requests() if r.range is not None]
    assert ranged and all(r.range == "bytes=0-100000" for r in ranged) and hub.downloaded() == [
        f for f in hub.downloaded() if f.endswith(".json")
    ]
    assert not any(f.endswith(".safetensors") for f in hub.downloaded())
    assert main(["plan", "tiny-wan", "--json"]) == 0
    from_folder = json.loads(capsys.readouterr().out)
    source = from_hub.pop("model_source")
    from_folder.pop("model_source")
    # the generation planned for is each name's rules: a Hub id's its pipeline's own (50 steps), tiny-wan's its own
    assert from_hub.pop("generation")["num_inference_steps"]["value"] != from_folder.pop("generation")["num_inference_steps"]["value"]
    assert from_hub == from_folder
    sizes = {f: (ensure_tiny_model("tiny-wan") / f).stat().st_size for f in select_files(_repo_files(hub), _index())}
    assert source["total_download_bytes"] == sum(sizes.values())
    assert source["download_bytes"] == sum(n for f, n in sizes.items() if not f.endswith(".json"))  # the JSON is cached

    assert main(["plan", REPO]) == 0
    table = capsys.readouterr().out
    assert "planned from the Hub's metadata (configs and safetensors headers), nothing downloaded" in table


def test_plan_measure_with_a_hub_id_asks_for_download(hub, capsys):
    line = _one_line_exit_2(capsys, ["plan", REPO, "--device-memory", "24", "--host-memory", "32", "--measure"])
    assert "add --download to fetch it" in line and hub.weight_requests() == []


def test_a_local_folder_spelled_like_a_hub_id_wins(hub, tmp_path):
    local = tmp_path / "test-org" / "tiny-wan"
    shutil.copytree(ensure_tiny_model("tiny-wan"), local)
    source = resolve_model(REPO)
    assert source.origin == "folder" and hub.requests == []


def _repo_files(hub) -> list[str]:
    folder = ensure_tiny_model("tiny-wan")
    return [p.relative_to(folder).as_posix() for p in sorted(folder.rglob("*")) if p.is_file()]


def _index() -> dict:
    return json.loads((Path(ensure_tiny_model("tiny-wan")) / "model_index.json").read_text())


def test_with_nproc_the_snapshot_is_fetched_once_before_the_ranks_and_they_read_the_cache(hub, monkeypatch):
    import argparse

    from layerstream.cli.common import fetch_before_ranks

    args = argparse.Namespace(model=REPO, revision=None, variant=None)
    env = fetch_before_ranks(args)
    assert env == {"HF_HUB_OFFLINE": "1"} and any(f.endswith(".safetensors") for f in hub.downloaded())
    hub.requests.clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", env["HF_HUB_OFFLINE"])  # what each rank then sees
    assert resolve_model(REPO).commit == hub.repos[REPO].refs["main"] and hub.requests == []
    assert fetch_before_ranks(argparse.Namespace(model="tiny-wan", revision=None, variant=None)) == {}
