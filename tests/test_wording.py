"""The one wording of an error's first line and of a size, as every message uses it."""

from __future__ import annotations

import pytest

from layerstream.wording import first_line, format_bytes, format_seconds

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast


def test_first_line_keeps_one_line_and_names_the_type_when_asked():
    error = RuntimeError("\n  the store is gone  \nTraceback (most recent call last): ...")
    assert first_line(error) == "the store is gone"
    assert first_line(error, with_type=True) == "RuntimeError: the store is gone"
    assert first_line(KeyError()) == first_line(KeyError(), with_type=True) == "KeyError"


def test_format_bytes_counts_in_decimal_units_from_a_tenth_of_each():
    sizes = (0, 999, 1000, 4096, 99_999, 10**5, 12_345_678, 99_999_999, 10**8, 450 * 10**6, 12_345_678_901, 5 * 10**12)
    assert [format_bytes(n) for n in sizes] == [
        "0 B", "999 B", "1 kB", "4.1 kB", "100 kB", "0.1 MB", "12.3 MB", "100 MB", "0.1 GB", "0.45 GB", "12.3 GB", "5 TB",
    ]  # fmt: skip


def test_format_seconds_reads_as_people_write_times():
    times = (0, 1.848e-07, 2e-5, 7.8e-3, 0.6282, 1.234, 95.2, 12_345.6)
    assert [format_seconds(s) for s in times] == ["0 s", "185 ns", "20 µs", "7.8 ms", "628 ms", "1.23 s", "95.2 s", "12,346 s"]


def test_no_message_of_the_package_words_a_size_in_binary_units():
    """One unit family: every text the package shows (not its docstrings) counts bytes in decimal units."""
    import ast
    import re
    from pathlib import Path

    binary = re.compile(r"\b(KiB|MiB|GiB)\b")
    found = []
    for path in sorted((Path(__file__).resolve().parents[1] / "src" / "layerstream").rglob("*.py")):
        tree = ast.parse(path.read_text())
        docstrings = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                if binary.search(node.value):
                    found.append(f"{path.name}:{node.lineno}")
    assert found == []
