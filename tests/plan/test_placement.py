"""One placement: `layerstream plan --json`, `enable_offload` and residency "auto" report the same resident
blocks, slot count and slot bytes for every built-in plan; and `place_blocks` itself, on synthetic sizes."""

from __future__ import annotations

import json
import re
import sys
import types

import pytest
from torch import nn

import layerstream.models
from layerstream import OffloadPlan, enable_offload
from layerstream.cli.main import main
from layerstream.offload import plan_placement
from layerstream.plan.builtin_plans import BUILTIN_FAMILIES
from layerstream.plan.placement import DeviceBudget, align_slot, main_chain, place_blocks
from layerstream.plan.resolved import lookup
from layerstream.plan.resolver import resolve_offload_plan
from test_builtin_plans import CASES

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast

GB = 1e9


def _one_pipeline_per_family() -> dict[str, dict[str, str]]:
    """The first pipeline class each built-in family names (WanPipeline, FluxPipeline, ...)."""
    firsts = {BUILTIN_FAMILIES[name].pipelines[0] for name in CASES}
    assert {id(BUILTIN_FAMILIES[name]) for name in firsts} == {id(f) for f in BUILTIN_FAMILIES.values()}
    return {name: CASES[name] for name in sorted(firsts)}


FAMILY_CASES = _one_pipeline_per_family()


@pytest.fixture
def fake_loader(monkeypatch):
    """`layerstream plan MODEL` loads what the test put in the returned dict (the very instance enabled later);
    `.real` is the real loading module, for the embedded tiny models."""
    import layerstream.models.loading as real

    module = types.ModuleType("layerstream.models.loading")

    class ModelLoadError(ValueError):
        pass

    class Pipelines(dict):
        pass

    pipelines = Pipelines()
    pipelines.real = real
    module.ModelLoadError = ModelLoadError
    module.load_pipeline = lambda model, dtype=None: pipelines[model]
    module.load_skeleton = lambda model, **_: (pipelines[model], {"model": model, "origin": "folder"})
    monkeypatch.setitem(sys.modules, "layerstream.models.loading", module)
    monkeypatch.setattr(layerstream.models, "loading", module)  # `from layerstream.models import loading`
    return pipelines


def _cli_plan(capsys, model: str, config: dict) -> dict:
    code = main(["plan", model, "--json", "--diffusion-offload-config", json.dumps(config)])
    out, err = capsys.readouterr()
    assert code == 0, err  # (stderr may carry library warnings from the model's imports)
    return json.loads(out)


