"""The one wording of an error's first line and of a size, as every message uses it."""

from __future__ import annotations

import pytest

from layerstream.wording import first_line, format_bytes, format_gb

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast


def test_first_line_keeps_one_line_and_names_the_type_when_asked():
    error = RuntimeError("\n  the store is gone  \nTraceback (most recent call last): ...")
    assert first_line(error) == "the store is gone"
    assert first_line(error, with_type=True) == "RuntimeError: the store is gone"
    assert first_line(KeyError()) == first_line(KeyError(), with_type=True) == "KeyError"


def test_format_gb_counts_in_the_configs_decimal_units():
    assert [format_gb(n) for n in (0, 12_345_678, 99_999_999, 10**8, 12_345_678_901)] == [
        "0 MB", "12.3 MB", "100 MB", "0.1 GB", "12.3 GB",
    ]  # fmt: skip


def test_format_bytes_counts_in_binary_units():
    assert [format_bytes(n) for n in (0, 1023, 1024, 1536 * 1024, 3 * 2**30, 5 * 2**40)] == [
        "0 B", "1023 B", "1.0 KiB", "1.5 MiB", "3.0 GiB", "5.0 TiB",
    ]  # fmt: skip
