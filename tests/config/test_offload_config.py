"""`parse_offload_config`: accepted inputs, defaults, immutability, and every rejection."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import pickle
import re

import pytest

from layerstream.config.offload_config import (
    LayerOptions,
    OffloadConfig,
    OffloadConfigError,
    parse_offload_config,
)

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast

DIT = {"mode": "layer", "components": ["dit"]}


def with_dit_options(**options):
    return {"mode": "layer", "components": ["dit"], "layer_options": {"dit": options}}


def assert_rejected(obj, key_path: str, value_text: str, *allowed: str) -> OffloadConfigError:
    """The parse fails with OffloadConfigError naming the key path, the value seen and what is allowed."""
    with pytest.raises(OffloadConfigError) as info:
        parse_offload_config(obj)
    err = info.value
    message = str(err)
    assert isinstance(err, ValueError)
    assert err.key_path == key_path
    assert f"{key_path} = " in message, message
    assert value_text in message, message
    for text in allowed:
        assert text in message, message
    return err


# --- accepted input ---------------------------------------------------------------------------------------


def test_error_is_a_value_error():
    assert issubclass(OffloadConfigError, ValueError)


def test_minimal_dict_gives_safe_defaults():
    config = parse_offload_config(DIT)
    assert isinstance(config, OffloadConfig)
    assert config.mode == "layer"
    assert config.components == ("dit",)
    assert config.pin_memory is True
    assert dict(config.layer_options) == {}
    options = config.options_for("dit")
    assert options == LayerOptions()
    assert options.weight_transfer == "rank-local"
    assert options.resident_layers == 0
    assert options.prefetch_depth == 1
    assert options.device_budget_gb is None
    assert options.activation_reserve_gb is None


@pytest.mark.parametrize("as_type", [str, bytes, bytearray])
def test_json_text_parses_like_the_dict(as_type):
    obj = {
        "mode": "layer",
        "components": ["dit", "text_encoder"],
        "layer_options": {"dit": {"resident_layers": 2}, "text_encoder": {"weight_transfer": "allgather"}},
        "pin_memory": False,
    }
    text = json.dumps(obj)
    payload = text if as_type is str else as_type(text.encode("utf-8"))
    assert parse_offload_config(payload) == parse_offload_config(obj)


def test_full_layer_config():
    config = parse_offload_config(
        {
            "mode": "layer",
            "components": ["text_encoder", "dit"],
            "layer_options": {
                "dit": {"weight_transfer": "allgather", "resident_layers": "auto", "prefetch_depth": 3, "device_budget_gb": 20},
                "text_encoder": {"prefetch_depth": 2},
            },
            "pin_memory": False,
        }
    )
    assert config.components == ("text_encoder", "dit")  # order as given
    assert config.pin_memory is False
    dit = config.options_for("dit")
    assert dit.weight_transfer == "allgather"
    assert dit.resident_layers == "auto"
    assert dit.prefetch_depth == 3
    assert dit.device_budget_gb == 20.0 and isinstance(dit.device_budget_gb, float)
    assert dit.activation_reserve_gb is None
    text_encoder = config.options_for("text_encoder")
    assert text_encoder == LayerOptions(prefetch_depth=2)


def test_activation_reserve_with_auto():
    config = parse_offload_config(with_dit_options(resident_layers="auto", activation_reserve_gb=0))
    assert config.options_for("dit").activation_reserve_gb == 0.0
    assert config.options_for("dit").device_budget_gb is None


def test_auto_without_budget_or_reserve_is_accepted():
    assert parse_offload_config(with_dit_options(resident_layers="auto")).options_for("dit").resident_layers == "auto"


@pytest.mark.parametrize("depth", [1, 8])
def test_prefetch_depth_bounds_are_inclusive(depth):
    assert parse_offload_config(with_dit_options(prefetch_depth=depth)).options_for("dit").prefetch_depth == depth


def test_module_mode_accepts_vae():
    config = parse_offload_config({"mode": "module", "components": ["dit", "text_encoder", "vae"]})
    assert config.mode == "module"
    assert config.components == ("dit", "text_encoder", "vae")


def test_an_offload_config_passes_through():
    config = parse_offload_config(DIT)
    assert parse_offload_config(config) is config


def test_empty_layer_options_object_is_accepted():
    assert dict(parse_offload_config({**DIT, "layer_options": {}}).layer_options) == {}


def test_parsing_does_not_alias_the_input():
    obj = {"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"resident_layers": 1}}}
    config = parse_offload_config(obj)
    obj["components"].append("text_encoder")
    obj["layer_options"]["dit"]["resident_layers"] = 5
    obj["layer_options"]["text_encoder"] = {}
    assert config.components == ("dit",)
    assert config.options_for("dit").resident_layers == 1
    assert "text_encoder" not in config.layer_options


# --- immutability -----------------------------------------------------------------------------------------


def test_config_is_frozen():
    config = parse_offload_config(with_dit_options(resident_layers=1))
    assert dataclasses.is_dataclass(config)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.mode = "module"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.pin_memory = False
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.options_for("dit").resident_layers = 3
    assert isinstance(config.components, tuple)


def test_layer_options_mapping_cannot_be_mutated():
    config = parse_offload_config(with_dit_options(resident_layers=1))
    with pytest.raises(TypeError):
        config.layer_options["dit"] = LayerOptions()
    with pytest.raises(TypeError):
        del config.layer_options["dit"]
    with pytest.raises(TypeError):
        config.layer_options["text_encoder"] = LayerOptions()
    assert not hasattr(config.layer_options, "pop")
    assert config.options_for("dit").resident_layers == 1


def test_directly_built_config_freezes_its_mapping():
    options = {"dit": LayerOptions(resident_layers=2)}
    config = OffloadConfig(mode="layer", components=["dit"], layer_options=options)
    options["dit"] = LayerOptions()
    assert config.options_for("dit").resident_layers == 2
    assert config.components == ("dit",)
    with pytest.raises(TypeError):
        config.layer_options["dit"] = LayerOptions()


def test_equal_configs_hash_equal():
    a = parse_offload_config(with_dit_options(resident_layers=1))
    b = parse_offload_config(json.dumps(with_dit_options(resident_layers=1)))
    assert a == b and hash(a) == hash(b)
    assert a != parse_offload_config(with_dit_options(resident_layers=2))
    assert len({a, b}) == 1


def test_config_survives_pickle_and_deepcopy():
    config = parse_offload_config(
        {"mode": "layer", "components": ["dit", "text_encoder"], "layer_options": {"dit": {"resident_layers": "auto"}}}
    )
    for clone in (pickle.loads(pickle.dumps(config)), copy.deepcopy(config), copy.copy(config)):
        assert clone == config
        with pytest.raises(TypeError):
            clone.layer_options["dit"] = LayerOptions()


# --- to_dict ----------------------------------------------------------------------------------------------

ROUND_TRIP_CASES = [
    DIT,
    {"mode": "module", "components": ["vae", "dit"], "pin_memory": False},
    {"mode": "layer", "components": ["dit"], "vae_use_tiling": False, "vae_use_slicing": True, "device_memory_gb": 12},
    {"mode": "layer", "components": ["dit", "text_encoder"], "layer_options": {"text_encoder": {"weight_transfer": "allgather"}}},
    with_dit_options(resident_layers="auto", device_budget_gb=12.5, prefetch_depth=2),
    with_dit_options(resident_layers="auto", activation_reserve_gb=3),
    {
        "mode": "layer",
        "components": ["text_encoder", "dit"],
        "layer_options": {"dit": {"resident_layers": 4}, "text_encoder": {"prefetch_depth": 8}},
    },
    {**DIT, "host_budget_gb": 0.25},
    {**DIT, "host_budget_gb": 32, "disk_dir": "/tmp/layerstream-spill"},
]


@pytest.mark.parametrize("obj", ROUND_TRIP_CASES)
def test_to_dict_round_trips(obj):
    config = parse_offload_config(obj)
    data = config.to_dict()
    assert parse_offload_config(data) == config
    assert parse_offload_config(json.dumps(data)) == config
    assert json.loads(json.dumps(data)) == data  # plain JSON data


def test_to_dict_fills_defaults():
    data = parse_offload_config(with_dit_options(resident_layers=2)).to_dict()
    assert data == {
        "mode": "layer",
        "components": ["dit"],
        "pin_memory": True,
        "layer_options": {"dit": {"weight_transfer": "rank-local", "resident_layers": 2, "prefetch_depth": 1}},
        "vae_use_tiling": "auto",
        "vae_use_slicing": "auto",
    }


# --- rejections -------------------------------------------------------------------------------------------


def test_unknown_top_level_key():
    err = assert_rejected({**DIT, "modes": "layer"}, "modes", "'layer'", "unknown key", '"mode"', '"layer_options"', '"pin_memory"')
    assert err.value == "layer"


@pytest.mark.parametrize("component", ["dit", "text_encoder"])
def test_unknown_layer_option_key(component):
    obj = {"mode": "layer", "components": [component], "layer_options": {component: {"prefetch": 2}}}
    assert_rejected(obj, f"layer_options.{component}.prefetch", "2", "unknown key", '"weight_transfer"', '"prefetch_depth"')


def test_unknown_dit_option_key_lists_dit_keys():
    assert_rejected(
        with_dit_options(resident=1), "layer_options.dit.resident", "1", '"resident_layers"', '"device_budget_gb"', '"activation_reserve_gb"'
    )


def test_missing_mode():
    assert_rejected({"components": ["dit"]}, "mode", "None", "required", '"layer"', '"module"')


@pytest.mark.parametrize("mode", ["stream", "Layer", "", 1, None, ["layer"], True])
def test_invalid_mode(mode):
    assert_rejected({"mode": mode, "components": ["dit"]}, "mode", repr(mode), '"layer"', '"module"')


def test_missing_components():
    assert_rejected({"mode": "layer"}, "components", "None", "required", '"dit"', '"text_encoder"')


def test_missing_components_in_module_mode_lists_vae():
    assert_rejected({"mode": "module"}, "components", "None", "required", '"dit"', '"text_encoder"', '"vae"')


def test_empty_components():
    assert_rejected({"mode": "layer", "components": []}, "components", "[]", "non-empty", '"dit"', '"text_encoder"')


@pytest.mark.parametrize("components", ["dit", {"dit": True}, None, 3])
def test_components_not_a_list(components):
    assert_rejected({"mode": "layer", "components": components}, "components", repr(components), "list", '"dit"')


def test_duplicate_components():
    assert_rejected(
        {"mode": "layer", "components": ["dit", "text_encoder", "dit"]}, "components[2]", "'dit'", "once", "components[0]"
    )


@pytest.mark.parametrize("entry", [1, None, ["dit"], {"name": "dit"}, True])
def test_non_string_component(entry):
    assert_rejected({"mode": "layer", "components": ["dit", entry]}, "components[1]", repr(entry), "string", '"dit"', '"text_encoder"')


def test_unknown_component():
    assert_rejected({"mode": "layer", "components": ["unet"]}, "components[0]", "'unet'", '"dit"', '"text_encoder"')


def test_vae_is_unknown_in_layer_mode():
    err = assert_rejected({"mode": "layer", "components": ["dit", "vae"]}, "components[1]", "'vae'", "'layer'", '"dit"', '"text_encoder"')
    assert '"vae"' not in err.allowed


def test_layer_options_for_unselected_component():
    obj = {"mode": "layer", "components": ["dit"], "layer_options": {"text_encoder": {"prefetch_depth": 2}}}
    assert_rejected(obj, "layer_options.text_encoder", "{'prefetch_depth': 2}", "selected components", '"dit"')


def test_layer_options_for_unknown_component():
    obj = {"mode": "layer", "components": ["dit"], "layer_options": {"vae": {}}}
    assert_rejected(obj, "layer_options.vae", "{}", "selected components", '"dit"')


def test_layer_options_in_module_mode():
    obj = {"mode": "module", "components": ["dit"], "layer_options": {"dit": {"resident_layers": 1}}}
    assert_rejected(obj, "layer_options", "{'dit': {'resident_layers': 1}}", '"layer"', "remove the key")


@pytest.mark.parametrize("raw", [["dit"], "dit", 1, None])
def test_layer_options_not_an_object(raw):
    assert_rejected({**DIT, "layer_options": raw}, "layer_options", repr(raw), "object")


@pytest.mark.parametrize("raw", [["resident_layers"], "auto", 1, None])
def test_component_options_not_an_object(raw):
    assert_rejected({**DIT, "layer_options": {"dit": raw}}, "layer_options.dit", repr(raw), "object")


@pytest.mark.parametrize("key", ["resident_layers", "device_budget_gb", "activation_reserve_gb"])
def test_dit_only_option_on_text_encoder(key):
    obj = {"mode": "layer", "components": ["text_encoder"], "layer_options": {"text_encoder": {key: 1}}}
    err = assert_rejected(obj, f"layer_options.text_encoder.{key}", "1", "only to dit", '"weight_transfer"', '"prefetch_depth"')
    assert '"resident_layers"' not in err.allowed.split("allowed here:")[1]


@pytest.mark.parametrize("value", [-1, True, False, "all", "AUTO", "", 1.0, 2.5, None, [1]])
def test_invalid_resident_layers(value):
    assert_rejected(with_dit_options(resident_layers=value), "layer_options.dit.resident_layers", repr(value), ">= 0", '"auto"')


@pytest.mark.parametrize("value", ["nccl", "ALLGATHER", "", None, 1, True, ["allgather"]])
def test_unknown_weight_transfer(value):
    assert_rejected(with_dit_options(weight_transfer=value), "layer_options.dit.weight_transfer", repr(value), '"rank-local"', '"allgather"')


def test_unknown_weight_transfer_on_text_encoder():
    obj = {"mode": "layer", "components": ["text_encoder"], "layer_options": {"text_encoder": {"weight_transfer": "p2p"}}}
    assert_rejected(obj, "layer_options.text_encoder.weight_transfer", "'p2p'", '"rank-local"', '"allgather"')


@pytest.mark.parametrize("value", [1, 0, "true", "false", None, 1.0, []])
def test_non_bool_pin_memory(value):
    assert_rejected({**DIT, "pin_memory": value}, "pin_memory", repr(value), "true or false")


@pytest.mark.parametrize("value", [0, 9, -1, 100, True, False, 1.0, "2", None])
def test_invalid_prefetch_depth(value):
    assert_rejected(with_dit_options(prefetch_depth=value), "layer_options.dit.prefetch_depth", repr(value), "1 to 8")


@pytest.mark.parametrize("key", ["device_budget_gb", "activation_reserve_gb"])
@pytest.mark.parametrize("value", [-1, -0.5, True, False, math.nan, math.inf, -math.inf, "4", None, [4], 10**400])
def test_invalid_gb(key, value):
    err = assert_rejected(
        with_dit_options(resident_layers="auto", **{key: value}), f"layer_options.dit.{key}", repr(value)[:40], "finite", ">= 0"
    )
    assert err.value is value


@pytest.mark.parametrize("key", ["device_budget_gb", "activation_reserve_gb"])
@pytest.mark.parametrize("resident_layers", [None, 0, 3])
def test_gb_without_auto(key, resident_layers):
    options = {key: 8}
    if resident_layers is not None:
        options["resident_layers"] = resident_layers
    assert_rejected(with_dit_options(**options), f"layer_options.dit.{key}", "8", "resident_layers \"auto\"")


def test_budget_and_reserve_together():
    obj = with_dit_options(resident_layers="auto", device_budget_gb=20, activation_reserve_gb=4)
    assert_rejected(obj, "layer_options.dit.activation_reserve_gb", "4", "device_budget_gb", "not both")


@pytest.mark.parametrize(
    "text",
    ['{"mode": "layer", "components": ["dit"]', '{"mode": "layer",\n "components": [dit]}', "", "{'mode': 'layer'}", '{"a": 1} x'],
)
def test_malformed_json_reports_the_position(text):
    with pytest.raises(json.JSONDecodeError) as expected:
        json.loads(text)
    e = expected.value
    err = assert_rejected(text, "<json>", repr(text)[:40], "JSON", e.msg)
    assert f"line {e.lineno} column {e.colno} (char {e.pos})" in str(err)
    assert isinstance(err.__cause__, json.JSONDecodeError)


def test_malformed_json_on_a_later_line():
    text = '{\n  "mode": "layer",\n  "components": ["dit",]\n}'
    err = assert_rejected(text, "<json>", "'{", "JSON")
    assert "line 3 column" in str(err)


@pytest.mark.parametrize("data", [b"\xff\xfe\xfa", bytearray(b"{\"mode\": \"\xff\"}")])
def test_undecodable_bytes(data):
    assert_rejected(data, "<json>", "", "JSON")


@pytest.mark.parametrize("text", ["[" * 100_000, "1" * 5_000, '{"mode": ' + "9" * 5_000 + "}"])
def test_json_past_python_limits_is_a_config_error(text):
    assert_rejected(text, "<json>", repr(text)[:40], "JSON")


@pytest.mark.parametrize("text", ["[]", '["dit"]', "null", "1", '"layer"', "true", "1.5"])
def test_json_value_that_is_not_an_object(text):
    value = json.loads(text)
    assert_rejected(text, "<root>", repr(value), "JSON object", "mode", "components")


@pytest.mark.parametrize("obj", [None, ["mode", "layer"], 3, ("layer",)])
def test_python_value_that_is_not_a_mapping(obj):
    assert_rejected(obj, "<root>", repr(obj), "JSON object")


@pytest.mark.parametrize(
    ("obj", "key_path"),
    [
        ({**DIT, "": 1}, '[""]'),
        ({**DIT, "pin.memory": 1}, '["pin.memory"]'),
        ({**DIT, 7: 1}, "[7]"),
        ({**DIT, "layer_options": {"dit": {"": 1}}}, 'layer_options.dit[""]'),
        ({**DIT, "layer_options": {"dit.x": {}}}, 'layer_options["dit.x"]'),
    ],
)
def test_odd_keys_are_quoted_in_the_key_path(obj, key_path):
    assert_rejected(obj, key_path, "")


def test_long_values_are_shortened_in_the_message():
    err = assert_rejected({**DIT, "pin_memory": "x" * 500}, "pin_memory", "'xxxx", "true or false")
    assert len(str(err)) < 200
    assert err.value == "x" * 500  # the full value stays on the exception


def test_message_format_is_stable():
    err = assert_rejected({**DIT, "pin_memory": 1}, "pin_memory", "1")
    assert re.fullmatch(r"diffusion_offload_config: pin_memory = 1 is not valid; expected true or false", str(err))


# --- host budget and disk tier ----------------------------------------------------------------------------


def test_host_budget_and_disk_dir_are_read():
    config = parse_offload_config({**DIT, "host_budget_gb": 24, "disk_dir": "/data/spill"})
    assert config.host_budget_gb == 24.0 and config.disk_dir == "/data/spill"
    assert parse_offload_config(DIT).host_budget_gb is None  # without the key nothing changes


@pytest.mark.parametrize("value", [0, -1, 0.0, float("nan"), float("inf"), "8", True, None, [8], 10**400])
def test_bad_host_budget(value):
    assert_rejected({**DIT, "host_budget_gb": value}, "host_budget_gb", repr(value)[:10], "finite number of GB > 0")


def test_host_budget_needs_layer_mode():
    assert_rejected({"mode": "module", "components": ["dit"], "host_budget_gb": 8}, "host_budget_gb", "8", '"layer"')


def test_host_budget_with_allgather_is_each_ranks_budget():
    """allgather with a host budget parses (each rank's shards beyond its budget go through the disk tier), and
    parses back; what stays impossible with it is refused as without allgather, naming the key."""
    obj = {**with_dit_options(weight_transfer="allgather"), "host_budget_gb": 8, "disk_dir": "/data/spill"}
    config = parse_offload_config(obj)
    assert config.host_budget_gb == 8.0 and config.options_for("dit").weight_transfer == "allgather"
    assert parse_offload_config(config.to_dict()) == config
    module = {"mode": "module", "components": ["dit"], "host_budget_gb": 8}
    assert_rejected(module, "host_budget_gb", "8", '"layer"')
    assert_rejected({**obj, "host_budget_gb": 0}, "host_budget_gb", "0", "finite number of GB > 0")


@pytest.mark.parametrize("value", ["", "a\x00b", 3, None, ["/tmp"]])
def test_bad_disk_dir(value):
    assert_rejected({**DIT, "host_budget_gb": 8, "disk_dir": value}, "disk_dir", repr(value)[:4], "non-empty path string")


def test_disk_dir_needs_a_host_budget():
    assert_rejected({**DIT, "disk_dir": "/tmp/spill"}, "disk_dir", "'/tmp/spill'", "only used with host_budget_gb")


def test_float8_storage_combines_with_a_host_budget_and_with_allgather():
    """The disk tier keeps float8 blocks in float8 (host tier, pool and spill files); allgather shards the float8
    bytes. Both parse, and parse back from `to_dict`."""
    budget = {"mode": "layer", "components": ["dit"], "host_budget_gb": 2, "layer_options": {"dit": {"storage_dtype": "float8_e4m3fn"}}}
    sharded = {"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"storage_dtype": "float8_e5m2", "weight_transfer": "allgather"}}}
    for raw in (budget, sharded):
        config = parse_offload_config(raw)
        assert config.options_for("dit").storage_dtype == raw["layer_options"]["dit"]["storage_dtype"]
        assert parse_offload_config(config.to_dict()) == config


@pytest.mark.parametrize("key", ["vae_use_tiling", "vae_use_slicing"])
def test_vae_settings_take_true_false_or_auto(key):
    base = {"mode": "layer", "components": ["dit"]}
    assert getattr(parse_offload_config(base), key) == "auto"
    for value in (True, False, "auto"):
        assert getattr(parse_offload_config({**base, key: value}), key) == value
    for bad in ("yes", 1, None, "AUTO"):
        with pytest.raises(OffloadConfigError, match=f'{key} = .* expected true, false or "auto"'):
            parse_offload_config({**base, key: bad})


def test_vae_settings_given_twice_must_agree():
    from layerstream.config.offload_config import with_vae_settings

    config = parse_offload_config({"mode": "layer", "components": ["dit"], "vae_use_tiling": False, "device_memory_gb": 8})
    assert with_vae_settings(config, vae_use_tiling=False, vae_use_slicing=None) == config
    assert with_vae_settings(config, vae_use_slicing=True).vae_use_slicing is True
    with pytest.raises(OffloadConfigError, match="vae_use_tiling = False .* given otherwise \\(True\\)"):
        with_vae_settings(config, vae_use_tiling=True)
