"""`benchmarks/float8_upcast.py` runs and finds the lookups' bits equal to torch's."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "float8_upcast.py"


@pytest.fixture
def script():
    spec = importlib.util.spec_from_file_location("float8_upcast_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_small_run_prints_both_times_and_the_same_bits(script, capsys):
    threads = torch.get_num_threads()
    try:
        assert script.main(["--elements", "100001", "--repeats", "2"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "torch copy_" in out and "table lookups" in out and "same bits: yes" in out


def test_a_bad_count_is_refused(script, capsys):
    with pytest.raises(SystemExit):
        script.main(["--repeats", "0"])
    assert "--repeats = 0 is not valid" in capsys.readouterr().err
