"""Hypothesis strategies for `diffusion_offload_config`: valid configs, single-fault mutations of them, and noise.

- `valid_configs()`: every shape the documentation accepts (each option, defaults spelled out or left out,
  any key order);
- `mutated_configs()`: a valid config with exactly one fault, paired with the key path the error must name;
- `fuzz_configs`: the mix the fuzz tests draw from, about half of it valid (`valid_fraction` measures it).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from layerstream.config.offload_config import (
    LAYER_COMPONENTS,
    MODULE_COMPONENTS,
    MODES,
    STORAGE_DTYPES,
    WEIGHT_TRANSFERS,
    OffloadConfigError,
    parse_offload_config,
)

TOP_LEVEL_KEYS = ("mode", "components", "layer_options", "pin_memory", "host_budget_gb", "disk_dir", "lora_exact_unfuse")
OPTION_KEYS = ("weight_transfer", "prefetch_depth", "storage_dtype")
DIT_ONLY_KEYS = ("resident_layers", "device_budget_gb", "activation_reserve_gb")
GB_KEYS = ("device_budget_gb", "activation_reserve_gb")

json_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
arbitrary_json = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=20,
)
gigabytes = st.integers(0, 200) | st.floats(0, 1e6, allow_nan=False, allow_infinity=False)
positive_gigabytes = st.integers(1, 200) | st.floats(1e-9, 1e6, allow_nan=False, allow_infinity=False)
paths = st.sampled_from(["/tmp/spill", "spill", "~/.cache/x", "D:\\spill"]) | st.text(min_size=1, max_size=12).filter(
    lambda t: "\x00" not in t
)


def key_path(base: str, key: str) -> str:
    """The documented key path of `key` under `base`: dotted for identifiers, quoted otherwise."""
    if key.isidentifier():
        return f"{base}.{key}" if base else key
    return f"{base}[{json.dumps(key)}]"


# --- valid ------------------------------------------------------------------------------------------------


@st.composite
def _component_options(draw, name: str) -> dict[str, Any]:
    options = draw(
        st.fixed_dictionaries(
            {}, optional={"weight_transfer": st.sampled_from(WEIGHT_TRANSFERS), "prefetch_depth": st.integers(1, 8)}
        )
    )
    if draw(st.booleans()):  # float8 storage combines with either transfer
        options["storage_dtype"] = draw(st.sampled_from(STORAGE_DTYPES))
    if name == "dit" and draw(st.booleans()):
        options["resident_layers"] = draw(st.integers(0, 10**6) | st.just("auto"))
        if options["resident_layers"] == "auto":
            extra = draw(st.sampled_from([None, *GB_KEYS]))
            if extra:
                options[extra] = draw(gigabytes)
    return _shuffled(draw, options)


def _shuffled(draw, obj: dict[str, Any]) -> dict[str, Any]:
    """The same mapping in a drawn key order: the parser must not care."""
    keys = draw(st.permutations(list(obj)))
    return {k: obj[k] for k in keys}


@st.composite
def valid_configs(draw) -> dict[str, Any]:
    """Configs the documentation says are valid, in every shape it allows."""
    mode = draw(st.sampled_from(MODES))
    allowed = LAYER_COMPONENTS if mode == "layer" else MODULE_COMPONENTS
    components = draw(st.lists(st.sampled_from(allowed), min_size=1, unique=True))
    obj: dict[str, Any] = {"mode": mode, "components": components}
    if draw(st.booleans()):
        obj["pin_memory"] = draw(st.booleans())
    if mode == "layer" and draw(st.booleans()):
        obj["lora_exact_unfuse"] = draw(st.booleans())
    if mode == "layer" and draw(st.booleans()):
        names = draw(st.lists(st.sampled_from(components), unique=True))  # may be none: {} is accepted
        obj["layer_options"] = {name: draw(_component_options(name)) for name in names}
    if mode == "layer" and draw(st.booleans()):  # with float8 storage, and with allgather (each rank's budget)
        obj["host_budget_gb"] = draw(positive_gigabytes)
        if draw(st.booleans()):
            obj["disk_dir"] = draw(paths)
    return _shuffled(draw, obj)


# --- one fault, and the key path it must be reported at ---------------------------------------------------

Mutation = Callable[[Any, dict], str]
"""Applies one fault to a deep copy of a valid config (in place) and returns the key path the error names."""


def _not_in(values) -> Callable[[Any], bool]:
    return lambda v: not (isinstance(v, str) and v in values)


def _options_of(obj: dict, name: str) -> dict:
    return obj.setdefault("layer_options", {}).setdefault(name, {})


def _bad_mode(draw, obj):
    obj["mode"] = draw(arbitrary_json.filter(_not_in(MODES)))
    return "mode"


def _missing_mode(draw, obj):
    del obj["mode"]
    return "mode"


def _missing_components(draw, obj):
    del obj["components"]
    return "components"


def _bad_components(draw, obj):
    obj["components"] = draw(st.just([]) | arbitrary_json.filter(lambda v: not isinstance(v, list)))
    return "components"


def _bad_component_entry(draw, obj):
    allowed = LAYER_COMPONENTS if obj["mode"] == "layer" else MODULE_COMPONENTS
    wrong_mode = [st.just("vae")] if obj["mode"] == "layer" else []
    index = draw(st.integers(0, len(obj["components"]) - 1))
    obj["components"][index] = draw(st.one_of(*wrong_mode, arbitrary_json.filter(_not_in(allowed))))
    return f"components[{index}]"


def _duplicate_component(draw, obj):
    obj["components"].append(draw(st.sampled_from(obj["components"])))
    return f"components[{len(obj['components']) - 1}]"


def _unknown_top_level_key(draw, obj):
    key = draw(st.text(max_size=12).filter(_not_in(TOP_LEVEL_KEYS)))
    obj[key] = draw(arbitrary_json)
    return key_path("", key)


def _bad_pin_memory(draw, obj):
    obj["pin_memory"] = draw(arbitrary_json.filter(lambda v: not isinstance(v, bool)))
    return "pin_memory"


def _layer_options_in_module_mode(draw, obj):
    obj["layer_options"] = draw(arbitrary_json)
    return "layer_options"


def _layer_options_not_an_object(draw, obj):
    obj["layer_options"] = draw(arbitrary_json.filter(lambda v: not isinstance(v, dict)))
    return "layer_options"


def _options_for_an_unselected_component(draw, obj):
    name = draw(st.text(max_size=12).filter(_not_in(obj["components"])))
    obj.setdefault("layer_options", {})[name] = draw(st.just({}) | arbitrary_json)
    return key_path("layer_options", name)


def _component_options_not_an_object(draw, obj):
    name = draw(st.sampled_from(obj["components"]))
    obj.setdefault("layer_options", {})[name] = draw(arbitrary_json.filter(lambda v: not isinstance(v, dict)))
    return f"layer_options.{name}"


def _unknown_option_key(draw, obj):
    name = draw(st.sampled_from(obj["components"]))
    key = draw(st.text(max_size=12).filter(_not_in(OPTION_KEYS + DIT_ONLY_KEYS)))
    _options_of(obj, name)[key] = draw(arbitrary_json)
    return key_path(f"layer_options.{name}", key)


def _dit_only_key_on_text_encoder(draw, obj):
    key = draw(st.sampled_from(DIT_ONLY_KEYS))
    _options_of(obj, "text_encoder")[key] = draw(st.just("auto") | gigabytes | arbitrary_json)
    return f"layer_options.text_encoder.{key}"


def _bad_weight_transfer(draw, obj):
    name = draw(st.sampled_from(obj["components"]))
    _options_of(obj, name)["weight_transfer"] = draw(arbitrary_json.filter(_not_in(WEIGHT_TRANSFERS)))
    return f"layer_options.{name}.weight_transfer"


def _bad_prefetch_depth(draw, obj):
    name = draw(st.sampled_from(obj["components"]))
    out_of_range = st.sampled_from([0, 9]) | st.integers().filter(lambda d: not 1 <= d <= 8)  # boundaries first
    not_an_int = arbitrary_json.filter(lambda v: isinstance(v, bool) or not isinstance(v, int))
    _options_of(obj, name)["prefetch_depth"] = draw(out_of_range | not_an_int)
    return f"layer_options.{name}.prefetch_depth"


def _bad_storage_dtype(draw, obj):
    name = draw(st.sampled_from(obj["components"]))
    _options_of(obj, name)["storage_dtype"] = draw(arbitrary_json.filter(_not_in(STORAGE_DTYPES)))
    return f"layer_options.{name}.storage_dtype"


def _bad_resident_layers(draw, obj):
    negative = st.just(-1) | st.integers(max_value=-1)
    other = arbitrary_json.filter(lambda v: v != "auto" and (isinstance(v, bool) or not isinstance(v, int)))
    _options_of(obj, "dit")["resident_layers"] = draw(negative | other)
    return "layer_options.dit.resident_layers"


def _bad_gigabytes(draw, obj):
    key = draw(st.sampled_from(GB_KEYS))
    negative = st.sampled_from([-1, -1e-9]) | st.integers(max_value=-1) | st.floats(max_value=-1e-9)
    not_finite = st.sampled_from([float("nan"), float("inf"), float("-inf"), 10**400])
    not_a_number = arbitrary_json.filter(lambda v: isinstance(v, bool) or not isinstance(v, (int, float)))
    options = _options_of(obj, "dit")
    options["resident_layers"] = "auto"  # so that the value is the only fault
    for other in GB_KEYS:
        options.pop(other, None)
    options[key] = draw(negative | not_finite | not_a_number)
    return f"layer_options.dit.{key}"


def _gigabytes_without_auto(draw, obj):
    options = _options_of(obj, "dit")
    for key in GB_KEYS:
        options.pop(key, None)
    if draw(st.booleans()):
        options["resident_layers"] = draw(st.integers(0, 100))
    else:
        options.pop("resident_layers", None)
    key = draw(st.sampled_from(GB_KEYS))
    options[key] = draw(gigabytes)
    return f"layer_options.dit.{key}"


def _budget_and_reserve(draw, obj):
    options = _options_of(obj, "dit")
    options["resident_layers"] = "auto"
    options.update({key: draw(gigabytes) for key in GB_KEYS})
    return "layer_options.dit.activation_reserve_gb"


def _bad_host_budget(draw, obj):
    zero_or_less = st.sampled_from([0, 0.0, -1, -1e-9]) | st.integers(max_value=0) | st.floats(max_value=0)
    not_finite = st.sampled_from([float("nan"), float("inf"), 10**400])
    not_a_number = arbitrary_json.filter(lambda v: isinstance(v, bool) or not isinstance(v, (int, float)))
    obj["host_budget_gb"] = draw(zero_or_less | not_finite | not_a_number)
    return "host_budget_gb"


def _host_budget_in_module_mode(draw, obj):
    obj["host_budget_gb"] = draw(positive_gigabytes)
    return "host_budget_gb"


def _bad_disk_dir(draw, obj):
    obj["disk_dir"] = draw(st.sampled_from(["", "a\x00b"]) | arbitrary_json.filter(lambda v: not isinstance(v, str)))
    return "disk_dir"


def _disk_dir_without_budget(draw, obj):
    obj.pop("host_budget_gb", None)
    obj["disk_dir"] = draw(paths)
    return "disk_dir"


def _mutations_for(obj: dict) -> list[Mutation]:
    """The faults that apply to this valid config (some need layer mode, a DiT, or a text encoder)."""
    mutations: list[Mutation] = [
        _bad_mode, _missing_mode, _missing_components, _bad_components, _bad_component_entry,
        _duplicate_component, _unknown_top_level_key, _bad_pin_memory, _bad_disk_dir, _disk_dir_without_budget,
    ]  # fmt: skip
    if obj["mode"] == "module":
        return [*mutations, _layer_options_in_module_mode, _host_budget_in_module_mode]
    mutations += [
        _layer_options_not_an_object, _options_for_an_unselected_component, _component_options_not_an_object,
        _unknown_option_key, _bad_weight_transfer, _bad_prefetch_depth, _bad_host_budget,
        _bad_storage_dtype,
    ]  # fmt: skip
    if "dit" in obj["components"]:
        mutations += [_bad_resident_layers, _bad_gigabytes, _gigabytes_without_auto, _budget_and_reserve]
    if "text_encoder" in obj["components"]:
        mutations.append(_dit_only_key_on_text_encoder)
    return mutations


MUTATIONS: dict[str, Mutation] = {
    m.__name__.lstrip("_"): m
    for m in (
        _bad_mode, _missing_mode, _missing_components, _bad_components, _bad_component_entry, _duplicate_component,
        _unknown_top_level_key, _bad_pin_memory, _layer_options_in_module_mode, _layer_options_not_an_object,
        _options_for_an_unselected_component, _component_options_not_an_object, _unknown_option_key,
        _bad_weight_transfer, _bad_prefetch_depth, _bad_resident_layers, _bad_gigabytes, _gigabytes_without_auto,
        _budget_and_reserve, _dit_only_key_on_text_encoder, _bad_host_budget, _host_budget_in_module_mode,
        _bad_disk_dir, _disk_dir_without_budget, _bad_storage_dtype,
    )
}  # fmt: skip
"""Every fault by name."""


@st.composite
def mutated_configs(draw, only: str | None = None) -> tuple[dict[str, Any], str, str]:
    """(config, key path, mutation name): a valid config with exactly one fault, and where it must be reported.

    `only` names one of `MUTATIONS`; the valid config is then drawn among those that fault applies to."""
    if only is None:
        obj = copy.deepcopy(draw(valid_configs()))
        mutation = draw(st.sampled_from(_mutations_for(obj)))
    else:
        mutation = MUTATIONS[only]
        obj = copy.deepcopy(draw(valid_configs().filter(lambda o: mutation in _mutations_for(o))))
    path = mutation(draw, obj)
    return obj, path, mutation.__name__.lstrip("_")


# --- the fuzz mix -----------------------------------------------------------------------------------------


def _vocabulary(values):
    return st.sampled_from(values) | arbitrary_json


_option_values = {
    "weight_transfer": _vocabulary(["rank-local", "allgather"]),
    "resident_layers": _vocabulary(["auto", 0, 1, 3, -1]),
    "prefetch_depth": _vocabulary([1, 2, 8, 0, 9]),
    "storage_dtype": _vocabulary([*STORAGE_DTYPES, "bfloat16"]),
    "device_budget_gb": _vocabulary([0, 4.5, 24, -1.0]),
    "activation_reserve_gb": _vocabulary([0, 2, 4.0]),
}
_components = st.sampled_from(["dit", "text_encoder", "vae"])
_some_options = st.fixed_dictionaries({}, optional=_option_values)
_layer_options = (
    st.dictionaries(_components, _some_options, max_size=2)
    | st.dictionaries(_components | st.text(max_size=6), _some_options | arbitrary_json, max_size=3)
    | arbitrary_json
)
_component_lists = (
    st.lists(_components, min_size=1, max_size=3, unique=True)
    | st.lists(_components | arbitrary_json, max_size=4)
    | arbitrary_json
)

near_valid_configs = st.fixed_dictionaries(
    {"mode": _vocabulary(["layer", "module"]), "components": _component_lists},
    optional={
        "layer_options": _layer_options,
        "pin_memory": _vocabulary([True, False]),
        "host_budget_gb": _vocabulary([0.5, 2, 0, -1]),
        "disk_dir": _vocabulary(["/tmp/spill", ""]),
    },
) | st.fixed_dictionaries(
    {},
    optional={
        "mode": _vocabulary(["layer", "module"]),
        "components": _component_lists,
        "layer_options": _layer_options,
        "pin_memory": _vocabulary([True, False]),
        "extra": arbitrary_json,
    },
)
"""The real vocabulary with any key or value sometimes replaced by arbitrary JSON, missing, or joined by an
unknown key: mostly invalid, in ways nobody listed."""

_FUZZ_MIX = {
    "valid": (valid_configs(), 8),
    "one fault": (mutated_configs().map(lambda case: case[0]), 2),
    "near miss": (near_valid_configs, 2),
    "arbitrary": (arbitrary_json, 1),
}
fuzz_configs = st.sampled_from([kind for kind, (_, weight) in _FUZZ_MIX.items() for _ in range(weight)]).flatmap(
    lambda kind: _FUZZ_MIX[kind][0]
)
"""What the fuzz tests parse: about half valid configs, the rest single faults, near misses and arbitrary
JSON. The weights are set by measurement (`valid_fraction`): hypothesis does not draw the kinds evenly, and
`st.one_of` over the same strategies gives only about 15% valid."""


def valid_fraction(strategy, num_examples: int = 1000) -> float:
    """The fraction of `num_examples` drawn from `strategy` that parse (no example database, so it is fresh)."""
    outcomes: list[bool] = []

    @settings(max_examples=num_examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(strategy)
    def draw(obj):
        try:
            parse_offload_config(obj)
        except OffloadConfigError:
            outcomes.append(False)
        else:
            outcomes.append(True)

    draw()
    return sum(outcomes) / len(outcomes)
