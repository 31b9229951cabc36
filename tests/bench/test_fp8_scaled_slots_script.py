"""`benchmarks/fp8_scaled_slots.py` runs, and its rows keep their order: an fp8_scaled transformer's slot ring is
the smallest, float8 storage leaves it as it is, and the upcast weights need more with the float8 form's staging
copy than without a storage form."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "fp8_scaled_slots.py"


def test_the_table_of_slot_rings(capsys):
    spec = importlib.util.spec_from_file_location("fp8_scaled_slots_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main()
    rings = [int(n.replace(",", "")) for n in re.findall(r"\| ([\d,]+) B \|", capsys.readouterr().out)]
    assert len(rings) == 4
    scaled, scaled_float8, upcast_float8, upcast = rings
    assert scaled == scaled_float8 < upcast < upcast_float8
