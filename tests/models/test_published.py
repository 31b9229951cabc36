"""The catalogue of published models (`layerstream.models.published`): each builds at its published size, and
`layerstream plan <its Hub id>` asks the Hub when it answers and the catalogue when it cannot, saying which."""

from __future__ import annotations

import json
import socket

import pytest

from hub_standin import select_standin_hub, serving_standin_hub
from layerstream.cli.main import main
from layerstream.models import ensure_tiny_model
from layerstream.models.published import MODELS, published_skeleton

PUBLISHED_BILLIONS = {
    "Wan 2.2 T2V-A14B": 14.3, "Wan 2.2 TI2V-5B": 5.0, "Flux.1-dev": 11.9, "Qwen-Image": 20.4, "HunyuanVideo": 12.8,
}  # fmt: skip
"""Each DiT's parameters (one expert of Wan 2.2 A14B), as its model card gives them."""


@pytest.mark.parametrize("name", list(MODELS))
def test_each_model_builds_at_its_published_size(name):
    pipeline = published_skeleton(MODELS[name])
    billions = sum(p.numel() for p in pipeline.transformer.parameters()) / 1e9
    assert billions == pytest.approx(PUBLISHED_BILLIONS[name], rel=0.05)
    assert all(p.device.type == "meta" for p in pipeline.transformer.parameters())  # no weight exists


@pytest.fixture(scope="module")
def standin():
    with serving_standin_hub() as hub:
        yield hub


def test_plan_asks_the_hub_when_it_answers_and_the_catalogue_when_it_cannot(standin, tmp_path, monkeypatch, capsys):
    hub_id = MODELS["Wan 2.2 TI2V-5B"].hub_id
    select_standin_hub(standin, monkeypatch, tmp_path)
    standin.add_repo(hub_id, ensure_tiny_model("tiny-wan"))  # the Hub's answer: a tiny copy, told apart by size
    assert main(["plan", hub_id, "--json"]) == 0
    from_hub = json.loads(capsys.readouterr().out)
    assert from_hub["model_source"]["origin"] == "hub"

    with socket.socket() as closed:  # a port nothing listens on: the Hub cannot be reached
        closed.bind(("127.0.0.1", 0))
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed.getsockname()[1]}")
    assert main(["plan", hub_id]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(f"{hub_id}: planned from layerstream's catalogue of its published dimensions (cannot reach the Hub")
    assert main(["plan", hub_id, "--json"]) == 0
    from_catalogue = json.loads(capsys.readouterr().out)
    assert from_catalogue["model_source"]["origin"] == "catalogue"
    def total(plan: dict) -> int:
        return sum(component["total_bytes"] for component in plan["components"])

    assert total(from_catalogue) > 1000 * total(from_hub)  # the real model's 5 billion parameters, not the copy
