"""The summary `layerstream generate` prints: a table for people, or JSON (`--json`) that records everything
needed to make the output again."""

from __future__ import annotations

SUMMARY_PROMPT_CHARS = 80
"""A longer prompt is shortened in the table (the JSON keeps it whole): one row stays one line."""


def short_prompt(prompt: str) -> str:
    """`prompt` as the table shows it: a long one as its first characters, an ellipsis and its length."""
    if len(prompt) <= SUMMARY_PROMPT_CHARS:
        return prompt
    return f"{prompt[:SUMMARY_PROMPT_CHARS]}... ({len(prompt):,} characters)"


def summary(model, omni, result, output, identical, trace_files, rank, *, prompt: str, seed: int) -> dict:
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
        "identical_to_resident": identical,
        "trace_files": trace_files,
    }


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f} MiB"


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
        ("time per step", lambda s: f"{s['seconds_per_step'] * 1e3:,.1f} ms median ({s['steps']} steps, {s['seconds']:.2f} s in all with prompt encoding and decoding)"),
        ("device bytes", lambda s: _mib(s["device_bytes"]) + (f" (peak {_mib(s['peak_device_bytes'])})" if s["peak_device_bytes"] else "")),
        ("host bytes", lambda s: _mib(s["host_bytes"])),
        ("bytes streamed", lambda s: f"{_mib(s['bytes_streamed'])} in {s['num_transfers']} transfers ({s['num_sync_loads']} synchronous)"),
        ("stall time", lambda s: f"{s['stall_seconds'] * 1e3:,.1f} ms"),
        ("VAE decode", lambda s: _decode_line(s["vae_decode"])),
        ("identical to resident", lambda s: "not checked" if s["identical_to_resident"] is None else ("yes" if s["identical_to_resident"] else "NO")),
    ]
    if any(s["disk_bytes_read"] for s in summaries):  # the disk tier (host_budget_gb)
        rows.insert(
            -1,
            ("read from disk", lambda s: f"{_mib(s['disk_bytes_read'])}, {s['disk_stall_seconds'] * 1e3:,.1f} ms stalled on the disk"),
        )
    if any(s["source"]["origin"] == "hub" for s in summaries):  # the Hub revision the files are of
        rows.insert(1, ("revision", lambda s: f"{s['source']['revision']} (commit {s['source']['commit']})" if s["source"]["origin"] == "hub" else "-"))
    if any(s.get("image") for s in summaries):
        rows.insert(4, ("input image", lambda s: f"{s['image']} (size {s['size_note']})"))
    if any(s["trace_files"] for s in summaries):
        rows.append(("trace", lambda s: ", ".join(s["trace_files"])))
    if len(summaries) == 1:
        rows = rows[1:]
    width = max(len(name) for name, _ in rows)
    for s in summaries:
        print(f"layerstream generate: {s['model']}")
        for name, fmt in rows:
            print(f"  {name:<{width}}  {fmt(s)}")
