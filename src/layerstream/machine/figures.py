"""The machine a plan is for, given by its figures (`Machine`), their checks, and the planner's error."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from layerstream.errors import LayerstreamError
from layerstream.models.generation_estimates import DEVICE_ALLOWANCE_GB

PROCESS_BASELINE_GB = 0.41
"""Host memory of a Python process that has imported torch, diffusers, transformers and layerstream, before any
model: 0.40 GB resident, measured with torch 2.13 (CPU build) on Linux."""
CUDA_CONTEXT_GB = 1.0
"""Host memory a CUDA context and its libraries add to the process (an allowance, not measured here)."""
DEFAULT_LINK_GBPS = 25.0
"""Host-to-device copies from pinned memory on PCIe 4.0 x16 (about 25 of its 32 GB/s)."""
DEFAULT_DISK_GBPS = 3.0
"""A PCIe 3.0 NVMe disk reading large blocks."""
DEFAULT_DEVICE_TFLOPS = 150.0
"""Dense bfloat16 throughput a 24 GB GPU of the RTX 4090 class sustains in large matmuls (about 165 peak)."""
DEVICE_DECODE_GBPS = 100.0
"""Decoded bytes per second the lossless form's decode is assumed to reach on an accelerator (elementwise torch
ops over a block on the copy stream: about 60 small kernels per step of 2^22 elements with three tiers, so launches
may bound it below this); an assumption until `benchmarks/gpu.sh` measures it where a GPU is present."""
DEQUANT_GBPS_CPU: dict[str, float] = {"Q8_0": 0.416, "Q4_K": 0.339, "fp8_scaled": 0.345}
"""Dequantised bytes (in bfloat16) per second of a weight kept GGUF-quantized or fp8_scaled, which diffusers' GGUF
layers and the fp8_scaled upcast dequantise at every call of its Linear: `benchmarks/quantized_blocks.py` on a
shared 2-core Xeon, one thread, per real-width Wan 2.2 A14B block (351 M weights, 703 MB in bfloat16): Q8_0
1,688 ms, Q4_K 2,071 ms, fp8_scaled 2,039 ms. A GGUF type not measured is priced as the slowest of these."""
DEQUANT_GBPS_DEVICE = 20.0
"""The same on an accelerator: not measured yet (`benchmarks/gpu.sh` runs that benchmark where a GPU is present).
A conservative guess, far below device-memory speed, for diffusers' several elementwise passes per weight."""
FORWARDS_PER_STEP = 2
"""Transformer forwards per denoising step: classifier-free guidance runs the model on the prompt and without."""


class MachinePlanError(LayerstreamError, ValueError):
    """A machine the model cannot run on, or figures that make no sense; the message says which and why."""


class DeviceTooSmallError(MachinePlanError):
    """A device that cannot hold some phase of the generation: the phase that bounds (`peak`, a
    `machine.phases.PhasePeak`), the device's bytes and what would make it fit (`would_fit`, phrases), also in
    the message."""

    def __init__(self, message: str, *, peak, memory_nbytes: int, would_fit: tuple[str, ...]):
        super().__init__(message)
        self.peak = peak
        self.memory_nbytes = memory_nbytes
        self.would_fit = would_fit


