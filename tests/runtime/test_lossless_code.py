"""The lossless code of 16-bit floats (`runtime.packing.lossless_code`): every bit pattern of bfloat16 and float16
comes back bit for bit (zeros, subnormals, infinities, NaN payloads, both signs, every exponent), through the
table, through the escape list, at any size and offset, on the host and through a slot's views."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from layerstream.runtime.packing.lossless_code import (
    _CodeOverflowError,
    SpanCode,
    SpanDecode,
    decode,
    encode_into_,
    WIDTHS,
    escape_capacity,
    plan_code,
    split,
)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def _round_trip(x16: torch.Tensor, dtype: str, code: SpanCode | None = None) -> torch.Tensor:
    code = code or plan_code(x16, dtype)
    assert code is not None
    stored = torch.zeros(code.nbytes, dtype=torch.uint8)
    encode_into_(code, x16, stored)
    return decode(code, stored)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_bit_pattern_comes_back(dtype):
    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    shuffled = every[torch.randperm(every.numel(), generator=torch.Generator().manual_seed(0))]
    values = shuffled.view(DTYPES[dtype])
    # the classes are there: both zeros, subnormals, both infinities, NaNs with payloads, every exponent
    assert (values == 0).sum() == 2 and torch.isinf(values).sum() == 2 and torch.isnan(values).sum() > 200
    assert (values.abs() < torch.finfo(DTYPES[dtype]).tiny).sum() > 2
    coded, _ = split(shuffled, dtype)
    assert coded.unique().numel() == 256  # every coded byte value: most of them go through the escape list
    assert plan_code(shuffled, dtype) is None  # uniform bits do not code smaller: such a span stays raw
    for width in WIDTHS:  # coded all the same, with room for every element to escape
        code = SpanCode(dtype, shuffled.numel(), width, escape_capacity(shuffled.numel(), shuffled.numel()))
        assert torch.equal(_round_trip(shuffled, dtype, code), shuffled)


@pytest.mark.parametrize("dtype", DTYPES)
def test_distinct_exponents_take_the_escape_path_and_a_single_exponent_takes_none(dtype):
    torch.manual_seed(1)
    # every coded byte once, then more of a few: the table holds the frequent ones, the rest escape
    distinct = (torch.arange(256, dtype=torch.int32) << (7 if dtype == "bfloat16" else 8)) & 0xFFFF
    x16 = torch.cat([distinct, torch.randint(0, 128, (5000,), dtype=torch.int32)]).to(torch.int16)
    code = plan_code(x16, dtype)
    assert code is not None and code.capacity >= 256 - (1 << code.width) + 1
    assert torch.equal(_round_trip(x16, dtype), x16)

    one = torch.full((4096,), 1.5, dtype=DTYPES[dtype]).view(torch.int16)
    code = plan_code(one, dtype)
    assert code.width == WIDTHS[0] and code.capacity == escape_capacity(0, one.numel())  # no escape needed
    assert torch.equal(_round_trip(one, dtype), one)


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(sorted(DTYPES)),
    n=st.integers(1, 3000),
    scale=st.sampled_from([1e-4, 0.02, 1.0, 300.0]),
    seed=st.integers(0, 2**16),
    specials=st.lists(st.integers(-(1 << 15), (1 << 15) - 1), max_size=20),
)
def test_random_tensors_round_trip(dtype, n, scale, seed, specials):
    g = torch.Generator().manual_seed(seed)
    x16 = (torch.randn(n, generator=g) * scale).to(DTYPES[dtype]).view(torch.int16).clone()
    for i, bits in enumerate(specials[:n]):
        x16[(i * 7919) % n] = bits
    code = plan_code(x16, dtype)
    if code is None:  # too small to code: stays raw
        assert n * 2 <= 4096
        return
    assert code.nbytes < 2 * n
    assert torch.equal(_round_trip(x16, dtype, code), x16)


@pytest.mark.parametrize("offset", [0, 1, 3, 17])
@pytest.mark.parametrize("n", [8, 1001, 65537])
def test_decoding_into_views_at_odd_offsets_writes_only_the_span(offset, n):
    """A slot's views: the stored bytes anywhere 16-byte aligned in a staging region (where the form puts every
    coded span), the output at an odd element offset of the compute layout; nothing around them changes."""
    x16 = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 0.02).to(torch.bfloat16).view(torch.int16)
    code = SpanCode("bfloat16", n, 3, escape_capacity(n, n))  # room for every element to escape
    staging = torch.zeros(code.nbytes + 16 * offset + 16, dtype=torch.uint8)
    region = staging[16 * offset : 16 * offset + code.nbytes]
    encode_into_(code, x16, region)
    out = torch.full((n + 2 * offset + 2,), 12345, dtype=torch.int16)
    view = out[offset + 1 : offset + 1 + n]
    SpanDecode(code, region, view).run_()
    assert torch.equal(view, x16)
    assert (out[: offset + 1] == 12345).all() and (out[offset + 1 + n :] == 12345).all()
    SpanDecode(code, region, view).run_()  # a second run over the same views: the same bits
    assert torch.equal(view, x16)


def test_values_that_need_more_escapes_than_kept_are_refused_before_writing():
    x16 = torch.zeros(4096, dtype=torch.int16)
    code = plan_code(x16, "bfloat16")
    stored = torch.zeros(code.nbytes, dtype=torch.uint8)
    encode_into_(code, x16, stored)
    before = stored.clone()
    wide = torch.arange(4096, dtype=torch.int32).mul(97).remainder(1 << 16).to(torch.int16)  # every exponent
    with pytest.raises(_CodeOverflowError, match="escapes"):
        encode_into_(code, wide, stored)
    assert torch.equal(stored, before)


def test_normal_weights_code_to_about_three_quarters():
    x16 = (torch.randn(1 << 16, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16).view(torch.int16)
    code = plan_code(x16, "bfloat16")
    assert code.width == 4 and code.nbytes / (2 * x16.numel()) < 0.77
