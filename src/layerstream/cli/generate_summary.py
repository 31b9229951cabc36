"""The summary `layerstream generate` prints: a table for people, or JSON (`--json`) that records everything
needed to make the output again."""

from __future__ import annotations

from layerstream.cli.resident_compare import ResidentComparison
from layerstream.wording import format_bytes, format_seconds

SUMMARY_PROMPT_CHARS = 80
"""A longer prompt is shortened in the table (the JSON keeps it whole): one row stays one line."""


def short_prompt(prompt: str) -> str:
    """`prompt` as the table shows it: a long one as its first characters, an ellipsis and its length."""
    if len(prompt) <= SUMMARY_PROMPT_CHARS:
        return prompt
    return f"{prompt[:SUMMARY_PROMPT_CHARS]}... ({len(prompt):,} characters)"


def summary(model, omni, result, output, compared, trace_files, rank, *, prompt: str, seed: int) -> dict:
    """What one rank made and what it cost, as plain data (the `--json` output); the prompt whole."""
    s = result.stats
    # the size actually made, read from the output: the model's defaults fill in whatever was not asked for
    count, height, width = result.frames.shape[:3]
    return {
        "rank": rank,
        "model": model,
        "source": omni.source.to_dict(),
        "prompt": prompt,
        "seed": seed,
        "width": int(width),
        "height": int(height),
        "num_frames": int(count) if result.kind == "video" else None,
        "output": str(output),
        "config": omni.config.to_dict(),
        "device": str(omni.device),
        "dtypes": omni.component_dtypes(),
        "seconds": round(s.seconds, 4),
        "seconds_per_step": round(s.seconds_per_step, 4),
        "first_step_seconds": round(s.step_seconds[0], 4) if s.step_seconds else None,
        "steps": len(s.step_seconds),
        "device_bytes": s.device_bytes,
        "peak_device_bytes": s.peak_device_bytes,
        "host_bytes": s.host_bytes,
        "bytes_streamed": s.bytes_transferred,
        "num_transfers": s.num_transfers,
        "num_sync_loads": s.num_sync_loads,
        "stall_seconds": round(s.stall_seconds, 4),
        "disk_bytes_read": s.disk_bytes_read,
        "disk_stall_seconds": round(s.disk_stall_seconds, 4),
        "vae_decode": s.vae_decode.to_dict() if s.vae_decode is not None else None,
        "identical_to_resident": None if compared is None else compared.identical,
        "resident_comparison": None if compared is None else compared.to_dict(),
        "trace_files": trace_files,
    }


def as_expected(made: dict) -> bool:
    """Whether a summary is not compared, identical, or different only by the lossy storage asked for."""
    compared = made["resident_comparison"]
    lossy = compared is not None and compared["lossy_storage"] is not None and compared["max_abs_diff"] != float("inf")
    return compared is None or compared["identical"] or lossy  # inf: the shapes differ, never by design


def _bytes(n) -> str:
    return "-" if n is None else format_bytes(n)


def _step_time(s: dict) -> str:
    """The median step after the first (the first carries warm-up), the first apart, and the whole call."""
    whole = f"{format_seconds(s['seconds'])} in all with prompt encoding and decoding"
    if s["steps"] < 2:
        return f"{format_seconds(s['seconds_per_step'])} ({s['steps']} step, warm-up included; {whole})"
    first = f"first step {format_seconds(s['first_step_seconds'])}"
    return f"{format_seconds(s['seconds_per_step'])} median after the first step ({first}; {s['steps']} steps, {whole})"


def _decode_line(decode: dict | None) -> str:
    """How the VAE decoded and why: tiled output is not bit-identical to untiled, so it is never left unsaid."""
    from layerstream.models.decode.vae_tiling import VaeDecodeChoice

    return "-" if decode is None else VaeDecodeChoice(**decode).summary()


def print_table(summaries: list[dict]) -> None:
    """The summaries as a table on stdout, one block per rank (the rank row only with several)."""
    rows = [
        ("rank", lambda s: str(s["rank"])),
        ("prompt", lambda s: short_prompt(s["prompt"])),
        ("seed", lambda s: str(s["seed"])),
        ("size", lambda s: f"{s['width']}x{s['height']} (width x height)" + (f", {s['num_frames']} frames" if s["num_frames"] else "")),
        ("output", lambda s: s["output"]),
        ("device", lambda s: s["device"]),
        ("dtypes", lambda s: ", ".join(f"{name} {dtype}" for name, dtype in s["dtypes"].items()) or "-"),
        ("time per step", _step_time),
        ("device bytes", lambda s: _bytes(s["device_bytes"]) + (f" (peak {_bytes(s['peak_device_bytes'])})" if s["peak_device_bytes"] else "")),
        ("host bytes", lambda s: _bytes(s["host_bytes"])),
        ("bytes streamed", lambda s: f"{_bytes(s['bytes_streamed'])} in {s['num_transfers']} transfers ({s['num_sync_loads']} synchronous)"),
        ("stall time", lambda s: format_seconds(s["stall_seconds"])),
        ("VAE decode", lambda s: _decode_line(s["vae_decode"])),
        ("identical to resident", lambda s: ResidentComparison.summary(s["resident_comparison"])),
    ]
    if any(s["disk_bytes_read"] for s in summaries):  # the disk tier (host_budget_gb)
        rows.insert(
            -1,
            ("read from disk", lambda s: f"{_bytes(s['disk_bytes_read'])}, {format_seconds(s['disk_stall_seconds'])} stalled on the disk"),
        )
    if any(s["source"]["origin"] == "hub" for s in summaries):  # the Hub revision the files are of
        rows.insert(1, ("revision", lambda s: f"{s['source']['revision']} (commit {s['source']['commit']})" if s["source"]["origin"] == "hub" else "-"))
    if any(s.get("image") for s in summaries):
        rows.insert(4, ("input image", lambda s: f"{s['image']} (size {s['size_note']})"))
    if any(s["source"].get("components") for s in summaries):  # components loaded from their own files
        files = lambda s: ", ".join(f"{n} {f}" for n, f in s["source"].get("components", {}).items())  # noqa: E731
        rows.insert([name for name, _ in rows].index("dtypes") + 1, ("from files", files))
    if any(s["trace_files"] for s in summaries):
        rows.append(("trace", lambda s: ", ".join(s["trace_files"])))
    if len(summaries) == 1:
        rows = rows[1:]
    width = max(len(name) for name, _ in rows)
    for s in summaries:
        print(f"layerstream generate: {s['model']}")
        for name, fmt in rows:
            print(f"  {name:<{width}}  {fmt(s)}")