@dataclass(frozen=True, kw_only=True)
class Machine:
    """The machine to plan for (GB are 1e9 bytes, GB/s 1e9 bytes per second)."""

    device_memory_gb: float
    host_memory_gb: float
    """The whole process's host memory, Python and libraries included (`baseline_gb`)."""
    link_gbps: float = DEFAULT_LINK_GBPS
    disk_gbps: float = DEFAULT_DISK_GBPS
    device_tflops: float = DEFAULT_DEVICE_TFLOPS
    baseline_gb: float = PROCESS_BASELINE_GB + CUDA_CONTEXT_GB
    """What the process holds before the model: the imports and the device's context."""
    host_reserve_gb: float | None = None
    """Host memory kept free for what a generation allocates (as `host_reserve_gb` in the config); None: the
    estimate for the generation planned (`host.reserve`)."""
    activation_reserve_gb: float | None = None
    """Device memory residency "auto" leaves beside the weights kept there and the slot ring (as
    `activation_reserve_gb` in the config); None: the largest phase's transient for the generation planned and
    the allowance (`models.generation_estimates.activation_reserve_nbytes`)."""
    device_allowance_gb: float = DEVICE_ALLOWANCE_GB
    """Device memory beside the estimates in every phase (a CUDA context, the allocator; 0 for a CPU device)."""
    device_type: Literal["cuda", "cpu"] = "cuda"
    """The device's kind, for what its kernels allocate beside their tensors (a VAE decode's convolution scratch,
    `models.decode.conv_scratch`): "cpu" for the CPU device, where the device is host memory."""
    vae_use_tiling: bool | Literal["auto"] = "auto"
    """Whether the VAE decode is planned tiled: "auto" only where the untiled decode leaves some phase no room
    (tiles blend at their edges: the output is not bit-identical), True always, False never (refused where the
    untiled decode cannot fit)."""
    allow_lossy: bool = False
    """Whether float8 storage (lossy, rounded once) may be recommended."""
    forwards_per_step: int = FORWARDS_PER_STEP
    host_copy_s_per_gb: float = 0.0
    """Compute time lost per GB the copy and read threads move, where they share the compute's cores: on a CPU
    device, whose copies into slots and reads from disk are the host's own work (0 on an accelerator, whose
    copies are its DMA engines'). A measured figure of the machine (`benchmarks/headline.py` measures it)."""
    host_cast_s_per_gb: float = 0.0
    """The same per GB of float8 bytes cast back to the compute dtype on the copy thread (a CPU device's table
    lookups, `runtime/packing/upcast.py`; 0 on an accelerator, which casts in a kernel beside compute)."""
    decode_gbps: float = DEVICE_DECODE_GBPS
    """Decoded GB per second of the lossless form's decode, which runs after each copy, before the block is
    ready (the link stage): on an accelerator elementwise kernels (assumed, `DEVICE_DECODE_GBPS`); on a
    CPU device the copy thread's own rate beside compute, a measured figure of the machine."""
    host_decode_s_per_gb: float = 0.0
    """Compute time lost per decoded GB where the decode shares the compute's cores (a CPU device's copy
    thread; 0 on an accelerator)."""
    copy_and_read_share_a_core: bool = False
    """Whether the copy thread (copy, cast, decode) and the disk reads share one core (a CPU device with one
    core left beside compute): a block's read and its transfer then run one after the other, the transfer
    stage their sum, instead of overlapping as a DMA engine and a disk do (False)."""


def check_machine(machine: Machine) -> None:
    """One clear error for figures that cannot describe a machine (the CLI checks its flags the same way)."""
    positive = ("device_memory_gb", "host_memory_gb", "link_gbps", "disk_gbps", "device_tflops", "decode_gbps")
    optional = ("host_reserve_gb", "activation_reserve_gb")
    per_gb = ("host_copy_s_per_gb", "host_cast_s_per_gb", "host_decode_s_per_gb")
    for name in (*positive, *optional, *per_gb, "device_allowance_gb", "baseline_gb"):
        value = getattr(machine, name)
        if value is None and name in optional:
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and value < float("inf")
        if not number or not (value > 0 if name in positive else value >= 0):
            bound, note = ">" if name in positive else ">=", " (0: an accelerator's copies)" if name in per_gb else ""
            raise MachinePlanError(f"{name} = {value!r} is not valid; expected a finite number {bound} 0{note}")
    if machine.device_type not in ("cuda", "cpu"):
        raise MachinePlanError(f'device_type = {machine.device_type!r} is not valid; expected "cuda" or "cpu"')
    if machine.vae_use_tiling not in (True, False, "auto"):
        raise MachinePlanError(f'vae_use_tiling = {machine.vae_use_tiling!r} is not valid; expected true, false or "auto"')
    if machine.host_memory_gb <= machine.baseline_gb:
        raise MachinePlanError(
            f"host_memory_gb = {machine.host_memory_gb:g} is not valid; expected more than the process's baseline of "
            f"{machine.baseline_gb:g} GB before any model (imports and the device's context; set by baseline_gb)"
        )
