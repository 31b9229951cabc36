"""The lossless code of 16-bit floats (`runtime.packing.lossless_code`): every bit pattern of bfloat16 and float16
comes back bit for bit (zeros, subnormals, infinities, NaN payloads, both signs, every exponent), through every
tier and the literals, at any size and offset, on the host and through a slot's views, and both ways of decoding
(the CPU's, which counts the escapes, and the accelerator's, which ranks them on the device) give the same bits."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

import layerstream.runtime.packing.lossless_decode as lossless_decode
from layerstream.runtime.packing.lossless_code import (
    _CodeOverflowError,
    SpanCode,
    SpanDecode,
    decode,
    encode_into_,
    escape_capacity,
    estimated_code,
    plan_code,
)
from layerstream.runtime.packing.lossless_format import FIRST_WIDTHS, MAX_TIERS, TIER_WIDTHS, pack_codes, unpack_codes

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
WAYS = {"counted": False, "ranked": True}  # SpanDecode's `dense`: the CPU's way, the accelerator's


def candidate_widths() -> list[tuple[int, ...]]:
    """Every tier layout the planner weighs: a first width, then up to `MAX_TIERS - 1` later widths."""
    later = [rest for k in range(MAX_TIERS) for rest in itertools.product(TIER_WIDTHS, repeat=k)]
    return [(first,) + rest for first in FIRST_WIDTHS for rest in later]


def _round_trip(x16: torch.Tensor, dtype: str, code: SpanCode | None = None, dense: bool = False) -> torch.Tensor:
    code = code or plan_code(x16, dtype)
    assert code is not None
    stored = torch.zeros(code.nbytes, dtype=torch.uint8)
    encode_into_(code, x16, stored)
    return decode(code, stored, dense)


def _roomy(dtype: str, n: int, widths: tuple[int, ...]) -> SpanCode:
    """A code of these widths with room for every element in every tier."""
    return SpanCode(dtype, n, widths, tuple(escape_capacity(n, n) for _ in widths))


def _every_bit_pattern() -> torch.Tensor:
    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    return every[torch.randperm(every.numel(), generator=torch.Generator().manual_seed(0))]


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_bit_pattern_comes_back_through_every_tier_layout(dtype, way):
    shuffled = _every_bit_pattern()
    values = shuffled.view(DTYPES[dtype])
    # the classes are there: both zeros, subnormals, both infinities, NaNs with payloads, every exponent
    assert (values == 0).sum() == 2 and torch.isinf(values).sum() == 2 and torch.isnan(values).sum() > 200
    assert (values.abs() < torch.finfo(DTYPES[dtype]).tiny).sum() > 2
    assert plan_code(shuffled, dtype) is None  # uniform bits do not code smaller: such a span stays raw
    for widths in candidate_widths():  # coded all the same, most elements through the later tiers and literals
        assert torch.equal(_round_trip(shuffled, dtype, _roomy(dtype, shuffled.numel(), widths), WAYS[way]), shuffled)


@pytest.mark.parametrize("dtype", DTYPES)
def test_both_ways_of_finding_escapes_on_the_cpu_agree(dtype, monkeypatch):
    """Without numpy the CPU finds escapes with torch: the same positions, the same bits."""
    shuffled = _every_bit_pattern()
    code = _roomy(dtype, shuffled.numel(), (2, 2, 2))
    monkeypatch.setattr(lossless_decode, "_np", None)
    assert torch.equal(_round_trip(shuffled, dtype, code), shuffled)


@pytest.mark.parametrize("dtype", DTYPES)
def test_distinct_values_take_the_later_tiers_and_a_single_value_takes_none(dtype):
    torch.manual_seed(1)
    # every coded byte once, then many of a few: the windows hold the frequent ones, the rest escape
    distinct = (torch.arange(256, dtype=torch.int32) << (7 if dtype == "bfloat16" else 8)) & 0xFFFF
    x16 = torch.cat([distinct, torch.randint(0, 128, (5000,), dtype=torch.int32)]).to(torch.int16)
    code = plan_code(x16, dtype)
    assert code is not None
    for dense in WAYS.values():
        assert torch.equal(_round_trip(x16, dtype, code, dense), x16)

    one = torch.full((4096,), 1.5, dtype=DTYPES[dtype]).view(torch.int16)
    code = plan_code(one, dtype)
    assert code.widths == (1,) and code.capacities == (escape_capacity(0, one.numel()),)  # no escape needed
    for dense in WAYS.values():
        assert torch.equal(_round_trip(one, dtype, code, dense), one)


UNWEIGHED_BYTES = 120
"""What the planner's ranking leaves out, so that a layout it ranks first can be this much bigger than another: it
weighs layouts by their codes' bits, not the header (a base and an escape count a tier: up to 32 bytes, against
the one-tier code's 16) nor, in each of up to six regions (the raw bytes, two fields, two later tiers, the
literals), up to 15 bytes of alignment and tier 0's padding to whole groups (under 10 bytes): under 120 in all.
Tiny tensors it left raw were measured up to 34 bytes over a one-tier code (none from 2,048 elements on, where
the store's `MIN_CODED_BYTES` begins)."""


def _cheapest_code_bytes(n: int, dtype: str) -> int:
    """The bytes of the smallest code `n` elements can have: one value repeated (tier 0 of one bit, no escapes)."""
    return SpanCode(dtype, n, (1,), (escape_capacity(0, n),)).nbytes


def _one_tier_code_bytes(x16: torch.Tensor, dtype: str) -> int:
    """The bytes of the smallest code of one tier then literals, its window found here by counting (not by the
    planner): `plan_code` weighs every such layout, so where this is well under the raw bytes a code exists."""
    values = (x16.to(torch.int32) >> (7 if dtype == "bfloat16" else 8)) & (255 if dtype == "bfloat16" else 127)
    sums = torch.bincount(values, minlength=256 if dtype == "bfloat16" else 128).cumsum(0)
    sums = torch.cat([torch.zeros(1, dtype=sums.dtype), sums])
    n, sizes = x16.numel(), []
    for width in FIRST_WIDTHS:
        inside = (sums[(1 << width) - 1 :] - sums[: sums.numel() - (1 << width) + 1]).max().item()
        sizes.append(SpanCode(dtype, n, (width,), (escape_capacity(n - inside, n),)).nbytes)
    return min(sizes)


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(sorted(DTYPES)),
    n=st.integers(1, 3000),
    scale=st.sampled_from([1e-4, 0.02, 1.0, 300.0]),
    spread=st.sampled_from([0.0, 1.0, 3.0]),
    seed=st.integers(0, 2**16),
    specials=st.lists(st.integers(-(1 << 15), (1 << 15) - 1), max_size=20),
)
def test_random_tensors_round_trip(dtype, n, scale, spread, seed, specials):
    """Normal values, and values with a spread of exponents (a log-normal scale per element, like trained
    weights' heavy tails), with any bit patterns among them: every example is either coded smaller and comes back
    bit for bit, or left raw for a reason the test names. `plan_code` keeps a tensor raw only where no layout codes
    it in fewer than its raw bytes (the store adds its own floor, `MIN_CODED_BYTES`, before it asks): so a raw
    tensor is small (not even one value repeated pays for the header and the escape slack) or incompressible
    (its exponents too spread: the best one-tier code, counted here, is no smaller either, within
    `UNWEIGHED_BYTES`)."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(n, generator=g) * scale * torch.exp(torch.randn(n, generator=g) * spread)
    x16 = values.to(DTYPES[dtype]).view(torch.int16).clone()
    for i, bits in enumerate(specials[:n]):
        x16[(i * 7919) % n] = bits
    code = plan_code(x16, dtype)
    one_tier = _one_tier_code_bytes(x16, dtype)
    if code is None:
        small = _cheapest_code_bytes(n, dtype) >= 2 * n
        event("raw: small" if small else "raw: incompressible")
        assert small or one_tier + UNWEIGHED_BYTES >= 2 * n, f"{n} elements left raw; one tier codes them in {one_tier} bytes"
        return
    event("coded")
    assert code.nbytes < 2 * n
    for dense in WAYS.values():
        assert torch.equal(_round_trip(x16, dtype, code, dense), x16)


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from(sorted(DTYPES)),
    widths=st.sampled_from(candidate_widths()),
    n=st.integers(1, 70000),
    seed=st.integers(0, 2**16),
)
def test_any_tier_layout_codes_any_values(dtype, widths, n, seed):
    """Whatever layout was planned (from other values: a LoRA fused since), values that fit its capacities come
    back exactly, across chunk and block boundaries; uniform bits send most elements to the literals."""
    g = torch.Generator().manual_seed(seed)
    x16 = torch.randint(-(1 << 15), 1 << 15, (n,), generator=g, dtype=torch.int32).to(torch.int16)
    code = _roomy(dtype, n, widths)
    for dense in WAYS.values():
        assert torch.equal(_round_trip(x16, dtype, code, dense), x16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_escapes_counted_across_steps_find_their_codes(dtype, monkeypatch):
    """Each step of a span starts where the escapes of the steps before it left each tier (a running count on
    the host, a device tensor on an accelerator): steps of two blocks over a span of many, the last one short."""
    monkeypatch.setitem(lossless_decode.CHUNK_ELEMENTS, "cpu", 2 * 8192)
    g = torch.Generator().manual_seed(5)
    n = 9 * 8192 + 1000
    x16 = (torch.randn(n, generator=g) * 0.02 * torch.exp(torch.randn(n, generator=g) * 1.5)).to(DTYPES[dtype]).view(torch.int16)
    x16[torch.randint(0, n, (300,), generator=g)] = torch.randint(-(1 << 15), 1 << 15, (300,), generator=g, dtype=torch.int32).to(torch.int16)
    code = plan_code(x16, dtype)
    assert code is not None and len(code.widths) > 1 and len(code.steps(2 * 8192)) == 6
    for dense in WAYS.values():
        assert torch.equal(_round_trip(x16, dtype, code, dense), x16)


@pytest.mark.parametrize("width", [1, 2, 4])
def test_a_later_tier_unpacks_any_run_of_its_codes(width):
    capacity = 1000
    codes = torch.randint(0, 1 << width, (capacity - 7,), generator=torch.Generator().manual_seed(width), dtype=torch.int32).to(torch.uint8)
    packed = torch.zeros(-(-capacity * width // 8), dtype=torch.uint8)
    pack_codes(codes, width, capacity, packed)
    for start, count in [(0, codes.numel()), (0, 1), (5, 400), (240, 300), (codes.numel() - 1, 1), (17, 0)]:
        assert torch.equal(unpack_codes(packed, width, capacity, start, count), codes[start : start + count])


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("offset", [0, 1, 3, 17])
@pytest.mark.parametrize("n", [8, 1001, 65537])
def test_decoding_into_views_at_odd_offsets_writes_only_the_span(offset, n, way):
    """A slot's views: the stored bytes anywhere 16-byte aligned in a staging region (where the form puts every
    coded span), the output at an odd element offset of the compute layout; nothing around them changes."""
    g = torch.Generator().manual_seed(n)
    x16 = (torch.randn(n, generator=g) * 0.02 * torch.exp(torch.randn(n, generator=g))).to(torch.bfloat16).view(torch.int16)
    code = _roomy("bfloat16", n, (2, 2, 2))
    staging = torch.zeros(code.nbytes + 16 * offset + 16, dtype=torch.uint8)
    region = staging[16 * offset : 16 * offset + code.nbytes]
    encode_into_(code, x16, region)
    out = torch.full((n + 2 * offset + 2,), 12345, dtype=torch.int16)
    view = out[offset + 1 : offset + 1 + n]
    SpanDecode(code, region, view, WAYS[way]).run_()
    assert torch.equal(view, x16)
    assert (out[: offset + 1] == 12345).all() and (out[offset + 1 + n :] == 12345).all()
    SpanDecode(code, region, view, WAYS[way]).run_()  # a second run over the same views: the same bits
    assert torch.equal(view, x16)


def test_values_that_need_more_entries_than_kept_are_refused_before_writing():
    x16 = torch.zeros(4096, dtype=torch.int16)
    code = plan_code(x16, "bfloat16")
    stored = torch.zeros(code.nbytes, dtype=torch.uint8)
    encode_into_(code, x16, stored)
    before = stored.clone()
    wide = torch.arange(4096, dtype=torch.int32).mul(97).remainder(1 << 16).to(torch.int16)  # every exponent
    with pytest.raises(_CodeOverflowError, match="entries"):
        encode_into_(code, wide, stored)
    assert torch.equal(stored, before)


def test_values_coded_again_keep_the_sizes_and_pick_their_own_windows():
    """New values (a LoRA fused) fit the code made for the old: twice the values (every exponent one up) and a
    small change, the windows chosen anew."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1 << 15, generator=g) * 0.02
    code = plan_code(x.to(torch.bfloat16).view(torch.int16), "bfloat16")
    moved = (x * 2 + 1e-5 * torch.randn(x.numel(), generator=g)).to(torch.bfloat16).view(torch.int16)
    stored = torch.zeros(code.nbytes, dtype=torch.uint8)
    encode_into_(code, moved, stored)
    assert torch.equal(decode(code, stored), moved)


def test_normal_weights_code_near_the_entropy_of_their_exponents():
    x16 = (torch.randn(1 << 16, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16).view(torch.int16)
    counts = torch.bincount(((x16.to(torch.int32) >> 7) & 0xFF), minlength=256).double()
    p = counts[counts > 0] / counts.sum()
    bound = (8 - (p * p.log2()).sum().item()) / 16  # a raw byte and the exponent's entropy, per 16 bits
    code = plan_code(x16, "bfloat16")
    assert code.nbytes / (2 * x16.numel()) < bound + 0.015


def test_the_estimated_code_is_priced_at_the_estimated_fraction():
    from layerstream.runtime.packing.lossless_code import ESTIMATED_CODED_FRACTION

    for dtype in DTYPES:
        code = estimated_code(1 << 20, dtype)
        assert abs(code.nbytes / (2 << 20) - ESTIMATED_CODED_FRACTION) < 0.001
