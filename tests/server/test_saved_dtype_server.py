"""`layerstream serve` on a folder saved in bfloat16 runs it in bfloat16 and says so in /health."""

from __future__ import annotations

import pytest
import torch

from serve_harness import start_server


def test_health_reports_the_saved_dtype_of_each_component(tmp_path):
    pytest.importorskip("diffusers")
    from layerstream.models.loading import load_pipeline

    folder = tmp_path / "tiny-wan-bf16"
    load_pipeline("tiny-wan", dtype=torch.bfloat16).save_pretrained(folder)
    server = start_server(str(folder), folder=tmp_path)
    try:
        with server.client() as client:
            health = client.get("/health").json()
        assert health["dtype"] is None  # nothing asked: each component as saved
        assert health["component_dtypes"]["transformer"] == "bfloat16"
        assert set(health["component_dtypes"].values()) == {"bfloat16"}
    finally:
        assert server.terminate() == 0
