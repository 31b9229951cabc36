"""Trace export: Chrome trace events and the PNG timeline, from a hand-made OffloadTrace."""

from __future__ import annotations

import json

import pytest

from layerstream.runtime.reporting.trace_export import chrome_trace_events, summarize_trace, write_chrome_trace, write_timeline_png
from layerstream.runtime.reporting.stats import OffloadTrace, TraceInterval

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast


def _trace() -> OffloadTrace:
    return OffloadTrace(
        (
            TraceInterval("copy", "blocks.0", 10.000, 10.002, 0),
            TraceInterval("compute", "blocks.0", 10.003, 10.006, 0, stall=0.001),
            TraceInterval("copy", "blocks.1", 10.003, 10.005, 1),
            TraceInterval("compute", "blocks.1", 10.006, 10.009, 1, sync_load=True),
        )
    )


def test_events_are_microseconds_from_the_first_interval_on_named_lanes():
    events = chrome_trace_events(_trace())
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {1: "copy", 2: "compute"}
    complete = [e for e in events if e["ph"] == "X"]
    copy0 = next(e for e in complete if e["cat"] == "copy" and e["name"] == "blocks.0")
    assert copy0["ts"] == pytest.approx(0.0) and copy0["dur"] == pytest.approx(2000.0) and copy0["tid"] == 1
    compute0 = next(e for e in complete if e["cat"] == "compute" and e["name"] == "blocks.0")
    assert compute0["ts"] == pytest.approx(3000.0) and compute0["args"]["stall_us"] == pytest.approx(1000.0)
    stall = [e for e in complete if e["cat"] == "stall"]
    assert len(stall) == 1 and stall[0]["ts"] + stall[0]["dur"] == pytest.approx(compute0["ts"])  # ends as compute starts
    assert next(e for e in complete if e["name"] == "blocks.1" and e["cat"] == "compute")["args"]["sync_load"] is True


def test_origin_includes_a_leading_stall():
    trace = OffloadTrace((TraceInterval("compute", "b", 5.0, 5.5, 0, stall=0.25),))
    events = [e for e in chrome_trace_events(trace) if e["ph"] == "X"]
    assert min(e["ts"] for e in events) == pytest.approx(0.0)  # no negative timestamps


def test_other_lanes_follow_copy_and_compute():
    trace = OffloadTrace((TraceInterval("allgather", "b", 0.0, 1.0, 0), TraceInterval("compute", "b", 1.0, 2.0, 0)))
    names = [e["args"]["name"] for e in chrome_trace_events(trace) if e["ph"] == "M" and e["name"] == "thread_name"]
    assert names == ["compute", "allgather"]


def test_write_chrome_trace_round_trips(tmp_path):
    path = write_chrome_trace(_trace(), tmp_path / "sub" / "trace.json")
    payload = json.loads(path.read_text())
    assert sum(1 for e in payload["traceEvents"] if e["ph"] == "X" and e["cat"] in ("copy", "compute")) == 4


def test_write_timeline_png(tmp_path):
    path = write_timeline_png(_trace(), tmp_path / "timeline.png", title="test")
    assert path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_empty_trace_still_exports(tmp_path):
    empty = OffloadTrace(())
    assert [e for e in chrome_trace_events(empty) if e["ph"] == "X"] == []
    assert write_timeline_png(empty, tmp_path / "empty.png").exists()


def test_summary_counts_and_busy_times():
    summary = summarize_trace(_trace())
    assert summary["num_copies"] == 2 and summary["num_computes"] == 2
    assert summary["copy_busy_seconds"] == pytest.approx(0.004)
    assert summary["stall_seconds"] == pytest.approx(0.001)
    assert summary["num_sync_loads"] == 1
    assert summary["span_seconds"] == pytest.approx(0.009)


def test_trace_of_two_streamed_components_labels_each_interval_with_its_component(tmp_path):
    from layerstream import enable_offload
    from runtime_toys import make_my_pipeline, run, toy_inputs

    pipe = make_my_pipeline()
    handle = enable_offload(pipe, {"mode": "layer", "components": ["dit", "text_encoder"]}, device="cpu")
    run(pipe, toy_inputs())
    trace = handle.trace()
    handle.disable()
    for interval in trace.intervals:
        assert interval.label.startswith(interval.component + "."), interval
    assert {i.component for i in trace.lane("compute")} == {"transformer", "prompt_model"}
    events = [e for e in chrome_trace_events(trace) if e.get("ph") == "X" and e["cat"] in ("copy", "compute")]
    assert {e["args"]["component"] for e in events} == {"transformer", "prompt_model"}
    png = write_timeline_png(trace, tmp_path / "t.png", title="toy: two components")
    assert png.stat().st_size > 0
