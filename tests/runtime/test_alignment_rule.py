"""The alignment rule, held by every store and every path that puts a block's bytes into a slot: while a streamed
block computes, each of its tensors sits at the address residue (mod `ALIGN_BYTES`, the widest vector a CPU
kernel aligns for: 64 bytes on AVX-512) that the resident tensor has; for a weight cast from a storage dtype,
the residue of the fresh tensor diffusers' casting hook computes on (0). CPU BLAS rounds by alignment (MKL's
matrix-vector product on an AMD EPYC), so this rule is what makes streamed outputs bit-identical on every CPU.

The weights here are moved to scattered residues first (every multiple of 4 bytes mod 64 occurs), so a path
that loses a residue fails its check whatever the CPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("diffusers")

from layerstream import enable_offload  # noqa: E402
from layerstream.runtime.packing.layout import ALIGN_BYTES, BlockLayout  # noqa: E402
from tests.runtime.tiny_pipelines import dit_components, generate, load, load_wan  # noqa: E402


def _scatter_residues_(pipe) -> None:
    """Give every DiT tensor storage of its own at residue (4 * i) mod 64 (the i-th tensor), bits unchanged."""
    i = 0
    with torch.no_grad():
        for name in dit_components(pipe):
            for module in getattr(pipe, name).modules():
                for table in (module._parameters, module._buffers):
                    for key, t in table.items():
                        if t is None or not t.is_contiguous():
                            continue
                        itemsize = t.element_size()
                        raw = torch.empty(t.numel() * itemsize + 2 * ALIGN_BYTES, dtype=torch.uint8)
                        shift = (4 * i - raw.data_ptr()) % ALIGN_BYTES
                        moved = raw[shift : shift + t.numel() * itemsize].view(t.dtype).view(t.shape)
                        moved.copy_(t)
                        if isinstance(t, nn.Parameter):
                            t.data = moved
                        else:
                            table[key] = moved
                        i += 1


BLOCK_LISTS = ("blocks", "transformer_blocks", "single_transformer_blocks")  # Wan's, Flux's two


def _blocks(pipe):
    """(name prefix, block) of every DiT block of `pipe` (what the built-in plans stream)."""
    for name in dit_components(pipe):
        for attr in BLOCK_LISTS:
            for i, block in enumerate(getattr(getattr(pipe, name), attr, ())):
                yield f"{name}.{attr}.{i}.", block


def _residues(pipe) -> dict[str, int]:
    """Every DiT block tensor's current address residue, by its name in the pipeline."""
    return {
        prefix + key: t.data_ptr() % ALIGN_BYTES
        for prefix, block in _blocks(pipe)
        for key, t in list(block.named_parameters()) + list(block.named_buffers())
    }


def _record_residues_while_computing(pipe) -> tuple[list[tuple[str, int]], list]:
    """(tensor name, residue) for every tensor of every streamed block each time the block computes."""
    seen: list[tuple[str, int]] = []
    hooks = []
    for prefix, block in _blocks(pipe):

        def check(module, args, prefix=prefix):
            # runs inside the block's call, after the streamer bound the block to its slot
            for key, t in list(module.named_parameters()) + list(module.named_buffers()):
                assert t.numel() > 0, f"{prefix}{key} is not bound"
                seen.append((prefix + key, t.data_ptr() % ALIGN_BYTES))

        hooks.append(block.register_forward_pre_hook(check))
    return seen, hooks


def _budget(pipe, fraction: float) -> float:
    sizes = [BlockLayout("b", b).nbytes for name in dit_components(pipe) for b in getattr(pipe, name).blocks]
    return sum(sizes) * fraction / 1e9


def _sharded_store_factory(group_of_one):
    from layerstream.distributed.collectives import BlockGather
    from layerstream.distributed.process_group import GroupMembership
    from layerstream.distributed.sharded_store import ShardedHostStore

    store = ShardedHostStore(BlockGather("WanPipeline", GroupMembership(None, 0, 1, "gloo", torch.device("cpu"))))
    return lambda path: store



