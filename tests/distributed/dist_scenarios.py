"""What each rank runs in the distributed tests (see dist_harness). Each returns plain data the test checks.

`roundtrip` runs on the device each rank joined the group for; the failure scenarios run on the CPU (gloo),
whatever `device` says, since what they check is the protocol between ranks.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from dist_toys import config, make_inputs, make_pipeline, run, same_state, snapshot
from layerstream import enable_offload
from layerstream.distributed.launch import gather_objects
from layerstream.errors import OffloadError, TransferError


def _untouched(pipe, params, state) -> bool:
    hooks = any(m._forward_pre_hooks or m._forward_hooks for m in pipe.modules())
    same_params = all(p is params[k] for k, p in pipe.named_parameters())
    return not hooks and same_params and same_state(state, snapshot(pipe))


def roundtrip(rank: int, world_size: int, *, device: torch.device) -> dict:
    """Allgather on the DiT and the replicated encoder: outputs, host bytes, disable; then a second cycle on an
    explicit group with a resident block and a deeper prefetch."""
    pipe = make_pipeline().to(device)
    inputs = tuple(t.to(device) for t in make_inputs(seed=10 + rank))  # data parallel: own inputs, same weights
    expected = run(pipe, inputs)
    state, params = snapshot(pipe), dict(pipe.named_parameters())
    out: dict = {}

    local = enable_offload(pipe, config(transfer="rank-local"), device=device)
    out["local_host_bytes"] = local.stats().host_bytes
    out["local_equal"] = torch.equal(run(pipe, inputs), expected)
    local.disable()

    handle = enable_offload(pipe, config(), device=device)
    out["engine"] = handle.stats().engine
    out["evicted"] = pipe.transformer.blocks[1].proj.weight.numel() == 0 and pipe.prompt_model.encoder.layers[0].proj.weight.numel() == 0
    out["equal"] = [torch.equal(run(pipe, inputs), expected) for _ in range(3)]
    stats = handle.stats()
    out["host_bytes"] = stats.host_bytes
    out["num_streamed_blocks"] = stats.num_streamed_blocks
    out["num_transfers"] = stats.num_transfers
    out["bytes_transferred"] = stats.bytes_transferred
    out["slot_bytes"] = stats.slot_bytes
    out["num_slots"] = stats.num_slots
    out["block_nbytes"] = [b.host.layout.nbytes for b in handle.streamer.blocks]
    out["shard_nbytes"] = [b.host.host_bytes for b in handle.streamer.blocks]
    handle.disable()
    out["restored_state"] = same_state(state, snapshot(pipe))
    out["restored_params"] = all(p is params[k] for k, p in pipe.named_parameters())
    out["equal_after_disable"] = torch.equal(run(pipe, inputs), expected)

    group = dist.new_group(list(range(world_size)))
    second = enable_offload(pipe, config(("dit",), resident_layers=1, prefetch_depth=2), device=device, process_group=group)
    out["second_equal"] = [torch.equal(run(pipe, inputs), expected) for _ in range(2)]
    out["second_resident_block_kept"] = pipe.transformer.blocks[0].proj.weight.numel() > 0
    out["second_stats"] = (second.stats().num_streamed_blocks, second.stats().num_resident_blocks, second.stats().num_slots)
    second.disable()
    out["second_restored"] = same_state(state, snapshot(pipe)) and torch.equal(run(pipe, inputs), expected)

    mixed = config(("dit", "text_encoder"))
    mixed["layer_options"]["text_encoder"]["weight_transfer"] = "rank-local"
    third = enable_offload(pipe, mixed, device=device)
    out["mixed_equal"] = torch.equal(run(pipe, inputs), expected)
    per = third.stats().per_component
    out["mixed_host_bytes"] = (per["transformer"].host_bytes, per["prompt_model"].host_bytes)
    third.disable()
    out["mixed_restored"] = same_state(state, snapshot(pipe))

    out["summaries"] = gather_objects({"rank": rank, "host_bytes": out["host_bytes"]})
    return out


def mismatch(rank: int, world_size: int, *, device: torch.device) -> dict:
    """Ranks that cannot agree: different shapes; a local check failing on one rank; a failure while applying
    on one rank. Every rank must raise OffloadError promptly and be left untouched; the group stays usable."""
    out: dict = {}
    pipe = make_pipeline(dim=24 if rank == 0 else 32)  # rank 1 loaded another model
    state, params = snapshot(pipe), dict(pipe.named_parameters())
    try:
        enable_offload(pipe, config(), device="cpu")
        out["shapes"] = "enabled"
    except OffloadError as e:
        out["shapes"] = str(e)
    out["shapes_untouched"] = _untouched(pipe, params, state)

    pipe = make_pipeline()
    if rank == 1:  # a weight shared between a block and a resident module: only rank 1's own check fails
        pipe.transformer.head.weight = torch.nn.Parameter(pipe.transformer.blocks[1].out.weight.data[:, :24])
    state, params = snapshot(pipe), dict(pipe.named_parameters())
    try:
        enable_offload(pipe, config(), device="cpu")
        out["local_check"] = "enabled"
    except OffloadError as e:
        out["local_check"] = str(e)
    out["local_check_untouched"] = _untouched(pipe, params, state)

    pipe = make_pipeline()
    inputs = make_inputs(seed=3)
    expected = run(pipe, inputs)
    state, params = snapshot(pipe), dict(pipe.named_parameters())
    import layerstream.distributed.sharded_store as sharded_store

    real_stage = sharded_store.ShardedHostStore.stage_
    calls = {"n": 0}

    def failing_stage(self, *args, **kwargs):
        calls["n"] += 1
        if rank == 1 and calls["n"] == 3:
            raise MemoryError("simulated allocation failure")
        return real_stage(self, *args, **kwargs)

    sharded_store.ShardedHostStore.stage_ = failing_stage
    try:
        enable_offload(pipe, config(), device="cpu")
        out["apply"] = "enabled"
    except (OffloadError, MemoryError) as e:  # the failing rank's MemoryError comes out as itself
        out["apply"] = f"{type(e).__name__}: {e}"
    finally:
        sharded_store.ShardedHostStore.stage_ = real_stage
    out["apply_untouched"] = _untouched(pipe, params, state) and torch.equal(run(pipe, inputs), expected)

    handle = enable_offload(pipe, config(), device="cpu")  # and every rank can still enable together
    out["afterwards_equal"] = torch.equal(run(pipe, inputs), expected)
    handle.disable()
    return out


def rank_fails(rank: int, world_size: int, *, device: torch.device, then: str) -> dict:
    """Rank 1 raises inside block 2 of its first forward, then either stays alive without issuing anything
    (`then="idle"`) or exits (`then="exit"`). Rank 0 keeps generating and must end with TransferError."""
    pipe = make_pipeline()
    inputs = make_inputs(seed=5)
    handle = enable_offload(pipe, config(("dit",)), device="cpu")
    out: dict = {}
    if rank == 1:
        def boom(module, args):
            raise RuntimeError("boom in block 2")

        pipe.transformer.blocks[2].register_forward_pre_hook(boom)
        try:
            run(pipe, inputs)
        except RuntimeError as e:
            out["raised"] = str(e)
        if then == "exit":
            os._exit(17)  # a crashed rank: its connections close
        time.sleep(float(os.environ["LAYERSTREAM_COLLECTIVE_TIMEOUT"]) + 1.5)  # alive, but issues nothing more
        return out
    try:
        for _ in range(5):
            run(pipe, inputs)
        out["error"] = None
    except TransferError as e:
        out["error"] = str(e)
    try:
        handle.disable()
        out["disable"] = "ok"
    except TransferError as e:
        out["disable"] = f"TransferError: {e}"
    return out


def diverge(rank: int, world_size: int, *, device: torch.device) -> dict:
    """Rank 1 skips block 1 in every forward: the ranks' transfers part ways. Both must raise TransferError
    naming what each asked for, keep raising without a collective, and still restore at disable."""
    pipe = make_pipeline()
    inputs = make_inputs(seed=7)
    skip = (1,) if rank == 1 else ()
    expected = run(pipe, inputs, skip)
    state = snapshot(pipe)
    handle = enable_offload(pipe, config(("dit",)), device="cpu")
    out: dict = {"forwards": 0}
    try:
        for _ in range(4):
            assert torch.equal(run(pipe, inputs, skip), expected)
            out["forwards"] += 1
        out["error"] = None
    except TransferError as e:
        out["error"] = str(e)
    try:
        run(pipe, inputs, skip)
        out["again"] = "ran"
    except TransferError as e:
        out["again"] = str(e)
    handle.disable()
    out["restored"] = same_state(state, snapshot(pipe)) and torch.equal(run(pipe, inputs, skip), expected)
    return out


def _float8_config(transfer: str, float8_encoder: bool) -> dict:
    """Both components streamed with `transfer`; the DiT stored in float8 (and the encoder, with `float8_encoder`)."""
    out = config(("dit", "text_encoder"), transfer=transfer, storage_dtype="float8_e4m3fn")
    if float8_encoder:
        out["layer_options"]["text_encoder"]["storage_dtype"] = "float8_e4m3fn"
    return out


def float8_allgather(rank: int, world_size: int, *, device: torch.device) -> dict:
    """float8 storage with allgather against float8 in one process (rank-local): outputs, host bytes per rank,
    and the weights disable gives back; with the encoder in float8 too, and with it as it is (one sharded
    store, two forms)."""
    inputs = tuple(t.to(device) for t in make_inputs(seed=20 + rank))  # data parallel: own inputs, same weights
    out: dict = {}
    for float8_encoder in (True, False):
        key = "both" if float8_encoder else "dit"
        local_pipe = make_pipeline().to(device)
        local = enable_offload(local_pipe, _float8_config("rank-local", float8_encoder), device=device)
        expected = run(local_pipe, inputs)
        local_stats = local.stats()
        local_blocks = {b.path: b.host.link_bytes for b in local.streamer.blocks}  # the stored bytes, whole
        local.disable()

        pipe = make_pipeline().to(device)
        handle = enable_offload(pipe, _float8_config("allgather", float8_encoder), device=device)
        out[f"{key}_equal"] = [torch.equal(run(pipe, inputs), expected) for _ in range(3)]
        stats = handle.stats()
        out[f"{key}_host_bytes"] = (stats.host_bytes, local_stats.host_bytes)
        out[f"{key}_shards"] = {b.path: (b.host.host_bytes, local_blocks[b.path], type(b.host).__name__) for b in handle.streamer.blocks}
        out[f"{key}_link_bytes"] = {b.path: b.host.link_bytes for b in handle.streamer.blocks}
        handle.disable()
        out[f"{key}_restored"] = same_state(snapshot(local_pipe), snapshot(pipe))  # the float8-rounded weights
        out[f"{key}_equal_after_disable"] = torch.equal(run(pipe, inputs), run(local_pipe, inputs))
    out["lossless"] = _lossless_allgather(rank, device)  # in the same launch: ranks are slow to start
    return out


def _lossless_allgather(rank: int, device: torch.device) -> dict:
    """storage_dtype "lossless" with allgather on a bfloat16 pipeline wide enough to code, against the same
    weights streamed uncompressed in one process: outputs, each rank's shard of the coded bytes, disable."""
    ids, x = make_inputs(seed=30 + rank, dim=64)
    inputs = (ids.to(device), x.to(device, torch.bfloat16))
    plain_pipe = make_pipeline(dim=64).to(device, torch.bfloat16)
    plain = enable_offload(plain_pipe, config(("dit", "text_encoder"), transfer="rank-local"), device=device)
    expected = run(plain_pipe, inputs)
    plain.disable()
    pipe = make_pipeline(dim=64).to(device, torch.bfloat16)
    original = snapshot(pipe)
    lossless = config(("dit", "text_encoder"), transfer="allgather", storage_dtype="lossless")
    lossless["layer_options"]["text_encoder"]["storage_dtype"] = "lossless"
    handle = enable_offload(pipe, lossless, device=device)
    out = {"equal": [torch.equal(run(pipe, inputs), expected) for _ in range(2)]}
    stats = handle.stats()
    out["stored_decoded"] = (stats.lossless_stored_bytes, stats.lossless_decoded_bytes)
    out["shards"] = {b.path: (b.host.host_bytes, b.host.form.stored_nbytes, type(b.host).__name__) for b in handle.streamer.blocks}
    handle.disable()
    out["restored"] = same_state(original, snapshot(pipe))
    return out