def _tensor_bytes(module: nn.Module) -> int:
    tensors = {id(t): t for t in [*module.parameters(), *module.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _config(dit: dict, encoder_depth: int = 1) -> dict:
    return {
        "mode": "layer",
        "components": ["dit", "text_encoder"],
        "layer_options": {"dit": dit, "text_encoder": {"prefetch_depth": encoder_depth}},
    }


def _half_resident_budget_gb(pipe, dit_options: dict) -> float:
    """A device budget that keeps about half of the DiT blocks resident, computed from the modules themselves:
    every non-block byte, the ring as enabling with nothing resident sizes it, and half the DiT block bytes."""
    config = _config({**dit_options, "resident_layers": 0})
    plan = resolve_offload_plan(pipe, config)
    streamed_blocks = {p for c in plan.streamed for s in c.stacks for p in s.block_paths}
    dit_blocks = [p for c in plan.streamed if c.category == "dit" for p in main_chain(c)]
    modules = [m for m in pipe.components.values() if isinstance(m, nn.Module)]
    non_block = sum(_tensor_bytes(m) for m in modules) - sum(_tensor_bytes(lookup(pipe, p)) for p in streamed_blocks)
    ring = plan_placement(pipe, plan).ring_nbytes  # every block streams: the largest ring auto can need
    return (non_block + ring + sum(_tensor_bytes(lookup(pipe, p)) for p in dit_blocks) / 2) / GB


def _assert_enable_matches(pipe, config: dict, cli: dict) -> dict[str, set[str]]:
    """Enable `pipe` with `config` and check the handle against the `plan --json` output; returns the resident
    blocks per DiT."""
    placed = cli["placement"]
    handle = enable_offload(pipe, config)  # the default device, as `layerstream plan` uses
    try:
        placement = handle.placement
        assert placement.to_dict() == placed
        stats = handle.stats()
        streamer = handle.streamer
        # the slot ring: as many slots, each of as many bytes, as `plan` reported, and really allocated so
        assert stats.num_slots == placed["num_slots"] == len(streamer.slot_buffers)
        assert stats.slot_bytes == placed["num_slots"] * placed["slot_bytes"] == placed["ring_bytes"]
        assert all(buf.numel() == placed["slot_bytes"] for buf in streamer.slot_buffers)
        # slot bytes are the aligned largest packed block among the streamed ones
        assert placed["slot_bytes"] == align_slot(max(b.host.layout.nbytes for b in streamer.blocks))
        resident = {path: set(r["resident_blocks"]) for path, r in placed["residency"].items()}
        assert stats.num_resident_blocks == sum(len(r) for r in resident.values())
        for path, blocks in resident.items():
            assert stats.per_component[path].num_resident_blocks == len(blocks)
        all_blocks = {p for c in handle.plan.streamed for s in c.stacks for p in s.block_paths}
        kept = set().union(*resident.values())
        assert set(handle.block_transfers()) == {b.path for b in streamer.blocks} == all_blocks - kept
        for path in kept:  # resident blocks hold real weights and carry no streaming hook
            block = lookup(pipe, path)
            assert not block._forward_pre_hooks and all(p.numel() > 0 for p in block.parameters())
        for path, text in cli["residency"].items():
            assert stats.residency[path] == text
        return resident
    finally:
        handle.disable()


@pytest.mark.parametrize("class_name", sorted(FAMILY_CASES))
def test_plan_enable_and_auto_agree_for_every_builtin_plan(capsys, fake_loader, tiny, class_name):
    pipe = tiny.pipeline(class_name, **{name: tiny.fresh(kind) for name, kind in FAMILY_CASES[class_name].items()})
    fake_loader["tiny"] = pipe
    dit = {"prefetch_depth": 2}

    # an int residency: one leading block of every DiT stays, the ring has depth + 1 slots
    config = _config({**dit, "resident_layers": 1})
    cli = _cli_plan(capsys, "tiny", config)
    assert cli["placement"]["num_slots"] == 3
    resident = _assert_enable_matches(pipe, config, cli)
    plan = resolve_offload_plan(pipe, config)
    for comp in plan.streamed:
        expected = main_chain(comp)[:1] if comp.category == "dit" else []
        assert resident[comp.path] == set(expected), comp.path

    # residency "auto" with a budget for about half of the DiT blocks: some, not all, stay resident
    config = _config({**dit, "resident_layers": "auto", "device_budget_gb": _half_resident_budget_gb(pipe, dit)})
    cli = _cli_plan(capsys, "tiny", config)
    resident = _assert_enable_matches(pipe, config, cli)
    for comp in resolve_offload_plan(pipe, config).streamed:
        if comp.category == "dit":
            assert 0 < len(resident[comp.path]) < len(main_chain(comp)), (comp.path, cli["residency"])


@pytest.mark.parametrize("model", ["tiny-wan", "tiny-flux", "tiny-qwen-image"])
def test_plan_enable_and_auto_agree_for_the_embedded_tiny_models(capsys, fake_loader, model):
    pipe = fake_loader.real.load_pipeline(model)
    fake_loader[model] = pipe
    auto = {"resident_layers": "auto", "device_budget_gb": _half_resident_budget_gb(pipe, {})}
    for dit in ({"resident_layers": 1}, auto):
        config = _config(dit)
        cli = _cli_plan(capsys, model, config)
        resident = _assert_enable_matches(pipe, config, cli)
        assert cli["placement"]["num_slots"] == 2
        dits = [c for c in resolve_offload_plan(pipe, config).streamed if c.category == "dit"]
        assert dits
        for comp in dits:
            chain = main_chain(comp)
            if dit is auto:
                assert 0 < len(resident[comp.path]) < len(chain), (comp.path, cli["residency"])
            else:
                assert resident[comp.path] == {chain[0]}


# --- place_blocks on synthetic sizes -------------------------------------------------------------------------


class ToyBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.lin = nn.Linear(dim, dim)


class ToyDiT(nn.Module):
    def __init__(self, num_blocks: int, dim: int = 4):
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(ToyBlock(dim) for _ in range(num_blocks))


class ToyEncoder(nn.Module):
    def __init__(self, num_layers: int, dim: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(ToyBlock(dim) for _ in range(num_layers))


class ToyPipeline(nn.Module):
    _offload_plan = OffloadPlan(
        block_attrs={"transformer": ("blocks",)},
        resident_dit_paths=frozenset({"transformer"}),
        encoder_component_types={"text_encoder": "text_encoder"},
        encoder_block_attrs={"text_encoder": ("layers",)},
    )

    def __init__(self, num_blocks: int = 6, num_layers: int = 3):
        super().__init__()
        self.transformer = ToyDiT(num_blocks)
        self.text_encoder = ToyEncoder(num_layers)


def _toy_plan(dit: dict | None = None, encoder: dict | None = None, components=("dit",)):
    config = {"mode": "layer", "components": list(components), "layer_options": {"dit": dit or {}}}
    if encoder is not None:
        config["layer_options"]["text_encoder"] = encoder
    return resolve_offload_plan(ToyPipeline(), config)


DIT_BLOCKS = [f"transformer.blocks.{i}" for i in range(6)]
ENCODER_BLOCKS = [f"text_encoder.layers.{i}" for i in range(3)]


def _sizes(dit=(1000, 1100, 900, 1200, 1000, 800), encoder=(500, 700, 600)) -> dict[str, int]:
    return {**dict(zip(DIT_BLOCKS, dit)), **dict(zip(ENCODER_BLOCKS, encoder))}


@pytest.mark.parametrize("n", [0, 1, 4, 6])
def test_int_residency_keeps_the_leading_blocks_of_the_main_chain(n):
    plan = _toy_plan({"resident_layers": n})
    placement = place_blocks(plan, _sizes())
    assert placement.resident_block_paths("transformer") == tuple(DIT_BLOCKS[:n])
    assert placement.streamed_block_paths == tuple(DIT_BLOCKS[n:])
    assert placement.residency["transformer"].num_blocks == 6
    if n == 6:  # nothing streams: no ring at all
        assert (placement.chains, placement.num_slots, placement.slot_nbytes) == ((), 0, 0)


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_depth_d_gives_d_plus_one_slots_shared_by_every_component(depth):
    plan = _toy_plan({"prefetch_depth": depth}, {"prefetch_depth": 1}, components=("dit", "text_encoder"))
    placement = place_blocks(plan, _sizes())
    assert placement.num_slots == depth + 1
    assert [(c.component, c.prefetch_depth) for c in placement.chains] == [("transformer", depth), ("text_encoder", 1)]
    # the deepest chain sets the ring, whichever component it belongs to
    plan = _toy_plan({"prefetch_depth": 1}, {"prefetch_depth": depth}, components=("dit", "text_encoder"))
    assert place_blocks(plan, _sizes()).num_slots == depth + 1


def test_slot_bytes_are_the_aligned_largest_streamed_block_only():
    plan = _toy_plan({"resident_layers": 1}, {}, components=("dit", "text_encoder"))
    # the largest block of all (block 0) stays resident: it must not size the slots
    sizes = _sizes(dit=(99_999, 1001, 900, 1200, 1000, 800), encoder=(500, 1250, 600))
    placement = place_blocks(plan, sizes)
    assert placement.slot_nbytes == 1280  # 1250 (an encoder block) rounded up to 64 bytes
    assert placement.slot_nbytes % 64 == 0 and placement.ring_nbytes == 2 * 1280
    assert dict(placement.block_slot_nbytes) == {p: sizes[p] for p in placement.streamed_block_paths}
    assert DIT_BLOCKS[0] not in placement.block_slot_nbytes


def _auto_needed_bytes(sizes: dict[str, int]) -> int:
    """What keeping one DiT block resident costs, from the modules: the ring (2 slots of the largest block as
    the store lays it out), every byte outside the DiT's blocks (the text encoder stays resident whole), and
    the one resident block, the middle one (resident blocks are spread through the stack)."""
    pipe = ToyPipeline()
    ring = 2 * align_slot(max(sizes.values()))
    non_block = _tensor_bytes(pipe) - sum(_tensor_bytes(b) for b in pipe.transformer.blocks)
    return ring + non_block + _tensor_bytes(pipe.transformer.blocks[len(DIT_BLOCKS) // 2])


def _stated_minimum_gb(reason: str) -> float:
    stated = re.search(r"needs a budget of at least ([0-9.e+-]+) GB", reason)
    assert stated is not None, reason
    return float(stated.group(1))


def test_auto_with_a_budget_too_small_keeps_nothing_and_says_the_minimal_budget():
    plan = _toy_plan({"resident_layers": "auto"})
    sizes = {p: 1000 + 64 * i for i, p in enumerate(DIT_BLOCKS)}  # slot bytes as a store would lay them out
    needed = _auto_needed_bytes(sizes)
    small = place_blocks(plan, sizes, DeviceBudget(needed - 1, "test"))
    choice = small.residency["transformer"]
    assert choice.resident_block_paths == () and small.streamed_block_paths == tuple(DIT_BLOCKS)
    assert choice.num_blocks == 6 and "auto" in choice.reason
    assert _stated_minimum_gb(choice.reason) == pytest.approx(needed / GB, rel=5e-3)
    # the minimum is exact: one byte more than too little keeps one block, the middle one
    just = place_blocks(plan, sizes, DeviceBudget(needed, "test"))
    assert just.resident_block_paths("transformer") == (DIT_BLOCKS[3],)
    assert just.streamed_block_paths == tuple(p for p in DIT_BLOCKS if p != DIT_BLOCKS[3])


def test_auto_minimal_budget_in_the_reason_is_enough_when_given_back():
    plan = _toy_plan({"resident_layers": "auto"})
    sizes = {p: 1000 for p in DIT_BLOCKS}
    # make the largest block (it sizes the 2-slot ring) put the minimum at about 1.2344 GB, stated "1.23 GB"
    sizes[DIT_BLOCKS[0]] = (1_234_400_000 - _auto_needed_bytes({"x": 0})) // 2
    needed = _auto_needed_bytes(sizes)
    small = place_blocks(plan, sizes, DeviceBudget(1000, "test"))
    stated = _stated_minimum_gb(small.residency["transformer"].reason)
    given_back = place_blocks(plan, sizes, DeviceBudget(round(stated * GB), "test"))
    assert given_back.resident_block_paths("transformer"), (stated, needed)


def test_auto_without_a_budget_is_refused_by_place_blocks():
    with pytest.raises(ValueError, match="no device budget"):
        place_blocks(_toy_plan({"resident_layers": "auto"}), _sizes())
