"""`ServeSettings`: every limit is checked when built, and the error names the setting, value and range."""

from __future__ import annotations

import pytest

from layerstream.errors import LayerstreamError
from layerstream.server.settings import CPU_MAX_WORK, ServeSettings, ServeSettingsError

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast


@pytest.mark.parametrize(
    "field, value",
    [
        ("shutdown_timeout", -1.0),
        ("shutdown_timeout", float("nan")),
        ("shutdown_timeout", float("inf")),
        ("shutdown_timeout", True),
        ("shutdown_timeout", "5"),
        ("max_work", 0),
        ("max_work", 1.5),
        ("max_queue", -1),
        ("port", 70000),
        ("max_batch_size", 0),
        ("max_batch_size", 65),
        ("batch_wait_ms", -1.0),
        ("batch_wait_ms", float("nan")),
    ],
)
def test_out_of_range_settings_are_refused_naming_the_field(field, value):
    with pytest.raises(ServeSettingsError, match=rf"^{field} = ") as info:
        ServeSettings(**{field: value})
    assert isinstance(info.value, LayerstreamError) and isinstance(info.value, ValueError)


def test_defaults_and_edges_are_accepted():
    settings = ServeSettings()
    assert settings.shutdown_timeout > 0 and settings.max_work is None  # from the device (test_limits_and_metrics)
    assert CPU_MAX_WORK >= 64 * 64 * 9 * 4 * 4  # tiny models, n=4, on a CPU
    assert ServeSettings(shutdown_timeout=0, max_work=1).shutdown_timeout == 0
    assert settings.max_batch_size == 1  # batching is opt-in: every request runs alone, as before it existed
    assert ServeSettings(max_batch_size=64, batch_wait_ms=0).batch_wait_ms == 0
