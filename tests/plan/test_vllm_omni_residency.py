"""vllm-omni's residency rules (issue 36 item 5), tested as its offloader tests do: a pipeline that declares its
roles (``_dit_modules``, ``_encoder_modules``, ``_vae_modules``, optionally ``_resident_modules``) is described by
those lists alone, so an undeclared child is left where it is, untouched; a resident component whose class
defines its own ``to()`` is moved through it exactly once at enable (and back through it at ``disable()``)."""

from __future__ import annotations

import pytest
import torch
from plan_toys import raises_naming
from torch import nn

from layerstream import OffloadPlan, enable_offload
from layerstream.errors import OffloadError
from layerstream.runtime.stores.local_store import LocalHostStore
from layerstream.cli.plan_cmd import format_plan
from layerstream.plan.discovery import defines_own_to
from layerstream.plan.resolver import resolve_offload_plan
from tests.runtime.runtime_toys import ToyDiT, ToyTextEncoder, run, toy_inputs

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast

DIM = 32
LAYER = {"mode": "layer", "components": ["dit", "text_encoder"]}
MODULE = {"mode": "module", "components": ["dit"]}


class CountsTo:
    """A component that stages itself in its own `to()` (as vllm-omni's staged encoders and VAEs do): each call
    is recorded, then torch moves it."""

    def to(self, *args, **kwargs):
        self.to_calls.append(torch.device(args[0] if args else kwargs["device"]))
        return super().to(*args, **kwargs)


class StagedVAE(CountsTo, nn.Module):
    def __init__(self):
        super().__init__()
        self.post = nn.Linear(DIM, DIM)
        self.to_calls: list[torch.device] = []

    def decode(self, h):
        return self.post(h)


class StagedRefiner(CountsTo, nn.Linear):
    def __init__(self):
        super().__init__(DIM, DIM)
        self.to_calls: list[torch.device] = []


