"""Human-readable reports of a `BenchResult`: a header of run facts and a markdown table, one row per strategy."""

from __future__ import annotations

from strategy_bench.results import BenchResult, StrategyResult

MIB = 2**20

COLUMNS = (
    "strategy",
    "ms/fwd",
    "min ms",
    "x resident",
    "x ideal",
    "x floor",
    "device peak MiB",
    "host RSS peak MiB",
    "enable host +MiB",
    "streamed MiB/fwd",
    "stall ms/fwd",
    "enable s",
    "= resident",
    "max |diff|",
    "notes",
)


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MIB:,.1f}"


def _cells(s: StrategyResult) -> list[str]:
    if s.skipped:
        return [s.strategy] + ["-"] * (len(COLUMNS) - 2) + [s.note]
    # the runtime's residency reads "N/M blocks resident: why"; the table keeps the count, the JSON the why
    residency = s.residency.split(":", 1)[0] if s.residency else ""
    notes = [n for n in (s.note, residency) if n]
    return [
        s.strategy,
        _num(s.median_seconds * 1e3 if s.median_seconds is not None else None, ".2f"),
        _num(s.min_seconds * 1e3 if s.min_seconds is not None else None, ".2f"),
        _num(s.ratio_to_resident, ".3f"),
        _num(s.measured_over_ideal, ".3f"),
        _num(s.measured_over_floor, ".3f"),
        _mib(s.device_peak_bytes),
        _mib(s.host_rss_peak_bytes),
        _mib(s.host_enable_delta_bytes),
        _mib(s.bytes_streamed_per_forward),
        _num(s.stall_seconds_per_forward * 1e3 if s.stall_seconds_per_forward is not None else None, ".2f"),
        _num(s.enable_seconds, ".3f"),
        "-" if s.matches_resident is None else ("yes" if s.matches_resident else "NO"),
        _num(s.max_abs_diff, ".3g"),
        "; ".join(notes),
    ]


def markdown_table(result: BenchResult) -> str:
    """The strategies as a markdown table (with the disk columns before the notes when a row used the disk tier)."""
    columns, cells = COLUMNS, _cells
    if any(s.num_disk_blocks for s in result.strategies):
        columns = COLUMNS[:-1] + DISK_COLUMNS + COLUMNS[-1:]

        def cells(s: StrategyResult) -> list[str]:
            row = _cells(s)
            return row[:-1] + _disk_cells(s) + row[-1:]

    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for s in result.strategies:
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells(s)) + " |")
    return "\n".join(lines)


# --- the disk tier (--host-budget-gb) ------------------------------------------------------------------------

DISK_COLUMNS = ("disk blocks", "disk MiB/fwd", "disk stall ms/fwd", "x disk floor")


def _disk_cells(s: StrategyResult) -> list[str]:
    if not s.num_disk_blocks:
        return ["-"] * len(DISK_COLUMNS)
    return [
        str(s.num_disk_blocks),
        _mib(s.disk_bytes_per_forward),
        _num(s.disk_stall_seconds_per_forward * 1e3 if s.disk_stall_seconds_per_forward is not None else None, ".2f"),
        _num(s.measured_over_disk_floor, ".3f"),
    ]


def _disk_header(result: BenchResult) -> list[str]:
    r = result.run
    if r.host_budget_gb is None:
        return []
    on_disk = "the blocks beyond it read from spill files (column 'disk blocks')"
    if not any(s.num_disk_blocks for s in result.strategies):
        on_disk = "every streamed block fits in it"
    line = f"disk tier: host budget {r.host_budget_gb:g} GB for the layerwise rows, {on_disk}"
    if r.disk_gbps is not None:
        compute_ms = sum(r.block_compute_seconds) / len(r.block_compute_seconds) * 1e3
        read_ms = max(r.block_bytes) / (r.disk_gbps * 1e9) * 1e3
        line += (
            f"; simulated disk {r.disk_gbps:.4g} GB/s: {read_ms:.3f} ms per block read ({read_ms / compute_ms:.2f} x "
            "the block compute measured over the whole run)"
        )
    return [line]


def run_header(result: BenchResult) -> str:
    """The run's facts, as a few markdown lines."""
    r = result.run
    block_mib = max(r.block_bytes) / MIB
    compute_ms = sum(r.block_compute_seconds) / len(r.block_compute_seconds) * 1e3
    lines = [
        f"**{r.model}**-shaped synthetic DiT: {r.num_blocks} blocks (dim {r.dim}, {r.num_heads} heads, ffn {r.ffn_dim}), "
        f"{r.num_tokens} tokens + {r.num_context_tokens} context tokens, batch {r.batch_size}, {r.dtype}",
        f"device {r.device} ({r.device_name}), torch {r.torch_version}, {r.threads} compute threads; "
        f"{r.repeats} timed forwards per strategy (round robin), {r.warmup} warm-up, prefetch depth {r.prefetch_depth}",
        f"block: {block_mib:,.2f} MiB, {compute_ms:.3f} ms compute per block (resident, mean)",
    ]
    if r.link_gbps is not None:
        transfer_ms = max(r.block_bytes) / (r.link_gbps * 1e9) * 1e3
        asked = f"link ratio {r.link_ratio:g} asked, " if r.link_ratio is not None else ""
        lines.append(
            f"simulated link {r.link_gbps:.4g} GB/s: {transfer_ms:.3f} ms per block transfer ({asked}"
            f"{transfer_ms / compute_ms:.2f} x the block compute measured over the whole run)"
        )
    if r.measured_link_gbps is not None:
        lines.append(f"measured host-to-device link {r.measured_link_gbps:.1f} GB/s (pinned copy of one block)")
    if r.device_budget_gb is not None:
        lines.append(f"layerwise-auto device budget {r.device_budget_gb:.4g} GB")
    lines += _disk_header(result)
    if r.trace_summary:
        t = r.trace_summary
        lines.append(
            f"trace of {t['strategy']}: {t['num_copies']} copies, {t['num_computes']} computes, stalls "
            f"{t['stall_seconds'] * 1e3:.3f} ms, copy lane busy {t['copy_busy_seconds'] * 1e3:.3f} ms of "
            f"{t['span_seconds'] * 1e3:.3f} ms ({', '.join(r.trace_files)})"
        )
    if any(s.device_peak_source.startswith("runtime accounting") for s in result.strategies):
        lines.append("device peak: the runtime's accounting plus an activation estimate (no allocator to read on the CPU)")
    lines += [f"note: {n}" for n in r.notes]
    return "\n".join(f"- {line}" for line in lines)


def format_report(result: BenchResult) -> str:
    """Header and table, for a terminal or a markdown file."""
    return f"{run_header(result)}\n\n{markdown_table(result)}\n"
