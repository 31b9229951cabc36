"""The CPU's float8 upcast by table lookups (`runtime.packing.upcast`) gives torch's own conversion, bit for bit."""

from __future__ import annotations

import threading

import pytest
import torch

from layerstream.runtime.packing.upcast import upcast_

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast

FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)
TARGETS = (torch.bfloat16, torch.float16, torch.float32)


def every_code(repeats: int) -> torch.Tensor:
    """All 256 bytes (NaNs, both zeros, subnormals, the extremes), repeated, shuffled so neighbours differ."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(repeats)
    return codes[torch.randperm(codes.numel(), generator=torch.Generator().manual_seed(0))]


@pytest.mark.parametrize("source", FLOAT8, ids=str)
@pytest.mark.parametrize("target", TARGETS, ids=str)
def test_every_byte_upcasts_to_torchs_bits(source: torch.dtype, target: torch.dtype) -> None:
    codes = every_code(3 * 1024 + 1)  # more than one lookup chunk of pairs
    for source_offset in (0, 1):
        for target_offset in (0, 1):
            for count in (1, 2, 3, 255, codes.numel() - 2):
                stored = codes[source_offset : source_offset + count].view(source)
                out = torch.full((count + target_offset,), 7.0, dtype=target)[target_offset:]
                upcast_(out, stored)
                expected = stored.to(target)  # torch's kernel: the reference, whatever this CPU's vector width
                assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8)), (source_offset, target_offset, count)


def test_other_cases_are_torchs_copy() -> None:
    stored = every_code(2).view(torch.float8_e4m3fn)
    strided = torch.empty(2 * stored.numel(), dtype=torch.bfloat16)[::2]
    upcast_(strided, stored)
    assert torch.equal(strided.view(torch.int16), stored.to(torch.bfloat16).view(torch.int16))
    packed = torch.empty(stored.numel(), dtype=torch.uint8)
    upcast_(packed, every_code(2))  # a byte copy (the float8 form's raw segments)
    assert torch.equal(packed, every_code(2))
    empty = torch.empty(0, dtype=torch.bfloat16)
    assert upcast_(empty, torch.empty(0, dtype=torch.float8_e4m3fn)) is empty


def test_threads_keep_their_own_index_buffers() -> None:
    """The copy thread and a read thread may upcast at once: each uses an index buffer of its own."""
    stored = every_code(4096).view(torch.float8_e5m2)
    expected = stored.to(torch.bfloat16)
    outs = [torch.empty_like(expected) for _ in range(4)]
    errors: list[BaseException] = []

    def run(out: torch.Tensor) -> None:
        try:
            for _ in range(5):
                upcast_(out, stored)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(out,)) for out in outs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for out in outs:
        assert torch.equal(out.view(torch.int16), expected.view(torch.int16))


def test_inference_mode_does_not_change_the_result() -> None:
    stored = every_code(8).view(torch.float8_e4m3fn)
    out = torch.empty(stored.numel(), dtype=torch.bfloat16)
    with torch.inference_mode():
        upcast_(out, stored)
    assert torch.equal(out.view(torch.int16), stored.to(torch.bfloat16).view(torch.int16))