CASES = ["packed", "packed-depth-2", "disk-spilled-pool", "disk-checkpoint-pool", "sharded"]


@pytest.mark.parametrize("case", CASES)
def test_every_store_keeps_each_tensors_resident_residue_in_the_slot(case, tmp_path, request):
    source = "checkpoint" if case == "disk-checkpoint-pool" else "in-memory"
    pipe = load_wan(source)
    if source == "in-memory":
        _scatter_residues_(pipe)
    resident = _residues(pipe)
    assert source == "checkpoint" or len(set(resident.values())) == ALIGN_BYTES // 4  # every residue occurs
    expected = generate(pipe, "wan")  # this very pipeline, resident

    config: dict = {"mode": "layer", "components": ["dit"]}
    kwargs = {}
    if case == "packed-depth-2":
        config["layer_options"] = {"dit": {"prefetch_depth": 2}}
    if case.startswith("disk"):
        config.update(host_budget_gb=_budget(pipe, 0.34), disk_dir=str(tmp_path))
    if case == "sharded":
        kwargs["store_factory"] = _sharded_store_factory(request.getfixturevalue("gloo_group_of_one"))
    handle = enable_offload(pipe, config, device="cpu", **kwargs)
    if case.startswith("disk"):
        assert handle.placement.host_tier.from_disk_paths and handle.placement.host_tier.pool.block_paths
    seen, hooks = _record_residues_while_computing(pipe)
    got = generate(pipe, "wan")
    got_again = generate(pipe, "wan")  # the steady state: prefetched, pooled and re-read blocks
    for h in hooks:
        h.remove()
    handle.disable()

    assert {name for name, _ in seen} == set(resident)
    wrong = sorted({(name, r, resident[name]) for name, r in seen if r != resident[name]})
    assert not wrong, f"{len(wrong)} tensors computed at another residue than resident (name, seen, resident): {wrong[:5]}"
    assert torch.equal(got, expected) and torch.equal(got_again, expected)
    assert _residues(pipe) == resident  # disable gives every tensor back at its residue


@pytest.mark.parametrize("kind", ["wan", "flux"])
def test_float8_storage_computes_cast_weights_where_diffusers_casting_does_and_the_rest_where_resident(kind):
    """diffusers' casting hook upcasts each cast weight into a fresh tensor every forward (residue 0); the
    weights it does not cast stay where they are."""
    from diffusers.hooks import apply_layerwise_casting

    from layerstream.runtime.forms.cast_rule import skip_patterns_for

    pipe = load(kind)
    _scatter_residues_(pipe)
    resident = _residues(pipe)
    twin = load(kind)  # which tensors diffusers' casting stores in float8
    cast_names = set()
    for name in dit_components(twin):
        module = getattr(twin, name)
        apply_layerwise_casting(module, torch.float8_e4m3fn, torch.float32, skip_modules_pattern=skip_patterns_for(module))
        cast_names |= {f"{name}.{k}" for k, t in list(module.named_parameters()) + list(module.named_buffers()) if t.dtype == torch.float8_e4m3fn}
    cast_names &= set(resident)  # (diffusers also casts embedders, which stay resident)
    assert cast_names and cast_names != set(resident)
    wanted = {n: (0 if n in cast_names else r) for n, r in resident.items()}
    assert any(r != 0 for n, r in wanted.items() if n not in cast_names)  # the uncast ones are scattered

    config = {"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"storage_dtype": "float8_e4m3fn"}}}
    handle = enable_offload(pipe, config, device="cpu")
    seen, hooks = _record_residues_while_computing(pipe)
    generate(pipe, kind)
    for h in hooks:
        h.remove()
    handle.disable()
    assert seen
    wrong = sorted({(name, r, wanted[name]) for name, r in seen if r != wanted[name]})
    assert not wrong, f"{len(wrong)} tensors computed at another residue (name, seen, wanted): {wrong[:5]}"

