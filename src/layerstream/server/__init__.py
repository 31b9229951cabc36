"""`layerstream serve`: one offloaded pipeline behind an OpenAI-style HTTP API. A request meets `app` (with
`bodies`, `schemas`, `errors`, `limits`), then `service` and its `queue`, run `in_process` or in `waves` on
`ranks`, each output made by `output_loop`; `jobs` is the job API and its history, `ui` the web page. Nothing
here configures logging or reads the command line: `layerstream.cli.serve_cmd` does.
"""
