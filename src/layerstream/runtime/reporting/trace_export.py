"""Export an `OffloadTrace`: Chrome trace JSON (opens in Perfetto / chrome://tracing) and a PNG timeline, both
over any lanes, shifted to start at 0; a compute's stall is drawn as its own interval ending where it starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from layerstream.runtime.reporting.stats import OffloadTrace, TraceInterval

LANE_ORDER = ("copy", "compute")  # drawn first, top to bottom; any other lane follows in order of appearance
_PID = 1
_COLORS = {"copy": "#4C78A8", "compute": "#54A24B", "stall": "#E45756", "sync_load": "#F58518"}


def _lanes(trace: OffloadTrace) -> list[str]:
    return list(dict.fromkeys([*(lane for lane in LANE_ORDER if trace.lane(lane)), *(i.lane for i in trace.intervals)]))


def _origin(trace: OffloadTrace) -> float:
    starts = [i.start - i.stall for i in trace.intervals]
    return min(starts, default=0.0)


def summarize_trace(trace: OffloadTrace) -> dict[str, Any]:
    """Counts and busy times of a trace: how many copies and computes, their summed durations, the stalls."""
    copies, computes = trace.lane("copy"), trace.lane("compute")
    return {
        "num_copies": len(copies),
        "num_computes": len(computes),
        "copy_busy_seconds": sum(i.end - i.start for i in copies),
        "compute_busy_seconds": sum(i.end - i.start for i in computes),
        "stall_seconds": sum(i.stall for i in computes),
        "num_sync_loads": sum(1 for i in computes if i.sync_load),
        "span_seconds": max((i.end for i in trace.intervals), default=0.0) - _origin(trace),
    }


def chrome_trace_events(trace: OffloadTrace) -> list[dict[str, Any]]:
    """Trace events: lane names as thread metadata, one complete ("X") event per interval, in microseconds."""
    lanes = _lanes(trace)
    tids = {lane: n + 1 for n, lane in enumerate(lanes)}
    origin = _origin(trace)
    events: list[dict[str, Any]] = [
        {"ph": "M", "pid": _PID, "name": "process_name", "args": {"name": "layerstream offload"}},
    ]
    for lane, tid in tids.items():
        events.append({"ph": "M", "pid": _PID, "tid": tid, "name": "thread_name", "args": {"name": lane}})
        events.append({"ph": "M", "pid": _PID, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}})
    for interval in trace.intervals:
        tid = tids[interval.lane]
        args: dict[str, Any] = {"slot": interval.slot, "component": interval.component}
        if interval.lane == "compute":
            args.update(stall_us=interval.stall * 1e6, sync_load=interval.sync_load)
        if interval.stall > 0:
            stall_start = interval.start - interval.stall
            events.append(_complete(f"stall {interval.label}", "stall", tid, stall_start, interval.start, origin, {}))
        events.append(_complete(interval.label, interval.lane, tid, interval.start, interval.end, origin, args))
    return events


def _complete(name: str, cat: str, tid: int, start: float, end: float, origin: float, args: dict) -> dict[str, Any]:
    return {
        "name": name, "cat": cat, "ph": "X", "pid": _PID, "tid": tid, "ts": (start - origin) * 1e6,
        "dur": max(end - start, 0.0) * 1e6, "args": args,
    }  # fmt: skip


def write_chrome_trace(trace: OffloadTrace, path: str | Path) -> Path:
    """Write `trace` as Chrome trace JSON to `path` (creating its folder); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"traceEvents": chrome_trace_events(trace), "displayTimeUnit": "ms"}
    path.write_text(json.dumps(payload, indent=1))
    return path


def write_timeline_png(trace: OffloadTrace, path: str | Path, *, title: str | None = None) -> Path:
    """Draw `trace` as a PNG timeline (matplotlib's Agg canvas: no pyplot state or GUI backend is touched)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ModuleNotFoundError as e:
        message = "write_timeline_png needs matplotlib (pip install 'layerstream[bench]')"
        raise ModuleNotFoundError(message, name="matplotlib") from e

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lanes = _lanes(trace)
    origin = _origin(trace)
    fig = Figure(figsize=(12, 1.6 + 0.9 * max(len(lanes), 1)), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    rows = {lane: len(lanes) - 1 - n for n, lane in enumerate(lanes)}  # first lane on top
    label_bars = len(trace.intervals) <= 80  # labels on every bar would be unreadable beyond that
    components = _components(trace)
    span_ms = max((i.end - origin for i in trace.intervals), default=0.0) * 1e3
    # a copy of a few microseconds next to a step of seconds would be narrower than a pixel: draw every bar at
    # least this wide (about one pixel of the plot) so that each copy stays visible at the scale of a step
    min_width_ms = span_ms / 1200

    for interval in trace.intervals:
        y = rows[interval.lane]
        start_ms, width_ms = (interval.start - origin) * 1e3, (interval.end - interval.start) * 1e3
        color = _COLORS["sync_load"] if interval.sync_load else _lane_color(interval, components)
        bar = (start_ms, max(width_ms, min_width_ms))
        ax.broken_barh([bar], (y - 0.35, 0.7), facecolors=color, edgecolors="white", linewidth=0.3 if label_bars else 0)
        if interval.stall > 0:
            stall_ms = interval.stall * 1e3
            ax.broken_barh([(start_ms - stall_ms, stall_ms)], (y - 0.35, 0.7), facecolors=_COLORS["stall"])
        if label_bars:
            text = _short(interval)
            ax.text(start_ms + width_ms / 2, y, text, ha="center", va="center", fontsize=6, clip_on=True)

    ax.set_yticks(list(rows.values()), list(rows.keys()))
    ax.set_ylim(-0.6, len(lanes) - 0.4)
    ax.set_xlabel("time (ms)")
    ax.set_title(title or "layerstream offload timeline")
    ax.grid(axis="x", alpha=0.3)
    legend = [Patch(color=_COLORS[k], label=k.replace("_", " ")) for k in ("copy", "compute", "stall", "sync_load")]
    if len(components) > 1:  # shaded per component: the two experts of Wan 2.2 tell apart
        legend[0:2] = [
            Patch(color=shades[n % len(shades)], label=f"{lane} {c}")
            for lane, shades in (("copy", _COPY_SHADES), ("compute", _COMPUTE_SHADES))
            for n, c in enumerate(components)
        ]
    # below the axes, so the legend never hides a bar
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.28), fontsize=7, ncol=min(len(legend), 4), frameon=False)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


_COMPUTE_SHADES = ("#54A24B", "#B279A2", "#72B7B2", "#EECA3B")
_COPY_SHADES = ("#4C78A8", "#9E65C8", "#2A9D8F", "#B5893B")


def _components(trace: OffloadTrace) -> list[str]:
    return list(dict.fromkeys(i.component for i in trace.intervals if i.component))  # in order of appearance


def _lane_color(interval: TraceInterval, components: list[str]) -> str:
    shades = {"copy": _COPY_SHADES, "compute": _COMPUTE_SHADES}.get(interval.lane)
    if shades is not None and len(components) > 1 and interval.component in components:
        return shades[components.index(interval.component) % len(shades)]
    return _COLORS.get(interval.lane, "#9D755D")


def _short(interval: TraceInterval) -> str:
    """Inside a bar: the block's index (the last path segment); the colour tells the component."""
    return interval.label.rsplit(".", 1)[-1]
