"""Load test for `layerstream serve`: a bounded burst of generation requests, with throughput and latency.

    python benchmarks/serve_load.py --spawn tiny-flux --requests 16 --concurrency 4
    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --requests 32 --concurrency 8 --json

Sends `--requests` requests, at most `--concurrency` at a time, to the images or videos endpoint (whichever
the served model makes, read from /health), and reports requests per second, p50 and p99 latency and the
number of failed requests. Exits 1 if any request failed or the whole burst ran past `--timeout`.

With ``--spawn MODEL`` it starts ``layerstream serve MODEL --port 0`` itself (extra server flags go after
``--server-args``), waits for its ready line, and stops it with SIGTERM when done.

With ``--batch-sizes 1,2,4`` (and ``--spawn``) it runs the same burst once per ``--max-batch-size``, each on a
fresh server, and reports throughput, latency and bytes streamed per request for each, with the ratios to
the first. Against a transfer-bound server (``--server-args "--link-gbps 0.01"`` on tiny-flux), batching
divides the bytes each request costs:

    python benchmarks/serve_load.py --spawn tiny-flux --batch-sizes 1,2,4 --requests 8 --concurrency 8 \
        --size 64x64 --steps 2 --server-args "--link-gbps 0.01"

The server runs one generation (or batch) at a time, so throughput is bounded by generation time;
concurrency beyond ``--max-queue + 1`` only produces 429 answers, which count as failures here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

READY = re.compile(r"layerstream serve: ready on (http://\S+)")


@dataclass(frozen=True)
class LoadReport:
    url: str
    model: str
    endpoint: str
    num_requests: int
    concurrency: int
    num_failed: int
    failures: dict[str, int]
    """status code (or exception name) -> count."""
    wall_seconds: float
    requests_per_second: float
    p50_seconds: float | None
    p99_seconds: float | None
    max_seconds: float | None
    timed_out: bool
    bytes_per_request: float | None = None
    """Mean bytes streamed per answered request (the server's ``layerstream.bytes_streamed``)."""
    max_batch_size: int | None = None
    """The server's --max-batch-size (from /health)."""


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.batch_sizes:
        return _compare_batch_sizes(args)
    with _server(args) as url:
        report = asyncio.run(run_load(url, args))
    if args.json:
        print(json.dumps(asdict(report), indent=2))
    else:
        _print_report(report)
    return 0 if report.num_failed == 0 and not report.timed_out else 1


def _compare_batch_sizes(args: argparse.Namespace) -> int:
    """The same burst against a fresh server per --max-batch-size; the table (or JSON) of the reports."""
    reports = []
    server_args = args.server_args
    for size in args.batch_sizes:
        args.server_args = f"{server_args} --max-batch-size {size}"
        with _server(args) as url:
            asyncio.run(run_load(url, args, num_requests=min(args.requests, args.concurrency)))  # warm-up burst
            reports.append(asyncio.run(run_load(url, args)))
    args.server_args = server_args
    if args.json:
        print(json.dumps([asdict(r) for r in reports], indent=2))
    else:
        _print_batch_table(reports)
    return 0 if all(r.num_failed == 0 and not r.timed_out for r in reports) else 1


async def run_load(url: str, args: argparse.Namespace, *, num_requests: int | None = None) -> LoadReport:
    """Send the burst (`num_requests`, default --requests) and measure it. Never raises for a failed request:
    it is counted instead."""
    num_requests = num_requests or args.requests
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout) as client:
        health = (await client.get("/health")).json()
        endpoint = "/v1/videos/generations" if health["kind"] == "video" else "/v1/images/generations"
        body = _request_body(args, video=health["kind"] == "video")
        semaphore = asyncio.Semaphore(args.concurrency)
        latencies: list[float] = []
        bytes_streamed: list[int] = []
        failures: dict[str, int] = {}

        async def one(index: int) -> None:
            async with semaphore:
                started = time.perf_counter()
                try:
                    response = await client.post(endpoint, json={**body, "seed": args.seed + index})
                    outcome = str(response.status_code)
                except httpx.HTTPError as e:
                    outcome = type(e).__name__
                if outcome == "200":
                    latencies.append(time.perf_counter() - started)
                    bytes_streamed.append(response.json()["layerstream"]["bytes_streamed"])
                else:
                    failures[outcome] = failures.get(outcome, 0) + 1

        started = time.perf_counter()
        tasks = [asyncio.create_task(one(i)) for i in range(num_requests)]
        _, pending = await asyncio.wait(tasks, timeout=args.timeout)  # the hard bound on the whole burst
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)  # let cancelled requests close their connections
        wall = time.perf_counter() - started
    num_failed = num_requests - len(latencies)
    if pending:
        failures["not finished"] = failures.get("not finished", 0) + len(pending)
    return LoadReport(
        url=url,
        model=health["model"],
        endpoint=endpoint,
        num_requests=num_requests,
        concurrency=args.concurrency,
        num_failed=num_failed,
        failures=failures,
        wall_seconds=wall,
        requests_per_second=len(latencies) / wall if wall > 0 else 0.0,
        p50_seconds=percentile(latencies, 50),
        p99_seconds=percentile(latencies, 99),
        max_seconds=max(latencies) if latencies else None,
        timed_out=bool(pending),
        bytes_per_request=sum(bytes_streamed) / len(bytes_streamed) if bytes_streamed else None,
        max_batch_size=health.get("max_batch_size"),
    )


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (an observed value, no interpolation); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def _request_body(args: argparse.Namespace, *, video: bool) -> dict:
    body: dict = {"prompt": args.prompt}
    if args.size:
        body["size"] = args.size
    if args.steps:
        body["num_inference_steps"] = args.steps
    if video and args.num_frames:
        body["num_frames"] = args.num_frames
    return body


