"""The VAE decode's device memory: its peak traced from the VAE's own structure on the meta device
(`vae_decode`, over `meta_peak` and each device's convolution scratch, `conv_scratch`), the choice of a tiled
or sliced decode (`vae_tiling`), and that choice made for a run from the memory left (`decode_memory`)."""
