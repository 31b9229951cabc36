"""Planning for a machine: what it allows and what a model will do on it.

- `planner`: `layerstream plan MODEL --device-memory --host-memory`: the configuration a machine given by its
  figures (`figures.Machine`) should run, its bytes per tier and per step, and the predicted seconds per step
  (`step_time`: the benchmarks' ideal, `layerstream.timing.ideal`);
- `device_fit`: the config whose every phase fits the device, or the refusal naming the phase that does not;
- `phases`: each phase's peak from its parts, on the device (prompt encoding, image encoding, denoising, VAE
  decode) and the host (loading and enabling, generating).

It sits above `enable_offload` (it prices the stores through the composition root); what enabling reads of the
host itself (its free memory, a generation's reserve) is below both, in `layerstream.host`.
"""
