"""`layerstream bench`: measurements a user runs on their own machine and model.

- `quality`: how far float8 storage moves a pipeline's output (PSNR and largest latent difference against full
  precision).

The synthetic strategy comparison measures layerstream itself and lives in benchmarks/strategies.py.
Nothing here is imported by the runtime, and nothing runs at import time.
"""
