"""Component files' headers read without their data: GGUF tensor infos parsed from the bytes (any metadata the
`gguf` package's writer puts before them), checked against the `gguf` package's own reader; any bytes at all
give the tensors or one `ModelLoadError` line."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

gguf = pytest.importorskip("gguf")

from layerstream.models import ModelLoadError  # noqa: E402
from layerstream.models.component_headers import header_tensors  # noqa: E402

pytestmark = pytest.mark.fast

_VALUES = st.one_of(
    st.integers(0, 2**31 - 1), st.text(max_size=40), st.booleans(), st.floats(allow_nan=False, width=32),
    st.lists(st.integers(0, 2**31 - 1), max_size=20), st.lists(st.text(max_size=10), max_size=10),
)  # fmt: skip


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(metadata=st.dictionaries(st.from_regex(r"[a-z]{1,8}\.[a-z]{1,8}", fullmatch=True), _VALUES, max_size=6), rows=st.integers(1, 4))
def test_gguf_tensor_infos_match_the_gguf_reader(tmp_path_factory, metadata, rows):
    path = tmp_path_factory.mktemp("local@not-a-revision") / "t.gguf"  # an "@" in a local path names no revision
    writer = gguf.GGUFWriter(str(path), "wan")
    for key, value in metadata.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif value and isinstance(value[0], str):
            writer.add_array(key, value)
        elif value:
            writer.add_array(key, value)
    weight = np.random.default_rng(0).standard_normal((rows * 2, 256), dtype=np.float32)
    q8 = gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blocks.0.q.weight", q8, raw_shape=q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blocks.0.q.bias", np.zeros(rows * 2, dtype=np.float16))
    writer.add_tensor("head.w", np.zeros((3, 5, 7), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    parsed = header_tensors("transformer", str(path), path)
    expected = gguf.GGUFReader(str(path)).tensors
    assert list(parsed) == [t.name for t in expected]
    for t in expected:
        got = parsed[t.name]
        assert got.shape == tuple(int(n) for n in reversed(t.shape.tolist())) and got.kind == t.tensor_type.name
        assert got.stored_shape == tuple(t.data.shape) and torch.empty(got.stored_shape, dtype=got.stored_dtype).nbytes == t.n_bytes


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=200), prefix=st.sampled_from([b"", b"GGUF\x03\x00\x00\x00"]))
def test_any_bytes_give_tensors_or_one_line(tmp_path_factory, data, prefix):
    path = tmp_path_factory.mktemp("bytes") / "x.gguf"
    path.write_bytes(prefix + data)
    try:
        header_tensors("transformer", str(path), path)
    except ModelLoadError as e:
        assert str(e).startswith(f"component transformer = '{path}': cannot read its header: ") and "\n" not in str(e)
