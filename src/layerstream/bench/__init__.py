"""`layerstream bench`: measurements a user runs on their own machine and model (`quality`: how far float8
storage moves a pipeline's output). Nothing here is imported by the runtime."""
