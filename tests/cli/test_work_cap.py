"""`generate --max-work` and `plan --max-work`: the request priced by the one function the server prices by
(`models.work.price_request`), refused over the cap in one line naming the figure, the cap and the flag."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from layerstream.cli import generate_cmd, plan_machine
from layerstream.cli.common import CliError

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast

GENERATION = ("--height", "64", "--width", "64", "--num-frames", "9", "--steps", "3")
PRICE = 64 * 64 * 9 * 3 * 2 + 2 * 512 * 1024
"""tiny-wan at GENERATION: pixels x frames x steps x 2 passes (guidance) + prompt and negative prompt x 512 tokens."""
MACHINE = ("--device-memory", "24", "--host-memory", "16")


def test_generate_refuses_a_request_over_the_cap_naming_the_flag_before_loading_the_model(layerstream_cli, tmp_path, monkeypatch):
    """Priced by the model's rules read from its configs (its skeleton): no weight is read for a refusal."""
    from layerstream.models import loading

    def load_model(*args, **kwargs):
        raise AssertionError("the model was loaded for a request its configs price over the cap")

    monkeypatch.setattr(loading, "load_model", load_model)
    out = tmp_path / "fox.gif"
    result = layerstream_cli("generate", "tiny-wan", "--prompt", "fox", *GENERATION, "--output", str(out), "--max-work", str(PRICE - 1))
    assert result.returncode == 2 and not out.exists()
    assert f"= {PRICE:,} is more than the cap of {PRICE - 1:,}" in result.stderr and "--max-work" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_generate_runs_a_request_at_the_cap(layerstream_cli, tmp_path):
    out = tmp_path / "fox.gif"
    result = layerstream_cli("generate", "tiny-wan", "--prompt", "fox", *GENERATION, "--output", str(out), "--max-work", str(PRICE))
    assert result.returncode == 0, result.stderr
    assert out.stat().st_size > 0


def test_plan_refuses_a_generation_over_the_cap_naming_the_flag(layerstream_cli):
    result = layerstream_cli("plan", "tiny-wan", *MACHINE, *GENERATION, "--max-work", str(PRICE - 1))
    assert result.returncode == 2 and result.stdout == ""
    assert f"= {PRICE:,} is more than the cap of {PRICE - 1:,}" in result.stderr and "--max-work" in result.stderr


DEFAULT_PRICE = 64 * 64 * 9 * 4 * 2 + 2 * 512 * 1024
"""tiny-wan's own generation (4 steps): what a plan without a machine is for."""


@pytest.mark.parametrize("machine, price", [(MACHINE, PRICE), ((), DEFAULT_PRICE)], ids=["for a machine", "on this machine"])
def test_plan_states_the_price_under_the_cap(layerstream_cli, machine, price):
    generation = GENERATION if machine else ()  # without a machine the plan is for the model's own generation
    result = layerstream_cli("plan", "tiny-wan", *machine, *generation, "--max-work", str(price))
    assert result.returncode == 0, result.stderr
    work = [line for line in result.stdout.splitlines() if line.startswith("work: ")]
    assert len(work) == 1 and work[0].startswith(f"work: priced at {price:,}, of at most {price:,} (--max-work): ")


def test_the_server_generate_and_plan_price_a_request_alike(layerstream_cli, tmp_path, monkeypatch):
    """One request, priced by each surface: the price `check_work` is handed by generate and plan, and the
    server's `request_price`, are one figure from one function."""
    from layerstream.omni import Omni
    from layerstream.server.limits import read_model_limits, request_price
    from layerstream.server.schemas import VideoGenerationRequest
    from layerstream.server.settings import ServeSettings

    priced = {}

    def recorder(surface):
        def check(price, rules, **_):
            priced[surface] = price
            raise CliError("priced")

        return check

    monkeypatch.setattr(generate_cmd, "check_work", recorder("generate"))
    monkeypatch.setattr(plan_machine, "check_work", recorder("plan"))
    common = ("--negative-prompt", "blur", "--guidance-scale", "3")
    assert layerstream_cli("generate", "tiny-wan", "--prompt", "fox", *GENERATION, *common, "--output", str(tmp_path / "a.mp4")).returncode == 2
    assert layerstream_cli("plan", "tiny-wan", *MACHINE, *GENERATION, "--max-work", str(10**15)).returncode == 2  # plan holds a cap it is given
    omni = Omni("tiny-wan", offload=False)
    limits = read_model_limits(SimpleNamespace(rules=omni.rules, pipeline=omni.pipeline, device="cpu", source=omni.source), ServeSettings())
    body = VideoGenerationRequest(prompt="fox", negative_prompt="blur", guidance_scale=3, size="64x64", num_frames=9, num_inference_steps=3)
    priced["server"] = request_price(body, limits)
    assert priced["generate"] == priced["server"] == priced["plan"]
    assert priced["server"].work == PRICE
