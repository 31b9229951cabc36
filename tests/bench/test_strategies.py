"""Strategy names, the synthetic models and the naive baseline (CPU, tiny shapes)."""

from __future__ import annotations

import copy

import pytest
import torch

from benchmark_modules import benchmark_module

benchmark_module("strategy_bench")  # benchmarks/ on sys.path, as the scripts have it

from strategy_bench.naive import NaiveBlockLoader  # noqa: E402
from strategy_bench.strategies import StrategyError, StrategySpec, parse_strategies  # noqa: E402
from strategy_bench.synthetic import MODEL_SHAPES, block_param_count, build_synthetic_dit, make_inputs  # noqa: E402
from layerstream.plan.resolver import resolve_offload_plan


def test_parse_strategies_names_and_overrides():
    specs = parse_strategies("resident, layerwise,layerwise-resident-2,layerwise-auto-depth-2,naive", num_blocks=6)
    assert [s.name for s in specs] == ["resident", "layerwise", "layerwise-resident-2", "layerwise-auto-depth-2", "naive"]
    assert specs[2] == StrategySpec("layerwise-resident-2", "layerwise", 2, None)
    assert specs[3] == StrategySpec("layerwise-auto-depth-2", "layerwise", "auto", 2)


@pytest.mark.parametrize(
    "text, message",
    [
        ("layerwise-fast", "unknown strategy"),
        ("layerwise-resident-5", "leave fewer than 2 to stream"),
        ("layerwise-depth-9", "allowed: 1 to 8"),
        ("naive,naive", "listed twice"),
        (" , ", "names no strategy"),
    ],
)
def test_parse_strategies_rejects(text, message):
    with pytest.raises(StrategyError, match=message):
        parse_strategies(text, num_blocks=6)


@pytest.mark.parametrize(
    "name, params_millions",
    [("wan14b", 351.4), ("wan1.3b", 46.4), ("flux12b", 339.8)],
)
def test_block_shapes_have_the_real_parameter_count(name, params_millions):
    assert block_param_count(MODEL_SHAPES[name]) / 1e6 == pytest.approx(params_millions, rel=1e-3)


def test_synthetic_model_is_discovered_automatically_and_allows_resident_layers():
    model = build_synthetic_dit(MODEL_SHAPES["tiny"], 4, dtype=torch.float32)
    config = {"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"resident_layers": 2}}}
    plan = resolve_offload_plan(model, config)
    (component,) = plan.components
    assert component.source == "auto" and component.resident_allowed
    assert component.stacks[0].block_paths == tuple(f"blocks.{i}" for i in range(4))


@pytest.mark.parametrize("name", ["tiny", "flux12b"])
def test_naive_loader_matches_resident_and_counts_every_block(name):
    shape = MODEL_SHAPES[name]
    if name == "flux12b":  # real width, two blocks, a handful of tokens: still a fraction of a second
        shape = type(shape)(**{**shape.__dict__, "dim": 96, "num_heads": 4, "ffn_dim": 384})
    model = build_synthetic_dit(shape, 3, dtype=torch.float32)
    inputs = make_inputs(shape, num_tokens=8, num_context_tokens=4, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        expected = model(**inputs)
        naive_model = copy.deepcopy(model)
        loader = NaiveBlockLoader(list(naive_model.blocks), torch.device("cpu"), link_gbps=100.0)
        loader.enable_()
        assert all(p.numel() == 0 for p in naive_model.blocks.parameters())  # evicted between forwards
        assert torch.equal(naive_model(**inputs), expected)
        assert all(p.numel() == 0 for p in naive_model.blocks.parameters())
    block_bytes = sum(p.numel() * p.element_size() for p in model.blocks.parameters())
    assert loader.counters.bytes_transferred == block_bytes
    assert loader.counters.num_transfers == 3
    loader.disable()
    with torch.no_grad():
        assert torch.equal(naive_model(**inputs), expected)


def test_diffusers_group_is_skipped_with_a_note_when_diffusers_is_missing(monkeypatch):
    import importlib.util

    from strategy_bench import harness

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "diffusers" else real_find_spec(name, *a))
    specs = list(parse_strategies("resident,diffusers-group,naive", num_blocks=4))
    kept, skipped = harness._skip_unavailable(specs)
    assert [s.name for s in kept] == ["resident", "naive"]
    assert [(s.name, why) for s, why in skipped] == [("diffusers-group", "diffusers is not installed")]


def test_fp8_rows_parse_into_float8_storage():
    from strategy_bench.strategies import StrategyContext, layer_config, parse_strategies

    specs = {s.name: s for s in parse_strategies("layerwise-fp8,layerwise-resident-1-depth-2-fp8,diffusers-group-fp8", num_blocks=8)}
    assert specs["layerwise-fp8"].kind == "layerwise" and specs["layerwise-fp8"].storage_dtype == "float8_e4m3fn"
    deep = specs["layerwise-resident-1-depth-2-fp8"]
    assert (deep.resident_layers, deep.prefetch_depth, deep.storage_dtype) == (1, 2, "float8_e4m3fn")
    assert specs["diffusers-group-fp8"].kind == "diffusers-group"
    options = layer_config(specs["layerwise-fp8"], StrategyContext(device=torch.device("cpu")))["layer_options"]["dit"]
    assert options["storage_dtype"] == "float8_e4m3fn"


@pytest.mark.xdist_group("inductor")  # with tests/runtime/test_compile.py: one worker pays inductor's first compile
def test_compiled_rows_compile_every_block_and_stream_like_the_compiled_resident_model():
    """`resident-compiled` and `layerwise...-compiled` compile each block in place (regional compilation);
    the compiled layerwise model gives the compiled resident model's output, bit for bit."""
    from strategy_bench.strategies import StrategyContext, prepare_strategy

    specs = {s.name: s for s in parse_strategies("resident-compiled,layerwise-fp8-compiled,layerwise-compiled", num_blocks=4)}
    assert specs["resident-compiled"] == StrategySpec("resident-compiled", "resident", compiled=True)
    assert specs["layerwise-fp8-compiled"].compiled and specs["layerwise-fp8-compiled"].storage_dtype == "float8_e4m3fn"
    with pytest.raises(StrategyError, match="unknown strategy"):
        parse_strategies("layerwise-compiled-fp8", num_blocks=4)

    torch.manual_seed(0)
    model = build_synthetic_dit(MODEL_SHAPES["tiny"], num_blocks=4, dtype=torch.float32).eval()
    inputs = make_inputs(MODEL_SHAPES["tiny"], num_tokens=16, num_context_tokens=0, dtype=torch.float32, device="cpu")
    ctx = StrategyContext(device=torch.device("cpu"))
    resident = prepare_strategy(specs["resident-compiled"], copy.deepcopy(model), ctx)
    layerwise = prepare_strategy(specs["layerwise-compiled"], copy.deepcopy(model), ctx)
    try:
        assert all(b._compiled_call_impl is not None for b in layerwise.model.blocks)
        assert all(b._compiled_call_impl is not None for b in resident.model.blocks)
        with torch.no_grad():
            want = resident.model(**inputs)
            for _ in range(2):
                assert torch.equal(layerwise.model(**inputs), want)
        assert layerwise.counters().bytes_transferred > 0
    finally:
        layerwise.close()
        resident.close()
