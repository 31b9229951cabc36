"""Fuzzing `parse_offload_config`: valid configs parse and round-trip, every fault names its key path.

The strategies (config_strategies.py) draw about half valid configs, so the properties about accepted configs
are exercised as often as the rejections; `test_the_fuzz_mix_is_about_half_valid` keeps it that way.
"""

from __future__ import annotations

import json
import math

import pytest
from config_strategies import MUTATIONS, arbitrary_json, fuzz_configs, mutated_configs, valid_configs, valid_fraction
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from layerstream.config.offload_config import (
    LAYER_COMPONENTS,
    MODULE_COMPONENTS,
    OffloadConfig,
    OffloadConfigError,
    parse_offload_config,
)

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast

PROPERTY_SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _parse_or_config_error(obj) -> OffloadConfig | None:
    try:
        result = parse_offload_config(obj)
    except OffloadConfigError as e:
        assert isinstance(e, ValueError)
        assert isinstance(e.key_path, str) and e.key_path
        assert f"{e.key_path} = " in str(e)
        return None
    assert isinstance(result, OffloadConfig)
    return result


def _assert_invariants(config: OffloadConfig) -> None:
    assert config.mode in ("layer", "module")
    allowed = LAYER_COMPONENTS if config.mode == "layer" else MODULE_COMPONENTS
    assert isinstance(config.components, tuple) and config.components
    assert len(set(config.components)) == len(config.components)
    assert set(config.components) <= set(allowed)
    assert isinstance(config.pin_memory, bool)
    if config.host_budget_gb is not None:
        assert config.mode == "layer" and math.isfinite(config.host_budget_gb) and config.host_budget_gb > 0
    if config.disk_dir is not None:
        assert config.host_budget_gb is not None and isinstance(config.disk_dir, str) and config.disk_dir
    assert set(config.layer_options) <= set(config.components)
    if config.mode == "module":
        assert not config.layer_options
    for name in config.components:
        options = config.options_for(name)
        assert options.weight_transfer in ("rank-local", "allgather")
        assert type(options.prefetch_depth) is int and 1 <= options.prefetch_depth <= 8
        resident = options.resident_layers
        assert resident == "auto" or (type(resident) is int and resident >= 0)
        if name != "dit":
            assert options.resident_layers == 0
        budgets = [g for g in (options.device_budget_gb, options.activation_reserve_gb) if g is not None]
        assert len(budgets) <= 1
        if budgets:
            assert options.resident_layers == "auto"
            assert math.isfinite(budgets[0]) and budgets[0] >= 0


def _assert_round_trips(config: OffloadConfig) -> None:
    report = config.to_dict()
    assert parse_offload_config(report) == config
    assert parse_offload_config(json.dumps(report)) == config
    assert parse_offload_config(report).to_dict() == report


def _leaves(obj):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _leaves(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _leaves(v)
    else:
        yield obj


@PROPERTY_SETTINGS
@given(fuzz_configs)
def test_fuzzed_configs_parse_and_round_trip_or_name_the_key_path(obj):
    config = _parse_or_config_error(obj)
    if config is not None:
        _assert_invariants(config)
        _assert_round_trips(config)


@PROPERTY_SETTINGS
@given(fuzz_configs)
def test_fuzzed_json_text_parses_like_the_object(obj):
    text = json.dumps(obj)
    from_text = _parse_or_config_error(text)
    assert _parse_or_config_error(text.encode("utf-8")) == from_text
    if not any(isinstance(v, float) and math.isnan(v) for v in _leaves(obj)):  # NaN != NaN breaks equality
        assert _parse_or_config_error(obj) == from_text


@PROPERTY_SETTINGS
@given(st.text(max_size=60) | st.binary(max_size=60) | arbitrary_json)
def test_arbitrary_input_parses_or_raises_config_error(obj):
    _parse_or_config_error(obj)


@PROPERTY_SETTINGS
@given(valid_configs())
def test_documented_valid_configs_are_accepted_as_given(obj):
    config = parse_offload_config(obj)
    assert config.mode == obj["mode"]
    assert config.components == tuple(obj["components"])
    assert config.pin_memory is obj.get("pin_memory", True)
    assert config.host_budget_gb == obj.get("host_budget_gb")
    assert config.disk_dir == obj.get("disk_dir")
    assert set(config.layer_options) == set(obj.get("layer_options", {}))
    for name, given_options in obj.get("layer_options", {}).items():
        options = config.options_for(name)
        for key, value in given_options.items():
            assert getattr(options, key) == value
    _assert_invariants(config)
    _assert_round_trips(config)
    assert parse_offload_config(json.dumps(obj)) == config


def _assert_reported_at(case) -> None:
    obj, key_path, mutation = case
    for form in (obj, json.dumps(obj)):
        try:
            parse_offload_config(form)
        except OffloadConfigError as e:
            assert e.key_path == key_path, f"{mutation}: expected {key_path!r}, got {e.key_path!r}: {e}"
            assert str(e).startswith(f"diffusion_offload_config: {key_path} = "), str(e)
        else:
            raise AssertionError(f"{mutation}: {form!r} was accepted; expected an error at {key_path!r}")


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_each_kind_of_fault_is_reported_at_its_key_path(mutation):
    @settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck))
    @given(mutated_configs(only=mutation))
    def check(case):
        _assert_reported_at(case)

    check()


@PROPERTY_SETTINGS
@given(mutated_configs())
def test_any_single_fault_is_reported_at_its_key_path(case):
    _assert_reported_at(case)


def test_the_fuzz_mix_is_about_half_valid():
    """Guards the strategy: the fuzz tests must see many accepted configs, not only errors."""
    fraction = valid_fraction(fuzz_configs, num_examples=600)
    assert 0.3 <= fraction <= 0.8, fraction