# --- allgather with host_budget_gb: each rank's shards beyond its budget go through the disk tier -----------------

_WAN_CALL = dict(height=32, width=32, num_frames=5, num_inference_steps=2, guidance_scale=4.0, output_type="latent")


def _generate_wan(pipe) -> torch.Tensor:
    out = pipe("a red fox in the snow", generator=torch.Generator().manual_seed(0), **_WAN_CALL)
    return out.frames.clone()


def _rss_bytes() -> int:
    """This process's resident set (VmRSS of /proc/self/status)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def _wan_state(pipe) -> dict[str, torch.Tensor]:
    return {f"{name}.{k}": v for name in ("transformer", "transformer_2") for k, v in snapshot(getattr(pipe, name)).items()}


def _files_under(root) -> list[str]:
    return sorted(str(p) for p in root.rglob("*") if p.is_file())


def _parts(handle) -> dict[str, tuple[str, str, int]]:
    """Per streamed block: (its stored block's class, what of it this process keeps, bytes kept of it)."""
    out = {}
    for b in handle.streamer.blocks:
        part = getattr(b.host, "part", None)  # a disk-tier block; a host-memory block is its own
        out[b.path] = (type(b.host).__name__, type(part).__name__ if part is not None else "", b.host.link_bytes)
    return out


def _wan_with_budget(out: dict, pipe, expected, config: dict, key: str, device) -> None:
    """Enable `config` on tiny Wan, generate twice, read the stats, the VmRSS growth and the parts, disable."""
    from pathlib import Path
    state = _wan_state(pipe)
    rss_before = _rss_bytes()
    handle = enable_offload(pipe, config, device=device)
    rss_after = _rss_bytes()
    out[f"{key}_equal"] = [torch.equal(_generate_wan(pipe), expected) for _ in range(2)]
    stats = handle.stats()
    out[f"{key}_stats"] = {
        name: getattr(stats, name)
        for name in ("host_bytes", "disk_bytes_read", "host_pool_bytes", "disk_staging_bytes", "slot_bytes", "num_transfers")
    }
    out[f"{key}_rss_growth"] = rss_after - rss_before
    tier = handle.placement.host_tier
    out[f"{key}_tier"] = None if tier is None else (tier.budget_nbytes, len(tier.host_block_paths), len(tier.disk_block_paths), tier.pool is not None)
    choice = handle.placement.host_budget
    out[f"{key}_choice"] = None if choice is None else choice.to_dict()
    out[f"{key}_parts"] = _parts(handle)
    out[f"{key}_block_nbytes"] = {b.path: b.host.layout.nbytes for b in handle.streamer.blocks}
    out[f"{key}_spill_files"] = len(_files_under(Path(config["disk_dir"])))
    handle.disable()
    out[f"{key}_restored"] = same_state(state, _wan_state(pipe)) and torch.equal(_generate_wan(pipe), expected)


def allgather_budget(rank: int, world_size: int, *, device: torch.device, disk_dir: str, gguf_expert: str) -> dict:
    """Tiny Wan 2.2 (two alternating DiTs, read from its checkpoint's files) with allgather and a host budget
    of about two shards per rank: the shards beyond it in the host pool and on disk (the checkpoint ranges in
    each rank's shard). Then "auto" (each rank's share of the host's free memory, real and faked), and the toy
    pipeline with a budget of its own per rank (the ranks place different blocks on disk)."""
    from pathlib import Path

    import layerstream.offload as offload
    from layerstream.distributed.collectives import shard_nbytes
    from layerstream.host.memory import HostMemory
    from layerstream.runtime.packing.layout import BlockLayout
    from layerstream.models.loading import load_pipeline

    root = Path(disk_dir) / f"rank{rank}"
    out: dict = {}
    pipe = load_pipeline("tiny-wan")
    pipe.set_progress_bar_config(disable=True)
    expected = _generate_wan(pipe)  # the resident pipeline in this one process
    dit = {"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"weight_transfer": "allgather"}}}

    # the first enable of the pipeline as loaded: its DiT blocks are views of the checkpoint's files (a disable
    # gives them back as tensors of their own, which later enables spill)
    block = pipe.transformer.blocks[0]
    block_shard = shard_nbytes(BlockLayout("transformer.blocks.0", block, device).nbytes, world_size)
    out["shard_nbytes"] = block_shard
    budget = 2 * block_shard + block_shard // 2  # two shards per rank fit
    out["budget"] = budget
    _wan_with_budget(out, pipe, expected, {**dit, "host_budget_gb": budget / 1e9, "disk_dir": str(root)}, "wan", device)
    out["wan_files_left"] = _files_under(root)

    # "auto": this rank's share of the host's free memory, as read
    _wan_with_budget(out, pipe, expected, {**dit, "host_budget_gb": "auto", "disk_dir": str(root)}, "auto", device)
    # and with a host whose free memory leaves each rank about two shards beside what runs beside the store
    needs = {k: v for k, v in out["auto_choice"]["needs"].items() if not k.startswith("reserve")}
    free = 2 * (sum(needs.values()) + 2 * block_shard + block_shard // 2)
    out["faked_free"] = free
    real = offload.read_host_memory
    offload.read_host_memory = lambda: HostMemory(available_nbytes=free)
    try:
        faked = {**dit, "host_budget_gb": "auto", "host_reserve_gb": 0, "disk_dir": str(root)}
        _wan_with_budget(out, pipe, expected, faked, "faked", device)
    finally:
        offload.read_host_memory = real
    out["faked_needs"] = needs

    # the toy pipeline, both components sharded, with another budget on each rank: other blocks on disk
    toy = make_pipeline()
    inputs = make_inputs(seed=30 + rank)
    toy_expected, toy_state = run(toy, inputs), snapshot(toy)
    probe = enable_offload(toy, config(), device=device)
    toy_shards = {b.path: b.host.host_bytes for b in probe.streamer.blocks}
    probe.disable()
    toy_budget = sum(sorted(toy_shards.values())[: 2 + 3 * rank])  # rank 0: two shards, rank 1: five
    toy_config = {**config(), "host_budget_gb": toy_budget / 1e9, "disk_dir": str(root)}
    handle = enable_offload(toy, toy_config, device=device)
    out["toy_equal"] = [torch.equal(run(toy, inputs), toy_expected) for _ in range(3)]
    out["toy_budget"] = toy_budget
    out["toy_host_bytes"] = handle.stats().host_bytes
    out["toy_host_blocks"] = handle.placement.host_tier.host_block_paths
    out["toy_parts"] = _parts(handle)
    out["toy_issue_thread"] = {b.host.copy_waits_on_host for b in handle.streamer.blocks}
    out["toy_spill_files"] = len(_files_under(root))
    handle.disable()
    out["toy_restored"] = same_state(toy_state, snapshot(toy)) and torch.equal(run(toy, inputs), toy_expected)
    out["toy_files_left"] = _files_under(root)
    out["lossless"] = _lossless_with_budget(rank, device, root)  # in the same launch: ranks are slow to start
    out["gguf"] = _gguf_expert_allgather(gguf_expert, expected, dit, device) if gguf_expert else None
    return out


def _gguf_expert_allgather(gguf_expert: str, folder_output: torch.Tensor, dit: dict, device) -> dict:
    """Tiny Wan 2.2 with its low-noise expert from a GGUF file, sharded by allgather, against the same pipeline
    resident in this one process; `folder_output`: the folder's weights' output (the file's must differ)."""
    from layerstream.models.loading import load_pipeline

    pipe = load_pipeline("tiny-wan", components={"transformer_2": gguf_expert})
    pipe.set_progress_bar_config(disable=True)
    expected = _generate_wan(pipe)
    try:
        handle = enable_offload(pipe, dit, device=device)
    except OffloadError as e:  # the ranks disagree (each raises, nothing changed): for its test alone to report
        return {"error": str(e)}
    out = {"equal": [torch.equal(_generate_wan(pipe), expected) for _ in range(2)]}
    out["differs_from_folder"] = not torch.equal(expected, folder_output)
    out["weight"] = type(pipe.transformer_2.blocks[0].ffn.net[2].weight).__name__  # as the file stores it
    out["shards"] = {b.path: (type(b.host).__name__, b.host.host_bytes, b.host.layout.nbytes) for b in handle.streamer.blocks}
    handle.disable()
    out["restored"] = torch.equal(_generate_wan(pipe), expected)
    return out


def _lossless_with_budget(rank: int, device: torch.device, root) -> dict:
    """storage_dtype "lossless" with allgather and a host budget of two coded shards per rank, on a bfloat16 toy
    wide enough to code: the coded shards beyond the budget spill to disk and are read back coded; outputs
    against the same weights streamed uncompressed in one process."""
    ids, x = make_inputs(seed=40 + rank, dim=64)
    inputs = (ids.to(device), x.to(device, torch.bfloat16))
    plain_pipe = make_pipeline(dim=64).to(device, torch.bfloat16)
    plain = enable_offload(plain_pipe, config(("dit",), transfer="rank-local"), device=device)
    expected = run(plain_pipe, inputs)
    plain.disable()
    pipe = make_pipeline(dim=64).to(device, torch.bfloat16)
    original = snapshot(pipe)
    lossless = config(("dit",), storage_dtype="lossless")
    probe = enable_offload(pipe, lossless, device=device)
    shards = sorted(b.host.host_bytes for b in probe.streamer.blocks)
    probe.disable()
    budget = shards[0] + shards[1] + shards[2] // 2  # two coded shards fit
    handle = enable_offload(pipe, {**lossless, "host_budget_gb": budget / 1e9, "disk_dir": str(root / "lossless")}, device=device)
    out = {"equal": [torch.equal(run(pipe, inputs), expected) for _ in range(2)], "budget": budget, "shards": shards}
    stats = handle.stats()
    out["stats"] = {
        "host_bytes": stats.host_bytes, "disk_bytes_read": stats.disk_bytes_read,
        "stored": stats.lossless_stored_bytes, "decoded": stats.lossless_decoded_bytes,
    }  # fmt: skip
    out["parts"] = _parts(handle)
    out["coded_nbytes"] = {b.path: b.host.form.stored_nbytes for b in handle.streamer.blocks}
    out["spill_files"] = len(_files_under(root / "lossless"))
    handle.disable()
    out["restored"] = same_state(original, snapshot(pipe)) and torch.equal(run(pipe, inputs), expected)
    out["files_left"] = _files_under(root / "lossless")
    return out
