"""`layerstream bench --quality`: float8 storage against full precision on a whole pipeline."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from layerstream.bench.quality import measure_quality, psnr_db

pytest.importorskip("diffusers")


def test_psnr_is_infinite_for_identical_pictures_and_follows_the_mean_squared_error():
    a = np.full((2, 4, 4, 3), 100, dtype=np.uint8)
    assert math.isinf(psnr_db(a, a.copy()))
    b = a.copy()
    b[0, 0, 0, 0] += 96  # one value off by 96: MSE = 96**2 / 96 values = 96
    assert psnr_db(a, b) == pytest.approx(10 * math.log10(255**2 / 96))
    with pytest.raises(ValueError, match="shapes"):
        psnr_db(a, a[:1])


def test_float8_storage_halves_the_link_bytes_or_better_and_moves_the_output_a_little():
    result = measure_quality("tiny-flux", request={"prompt": "a fox", "num_inference_steps": 2, "seed": 0})
    full, *float8 = result.rows
    assert full.storage == "full precision" and math.isinf(full.psnr_db) and full.max_abs_latent_diff == 0
    assert [r.storage for r in float8] == ["float8_e4m3fn", "float8_e5m2"]
    for row in float8:
        # tiny-flux is float32: float8 weights are a quarter of their bytes, the norms and biases stay
        assert row.bytes_transferred < 0.55 * full.bytes_transferred
        assert row.bytes_ratio == pytest.approx(row.bytes_transferred / full.bytes_transferred)
        assert 20 < row.psnr_db < math.inf and row.max_abs_latent_diff > 0
    # e5m2 keeps two mantissa bits against e4m3's three: it moves the output further
    assert float8[1].max_abs_latent_diff > float8[0].max_abs_latent_diff


def test_the_quality_command_prints_json_and_refuses_flags_of_other_benchmarks(tmp_path, layerstream_cli):
    out = layerstream_cli("bench", "tiny-wan", "--quality-steps", "1", "--json", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    payload = json.loads(out.stdout)
    assert [r["storage"] for r in payload["rows"]] == ["full precision", "float8_e4m3fn", "float8_e5m2"]
    assert payload["rows"][0]["psnr_db"] == "inf"
    assert (tmp_path / "results.md").read_text().count("| float8_") == 2
    for argv, message in (
        (["--quality", "--blocks", "3"], "unrecognized arguments: --blocks"),  # the strategy comparison's flags
        (["--quality", "--host-budget-gb", "1"], "unrecognized arguments: --host-budget-gb"),  # are benchmarks/strategies.py's
        (["--quality", "--quality-steps", "0"], "--quality-steps = 0 is not valid"),
        (["tiny-wan", "--quality-model", "tiny-flux"], "the model is given twice ('tiny-wan' and 'tiny-flux')"),
    ):
        bad = layerstream_cli("bench", *argv)
        assert bad.returncode == 2 and message in bad.stderr, (argv, bad.stderr)