class KeptAway(CountsTo, nn.Module):
    """A module the pipeline keeps off the device on purpose: its weights are not even loaded (meta tensors), so
    any move of it would fail."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM, device="meta")
        self.to_calls: list[torch.device] = []


class RolesPipeline(nn.Module):
    """A vllm-omni pipeline that declares its roles (SupportsComponentDiscovery) and one resident module."""

    _dit_modules = ["transformer"]
    _encoder_modules = ["text_encoder"]
    _vae_modules = ["vae"]
    _resident_modules = ["refiner"]
    _offload_plan = OffloadPlan(
        encoder_component_types={"text_encoder": "text_encoder"},
        encoder_block_attrs={"text_encoder": ("encoder.layers",)},
    )

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.text_encoder = ToyTextEncoder(dim=DIM)
        self.transformer = ToyDiT(dim=DIM)
        self.vae = StagedVAE()
        self.refiner = StagedRefiner()
        self.kept_away = KeptAway()  # in none of the lists
        self.transformer_2 = ToyDiT(dim=DIM)  # named like a DiT, in none of the lists: not streamed, not moved

    def forward(self, ids, x):
        context = self.text_encoder(ids).mean(dim=1, keepdim=True)
        return self.vae.decode(self.refiner(self.transformer(x + context)))


def _tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    return dict(module.named_parameters()) | dict(module.named_buffers())


def _untouched(pipe: RolesPipeline, before: dict[str, torch.Tensor]) -> None:
    """The undeclared children hold the very same tensors as before, were never moved or marked."""
    assert pipe.kept_away.to_calls == []
    assert pipe.kept_away.proj.weight.is_meta
    now = _tensors(pipe.kept_away) | {f"t2.{k}": v for k, v in _tensors(pipe.transformer_2).items()}
    assert now.keys() == before.keys() and all(now[k] is before[k] for k in now)
    assert all(now[k].data_ptr() == before[k].data_ptr() for k in now if not now[k].is_meta)
    assert "_layerstream_offload" not in vars(pipe.kept_away) and "_layerstream_offload" not in vars(pipe.transformer_2)


def _snapshot(pipe: RolesPipeline) -> dict[str, torch.Tensor]:
    return _tensors(pipe.kept_away) | {f"t2.{k}": v for k, v in _tensors(pipe.transformer_2).items()}


def test_declared_lists_are_the_whole_picture_and_plan_says_what_stays_untouched():
    plan = resolve_offload_plan(RolesPipeline(), LAYER)
    assert [c.path for c in plan.components] == ["text_encoder", "transformer", "vae", "refiner"]
    untouched = [(u.path, u.module_class) for u in plan.untouched]
    assert untouched == [("kept_away", "KeptAway"), ("transformer_2", "ToyDiT")]
    assert plan.component("refiner").reason.startswith("declared resident (the pipeline's _resident_modules)")
    assert (plan.component("vae").own_to, plan.component("refiner").own_to) == ("CountsTo.to", "CountsTo.to")
    assert plan.component("transformer").own_to is None  # streamed: moved tensor by tensor
    table = format_plan(plan)
    rows = [line for line in table.splitlines() if line.startswith(("kept_away ", "transformer_2 "))]
    assert len(rows) == 2 and all("undeclared, untouched" in row for row in rows), table
    assert "kept_away      undeclared, untouched: the pipeline declares its roles" in table
    assert "moved through its own CountsTo.to() to the device at enable" in plan.component("vae").reason


@pytest.mark.parametrize("config", [LAYER, MODULE], ids=["layer", "module"])
def test_one_to_per_resident_component_that_defines_it_and_undeclared_children_untouched(config):
    pipe = RolesPipeline().eval()
    inputs = toy_inputs(dim=DIM)
    expected = run(pipe, inputs)
    before = _snapshot(pipe)
    handle = enable_offload(pipe, config, device="cpu")
    assert pipe.vae.to_calls == [torch.device("cpu")]  # exactly one .to(device) each, at enable
    assert pipe.refiner.to_calls == [torch.device("cpu")]
    _untouched(pipe, before)
    assert torch.equal(run(pipe, inputs), expected)
    handle.disable()
    # back through it, once, to where enable found it; the undeclared children still untouched
    assert pipe.vae.to_calls == [torch.device("cpu")] * 2
    assert pipe.refiner.to_calls == [torch.device("cpu")] * 2
    _untouched(pipe, before)
    handle.disable()  # a second disable moves nothing
    assert len(pipe.vae.to_calls) == 2
    assert torch.equal(run(pipe, inputs), expected)


class FailingStore(LocalHostStore):
    """The local store, failing on the second block it stages: after the components were placed."""

    def __init__(self):
        super().__init__()
        self.num_staged = 0

    def stage_(self, layout, device, pin):
        self.num_staged += 1
        if self.num_staged == 2:
            raise RuntimeError("simulated staging failure")
        return super().stage_(layout, device, pin)


def test_a_failed_enable_moves_a_self_moving_component_back_through_its_to():
    pipe = RolesPipeline().eval()
    store = FailingStore()
    with pytest.raises(OffloadError, match="rolled back.*simulated staging failure"):
        enable_offload(pipe, LAYER, device="cpu", store_factory=lambda path: store)
    assert store.num_staged == 2
    assert pipe.vae.to_calls == [torch.device("cpu")] * 2  # moved at enable, back through it in the rollback


def test_undeclared_pipelines_keep_todays_rule():
    class Partial(RolesPipeline):
        _vae_modules = None  # only two of the three lists: each listed role by its list, the rest by name

    plan = resolve_offload_plan(Partial(), LAYER)
    assert plan.untouched == ()
    assert {c.path: c.category for c in plan.components}["vae"] == "vae"
    assert {c.path: c.action for c in plan.components}["kept_away"] == "resident"


def test_library_base_classes_do_not_count_as_their_own_to():
    from diffusers import AutoencoderKLWan
    from transformers import T5Config, T5EncoderModel

    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1], num_res_blocks=1, temperal_downsample=[False])
    encoder = T5EncoderModel(T5Config(vocab_size=8, d_model=8, d_kv=4, d_ff=8, num_layers=1, num_heads=2))
    assert defines_own_to(vae) is None and defines_own_to(encoder) is None  # ModelMixin.to, PreTrainedModel.to
    assert defines_own_to(nn.Linear(2, 2)) is None
    assert defines_own_to(StagedVAE()) == "CountsTo.to"


def test_resident_modules_errors_name_the_list_and_the_value():
    class Stringly(RolesPipeline):
        _resident_modules = "refiner"

    with raises_naming("Stringly", "_resident_modules", "'refiner'", "list of attribute paths"):
        resolve_offload_plan(Stringly(), LAYER)

    class Inside(RolesPipeline):
        _resident_modules = ["kept_away.proj"]

    with raises_naming("Inside", "kept_away.proj", "_resident_modules", "'kept_away'", "untouched"):
        resolve_offload_plan(Inside(), LAYER)

    class Missing(RolesPipeline):
        _resident_modules = ["refiner", "no_such_module"]

    plan = resolve_offload_plan(Missing(), LAYER)
    assert {a.path: a.declared_in for a in plan.absent} == {"no_such_module": "_resident_modules"}
