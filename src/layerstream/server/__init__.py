"""`layerstream serve`: one offloaded pipeline behind an OpenAI-style HTTP API.

The pieces, in the order a request meets them:

- `app`: the FastAPI routes, request metrics and error answers; `bodies`: request bodies read within their
  limits; `openapi`: the served OpenAPI document; `http_server`: uvicorn with a drain-first, bounded stop;
- `schemas`: request and response bodies (pydantic, strict types, unknown fields rejected);
- `errors`: every error answer has one shape, ``{"error": {"message", "type", "param", "code", "details"}}``;
- `limits`: what the served model accepts (size multiple, largest grid, frame rule, work cap), checked
  before a request queues;
- `service`: a checked request prepared into a `ServedRequest` (`served`) and queued; health and metrics;
- `queue`: a bounded FIFO run by exactly one worker thread (the runtime allows one thread in a model), with
  the policy that takes its jobs and the runner that runs them (`in_process`: this process's `Omni`);
- `output_loop`: the one loop that makes a group's outputs, each encoded once by `layerstream.outputs`;
- `stopping`: how a started generation is stopped between denoising steps (timeout, client gone, shutdown);
- `image_outputs`: the newest image outputs kept for ``response_format: "url"``;
- `jobs`: the asynchronous job API and its history; `ui`: the web page at ``/``, a client of that API;
- `metrics`: Prometheus text exposition of requests, latency and the offload runtime's counters;
- `settings`: the server's limits, validated when built;
- `waves` and `ranks`: with several ranks (``serve --nproc N``), rank 0's queue taken a wave at a time, one
  share per rank, and what every rank runs of a wave, talking through torchrun's key-value store.

Nothing here configures logging or reads the command line: `layerstream.cli.serve_cmd` does.
"""
