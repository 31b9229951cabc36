"""`host_budget_gb: "auto"`: parsing, reading the host memory, the choice, and what enabling does with it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from layerstream import enable_offload
from layerstream.config.offload_config import OffloadConfigError, parse_offload_config
from layerstream.errors import OffloadError
from layerstream.host.memory import HostMemory, read_host_memory
from layerstream.plan.host_budget import STAGING_RING, choose_host_budget

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from runtime_toys import ToyDiT  # noqa: E402

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast

DIT = {"mode": "layer", "components": ["dit"]}
AUTO = {**DIT, "host_budget_gb": "auto"}
MB = 10**6


# --- the config ----------------------------------------------------------------------------------------------


def test_auto_and_its_reserve_parse_and_round_trip():
    config = parse_offload_config({**AUTO, "host_reserve_gb": 0.5, "disk_dir": "/data/spill"})
    assert (config.host_budget_gb, config.host_reserve_gb, config.disk_dir) == ("auto", 0.5, "/data/spill")
    assert parse_offload_config(config.to_dict()) == config
    assert parse_offload_config(AUTO).host_reserve_gb is None  # the documented default applies


@pytest.mark.parametrize("value", ["Auto", "", "max", [], None])
def test_other_strings_and_types_name_auto_as_allowed(value):
    with pytest.raises(OffloadConfigError) as e:
        parse_offload_config({**DIT, "host_budget_gb": value})
    assert e.value.key_path == "host_budget_gb" and "'auto'" in str(e.value) and "finite number of GB > 0" in str(e.value)


@pytest.mark.parametrize("value", [-1, float("nan"), float("inf"), "1", True])
def test_a_bad_reserve_is_refused_naming_the_key(value):
    with pytest.raises(OffloadConfigError) as e:
        parse_offload_config({**AUTO, "host_reserve_gb": value})
    assert e.value.key_path == "host_reserve_gb" and "finite number of GB >= 0" in str(e.value)


@pytest.mark.parametrize("budget", [None, 8])
def test_a_reserve_without_auto_is_refused(budget):
    obj = {**DIT, "host_reserve_gb": 1} | ({"host_budget_gb": budget} if budget is not None else {})
    with pytest.raises(OffloadConfigError, match=r'host_reserve_gb = 1 .*only used with host_budget_gb "auto"'):
        parse_offload_config(obj)


def test_auto_with_allgather_is_accepted_like_a_number():
    obj = {**AUTO, "host_reserve_gb": 1, "layer_options": {"dit": {"weight_transfer": "allgather"}}}
    config = parse_offload_config(obj)
    assert config.host_budget_gb == "auto" and config.host_reserve_gb == 1.0
    assert parse_offload_config(config.to_dict()) == config


# --- reading the host memory ---------------------------------------------------------------------------------


def _fake_proc(tmp_path: Path, cgroup_lines: str, available_kb: int = 8_000_000) -> Path:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal: 16000000 kB\nMemFree: 1000 kB\nMemAvailable: {available_kb} kB\n")
    (proc / "self" / "cgroup").write_text(cgroup_lines)
    return proc


def _write(folder: Path, **files: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name.replace("_", ".", 1)).write_text(text)


def test_v1_the_tightest_level_binds_and_unlimited_levels_do_not(tmp_path):
    proc = _fake_proc(tmp_path, "4:memory:/job/step\n3:cpu:/\n")
    root = tmp_path / "cgroup"
    _write(root / "memory", memory_limit_in_bytes="9223372036854771712", memory_usage_in_bytes="5000000000")
    _write(root / "memory" / "job", memory_limit_in_bytes="3000000000", memory_usage_in_bytes="1000000000")
    _write(root / "memory" / "job" / "step", memory_limit_in_bytes="9223372036854771712", memory_usage_in_bytes="600000000")
    memory = read_host_memory(proc, root)
    assert memory.available_nbytes == 8_000_000 * 1024
    assert memory.cgroup.folder == str(root / "memory" / "job") and memory.cgroup.version == 1
    assert memory.free_nbytes == 2_000_000_000  # the job's limit minus its usage, below MemAvailable
    assert "cgroup v1" in memory.describe() and "MemAvailable" in memory.describe()


def test_v2_memory_max_and_a_namespaced_root(tmp_path):
    proc = _fake_proc(tmp_path, "0::/user.slice/app.scope\n")
    root = tmp_path / "cgroup"  # the process's own folder is not there: a cgroup namespace shows it as the root
    _write(root, memory_max="1500000000", memory_current="500000000")
    assert read_host_memory(proc, root).free_nbytes == 1_000_000_000
    _write(root, memory_max="max", memory_current="500000000")
    assert read_host_memory(proc, root).cgroup is None  # no limit: MemAvailable alone
    assert read_host_memory(proc, root).free_nbytes == 8_000_000 * 1024


def test_reclaimable_page_cache_is_left_out_of_the_working_set(tmp_path):
    proc = _fake_proc(tmp_path, "4:memory:/job\n")
    root = tmp_path / "cgroup"
    _write(root / "memory" / "job", memory_limit_in_bytes="3000000000", memory_usage_in_bytes="2000000000")
    stat = "total_inactive_file 500000000\ntotal_active_file 400000000\ntotal_mapped_file 300000000\ntotal_dirty 50000000\n"
    (root / "memory" / "job" / "memory.stat").write_text("inactive_file 1\n" + stat)  # this level alone: not the hierarchy
    memory = read_host_memory(proc, root)
    # the inactive cache (0.5 GB) and the active one that is neither mapped nor dirty (0.9 - 0.3 - 0.05 = 0.55 GB)
    assert memory.cgroup.working_set_nbytes == 2_000_000_000 - 550_000_000
    assert memory.free_nbytes == 3_000_000_000 - 1_450_000_000
    assert "working set 1.45 GB (usage 2 GB - reclaimable page cache 0.55 GB, inactive file 0.5 GB)" in memory.describe()
    (root / "memory" / "job" / "memory.stat").write_text("total_inactive_file 500000000\ntotal_active_file 0\ntotal_mapped_file 300000000\n")
    # mapped pages on the inactive list stay counted (docker's figure would leave them out): 0.5 - 0.3 reclaimable
    assert read_host_memory(proc, root).free_nbytes == 3_000_000_000 - 1_800_000_000
    _write(root, memory_max="1500000000", memory_current="900000000", memory_stat="inactive_file 400000000\nfile_mapped 0\n")
    assert read_host_memory(_fake_proc(tmp_path / "v2", "0::/\n"), root).free_nbytes == 1_000_000_000  # v2's keys


def test_mapped_pages_under_the_blocks_views_count_as_reclaimable_in_the_cgroup(tmp_path):
    import os

    from torch import nn

    from layerstream.host.memory import CgroupLimit
    from layerstream.offload import mapped_view_nbytes
    from layerstream.runtime.packing.file_reads import PAGE_BYTES

    path = tmp_path / "weights.bin"
    path.write_bytes(os.urandom(64 * PAGE_BYTES))
    mapped = torch.from_file(str(path), shared=False, size=64 * PAGE_BYTES, dtype=torch.uint8)  # a private mapping
    block = nn.Module()
    block.a = nn.Parameter(mapped[: 10 * PAGE_BYTES + 100], requires_grad=False)
    block.b = nn.Parameter(mapped[10 * PAGE_BYTES + 100 : 30 * PAGE_BYTES], requires_grad=False)
    block.own = nn.Parameter(torch.ones(PAGE_BYTES, dtype=torch.uint8), requires_grad=False)  # not a view: not counted
    pipe = nn.Module()
    pipe.blocks = nn.ModuleList([block])
    assert mapped_view_nbytes(pipe, ["blocks.0"]) == 0  # nothing faulted in yet
    block.a.sum(), block.b.sum()
    assert mapped_view_nbytes(pipe, ["blocks.0"]) == 30 * PAGE_BYTES  # the page the two views share, once
    cgroup = CgroupLimit(1, "/job", limit_nbytes=1000 * MB, usage_nbytes=600 * MB, reclaimable_nbytes=100 * MB, mapped_file_nbytes=20 * MB)
    memory = HostMemory(None, cgroup)
    assert memory.releasing_mapped(5 * MB).free_nbytes == 1000 * MB - (600 - 100 - 5) * MB
    assert memory.releasing_mapped(50 * MB).free_nbytes == 1000 * MB - (600 - 100 - 20) * MB  # at most its mapped pages
    assert "with 5 MB mapped under the streamed blocks' views" in memory.releasing_mapped(5 * MB).describe()
    assert HostMemory(7 * MB).releasing_mapped(5 * MB).free_nbytes == 7 * MB  # MemAvailable counts them already


def test_hybrid_v2_under_unified_and_nothing_readable(tmp_path):
    proc = _fake_proc(tmp_path, "0::/a\n", available_kb=100)
    _write(tmp_path / "cgroup" / "unified" / "a", memory_max="4096000", memory_current="0")
    assert read_host_memory(proc, tmp_path / "cgroup").free_nbytes == 100 * 1024  # MemAvailable is smaller here
    assert HostMemory(None).free_nbytes is None and read_host_memory(tmp_path / "none", tmp_path / "none").free_nbytes is None


# --- the choice ----------------------------------------------------------------------------------------------


NEEDS = {STAGING_RING: 30 * MB, "slot ring": 20 * MB, "reserve (host_reserve_gb)": 50 * MB}


def test_everything_fits_without_the_staging_ring_gives_no_disk_tier():
    choice = choose_host_budget(free_nbytes=200 * MB, free_source="test", streamed_nbytes=130 * MB, needs=NEEDS)
    assert choice.budget_nbytes is None and "no disk tier" in choice.describe() and STAGING_RING not in choice.describe()


def test_otherwise_the_budget_is_what_is_left_and_held_blocks_count_as_free():
    choice = choose_host_budget(free_nbytes=200 * MB, free_source="test", streamed_nbytes=500 * MB, needs=NEEDS)
    assert choice.budget_nbytes == 100 * MB and "a budget of 0.1 GB" in choice.describe()
    held = choose_host_budget(free_nbytes=200 * MB, free_source="test", streamed_nbytes=500 * MB, needs=NEEDS, held_nbytes=40 * MB)
    assert held.budget_nbytes == 140 * MB


def test_too_little_memory_is_an_error_naming_the_figures():
    with pytest.raises(OffloadError, match=r"99 MB of host memory is free \(test\).*slot ring 20 MB.*host_reserve_gb"):
        choose_host_budget(free_nbytes=99 * MB, free_source="test", streamed_nbytes=500 * MB, needs=NEEDS)


# --- enabling --------------------------------------------------------------------------------------------------


def _toy():
    torch.manual_seed(0)
    model = ToyDiT(dim=64, num_blocks=6).eval()
    x = torch.randn(2, 8, 64)
    with torch.inference_mode():
        return model, x, model(x)


def test_where_everything_fits_auto_keeps_every_block_in_host_memory():
    model, x, expected = _toy()
    handle = enable_offload(model, AUTO, device="cpu")
    try:
        with torch.inference_mode():
            assert torch.equal(model(x), expected)
        assert handle.placement.host_tier is None and handle.plan.config.host_budget_gb is None
        stats = handle.stats()
        assert stats.disk_bytes_read == 0 and "no disk tier" in stats.host_budget and "MemAvailable" in stats.host_budget
        assert "host_budget_gb" in str(stats)
    finally:
        handle.disable()


def test_a_small_machine_puts_the_blocks_beyond_what_it_allows_on_disk(monkeypatch, tmp_path):
    import layerstream.offload as offload
    from layerstream.plan.resolver import resolve_offload_plan

    model, x, expected = _toy()
    config = {**AUTO, "host_reserve_gb": 50_000 / 1e9, "disk_dir": str(tmp_path)}
    monkeypatch.setattr(offload, "read_host_memory", lambda: HostMemory(10**12))
    plan = resolve_offload_plan(model, parse_offload_config(config))
    roomy = offload.resolve_host_budget(model, plan, torch.device("cpu"))[1]
    assert roomy.budget_nbytes is None  # a large machine: no disk tier
    assert roomy.held_nbytes == roomy.streamed_nbytes  # an in-memory model: packing frees its blocks
    block = roomy.streamed_nbytes // 6
    free = sum(roomy.needs.values()) - roomy.held_nbytes + 5 * block // 2  # room for two and a half blocks
    monkeypatch.setattr(offload, "read_host_memory", lambda: HostMemory(free))
    handle = enable_offload(model, config, device="cpu")
    try:
        with torch.inference_mode():
            assert torch.equal(model(x), expected)
        tier, choice = handle.placement.host_tier, handle.placement.host_budget
        assert choice.budget_nbytes == 5 * block // 2
        assert len(tier.host_block_paths) == 2 and len(tier.disk_block_paths) == 4
        assert handle.stats().host_bytes <= choice.budget_nbytes + choice.needs[STAGING_RING]
        assert "a budget of" in handle.stats().host_budget and handle.stats().disk_bytes_read > 0
    finally:
        handle.disable()


def test_too_small_a_machine_refuses_before_anything_changes(monkeypatch):
    import layerstream.offload as offload

    model, x, expected = _toy()
    before = {k: (v, v.data_ptr()) for k, v in model.named_parameters()}
    monkeypatch.setattr(offload, "read_host_memory", lambda: HostMemory(1000))
    with pytest.raises(OffloadError, match=r'host_budget_gb = "auto".*free'):
        enable_offload(model, {**AUTO, "host_reserve_gb": 0.001}, device="cpu")  # more than the toy blocks
    assert {k: (v, v.data_ptr()) for k, v in model.named_parameters()} == before  # the same tensors, untouched
    with torch.inference_mode():
        assert torch.equal(model(x), expected)


# --- float8 with "auto" ----------------------------------------------------------------------------------------

FP8_AUTO = {**AUTO, "layer_options": {"dit": {"storage_dtype": "float8_e4m3fn"}}}


def _fp8_expected(model, x):
    handle = enable_offload(model, {**DIT, "layer_options": FP8_AUTO["layer_options"]}, device="cpu")
    try:
        with torch.inference_mode():
            return model(x)
    finally:
        handle.disable()


def _roomy_choice(model, config, monkeypatch):
    import layerstream.offload as offload
    from layerstream.plan.resolver import resolve_offload_plan

    monkeypatch.setattr(offload, "read_host_memory", lambda: HostMemory(10**12))
    plan = resolve_offload_plan(model, parse_offload_config(config))
    return offload.resolve_host_budget(model, plan, torch.device("cpu"))[1]


def test_float8_blocks_in_memory_are_not_counted_as_freed_while_enabling(monkeypatch, tmp_path):
    """The float8 stores keep a block's original tensors until the commit (an exact rollback), so an in-memory
    model's blocks are not freed while the float8 bytes are made: "auto" must find room for those beside them."""
    import layerstream.offload as offload

    model, x, _ = _toy()
    expected = _fp8_expected(model, x)
    config = {**FP8_AUTO, "host_reserve_gb": 0.0, "disk_dir": str(tmp_path)}
    roomy = _roomy_choice(model, config, monkeypatch)
    assert roomy.held_nbytes == 0  # held in memory, but not freed before the commit
    free = sum(roomy.needs.values()) + roomy.streamed_nbytes // 3  # room for a third of the float8 blocks
    monkeypatch.setattr(offload, "read_host_memory", lambda: HostMemory(free))
    handle = enable_offload(model, config, device="cpu")
    try:
        choice = handle.placement.host_budget
        assert choice.budget_nbytes == roomy.streamed_nbytes // 3  # a disk tier: the originals stay until commit
        with torch.inference_mode():
            assert torch.equal(model(x), expected)
        stats = handle.stats()
        assert stats.host_bytes <= choice.budget_nbytes and stats.disk_bytes_read > 0
    finally:
        handle.disable()


def test_the_staging_ring_is_priced_in_stored_float8_bytes(monkeypatch, tmp_path):
    """The disk tier's staging ring holds stored bytes (float8), not a whole slot (compute layout and staging
    region): "auto" prices it as the ring enabling makes, so the budget is not short by twice the ring."""
    import layerstream.offload as offload

    model, x, _ = _toy()
    expected = _fp8_expected(model, x)
    config = {**FP8_AUTO, "host_reserve_gb": 0.0, "disk_dir": str(tmp_path)}
    roomy = _roomy_choice(model, config, monkeypatch)
    free = sum(roomy.needs.values()) + roomy.streamed_nbytes // 4
    monkeypatch.setattr(offload, "read_host_memory", lambda: HostMemory(free))
    handle = enable_offload(model, config, device="cpu")
    try:
        with torch.inference_mode():
            assert torch.equal(model(x), expected)
        choice, stats = handle.placement.host_budget, handle.stats()
        assert choice.budget_nbytes is not None and stats.disk_staging_bytes == choice.needs[STAGING_RING]
    finally:
        handle.disable()
