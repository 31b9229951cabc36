"""`layerstream serve`: one offloaded pipeline behind an OpenAI-style HTTP API.
In the order a request meets them: `app` (routes, errors, metrics; `bodies`, `openapi`, `http_server`),
`schemas` and `errors`, `limits` (what the model accepts), `service` (a checked request queued), `queue` and its
runners (`in_process`, or `waves` and `ranks` with ``--nproc``), `output_loop`, `stopping`, `image_outputs`,
`jobs` (the job API and its history) and `ui`, `metrics`, `settings`. Nothing here configures logging or reads
the command line: `layerstream.cli.serve_cmd` does."""