@contextmanager
def _server(args: argparse.Namespace) -> Iterator[str]:
    """The URL to load: `--url`, or a server started here with `--spawn` (always stopped on the way out)."""
    if not args.spawn:
        yield args.url
        return
    command = [sys.executable, "-m", "layerstream", "serve", args.spawn, "--port", "0", "--no-access-log",
               *shlex.split(args.server_args)]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="serve-load-") as folder:
        log_path = Path(folder) / "server.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
        try:
            yield _wait_for_ready(process, log_path, args.startup_timeout)
        finally:
            _stop(process)


def _wait_for_ready(process: subprocess.Popen, log_path: Path, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log_path.read_text(errors="replace")
        match = READY.search(text)
        if match:
            return match.group(1)
        if process.poll() is not None:
            raise SystemExit(f"serve_load: the server exited with {process.returncode}:\n{text}")
        time.sleep(0.1)
    raise SystemExit(f"serve_load: the server was not ready after {timeout} s:\n{log_path.read_text(errors='replace')}")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    # graceful: waiting requests get 503, the running one --shutdown-timeout s (then it stops at its next step)
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)


def _print_report(r: LoadReport) -> None:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1e3:,.1f} ms"

    print(f"serve_load: {r.model} at {r.url}{r.endpoint}")
    print(f"  requests     {r.num_requests} ({r.concurrency} at a time) in {r.wall_seconds:.2f} s")
    print(f"  throughput   {r.requests_per_second:.3f} requests/s")
    print(f"  latency      p50 {ms(r.p50_seconds)}, p99 {ms(r.p99_seconds)}, max {ms(r.max_seconds)}")
    if r.bytes_per_request is not None:
        print(f"  streamed     {r.bytes_per_request / 1e6:,.3f} MB per request")
    failed = ", ".join(f"{k}: {v}" for k, v in sorted(r.failures.items())) or "none"
    print(f"  failed       {r.num_failed} ({failed}){' - TIMED OUT' if r.timed_out else ''}")


def _print_batch_table(reports: list[LoadReport]) -> None:
    base = reports[0]
    first = f"{base.model} at {base.url.rsplit(':', 1)[0]}, {base.num_requests} requests, {base.concurrency} at a time"
    print(f"serve_load: {first}")
    print(f"  {'batch':>5} {'req/s':>8} {'x':>6} {'p50 ms':>9} {'p99 ms':>9} {'MB/request':>11} {'x':>6} failed")
    for r in reports:
        speedup = r.requests_per_second / base.requests_per_second if base.requests_per_second else float("nan")
        mb = (r.bytes_per_request or 0) / 1e6
        byte_ratio = (r.bytes_per_request or 0) / base.bytes_per_request if base.bytes_per_request else float("nan")
        p50 = (r.p50_seconds or 0) * 1e3
        p99 = (r.p99_seconds or 0) * 1e3
        print(f"  {r.max_batch_size!s:>5} {r.requests_per_second:8.3f} {speedup:6.2f} {p50:9.1f} {p99:9.1f} "
              f"{mb:11.3f} {byte_ratio:6.2f} {r.num_failed}")  # fmt: skip


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Load test for layerstream serve.")
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server to load (default: %(default)s)")
    parser.add_argument("--spawn", metavar="MODEL", default=None, help="start `layerstream serve MODEL` on a free port and load it")
    parser.add_argument("--server-args", default="", help='extra flags for the spawned server, e.g. "--link-gbps 1"')
    parser.add_argument("--requests", type=int, default=16, help="requests to send (default: %(default)s)")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight at once (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=300.0, help="hard limit for the whole burst in seconds (default: %(default)s)")
    parser.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for a spawned server (default: %(default)s)")
    parser.add_argument("--prompt", default="a red fox running through fresh snow")
    parser.add_argument("--size", default=None, help="'WIDTHxHEIGHT' (default: the model's)")
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's)")
    parser.add_argument("--num-frames", type=int, default=None, help="video models: frames per video")
    parser.add_argument("--seed", type=int, default=0, help="seed of the first request; request i uses seed + i")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--batch-sizes", type=_batch_sizes, default=None, metavar="1,2,4",
        help="with --spawn: run the burst once per --max-batch-size (a fresh server each) and compare them",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.batch_sizes and not args.spawn:
        parser.error("--batch-sizes starts a server per batch size: it needs --spawn MODEL")
    for name in ("requests", "concurrency"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if not args.timeout > 0:
        parser.error("--timeout must be > 0")
    return args


def _batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every batch size must be at least 1")
    return sizes


if __name__ == "__main__":
    raise SystemExit(main())
