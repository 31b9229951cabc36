"""The GPU checks of the CUDA path, one line each (`PASS`/`FAIL`/`SKIP name: detail`); run by gpu_checks.sh.

Each check builds a toy DiT in bf16 on the GPU and compares the streamed output with the resident one, bit for
bit, under one hazard: page registration of every host buffer, the CUDA sanitizer (run the script again with
TORCH_CUDA_SANITIZER=1: gpu_checks.sh does), slow compute and slow copies, a pipeline dropped without
`disable()`, no host synchronize in the steady state, graph capture, and a second GPU from a thread that never
set its device. Written for a GPU and not yet run on one: each check catches its own error and reports it.
"""

from __future__ import annotations

import gc
import sys
import threading
import time
import traceback

import torch
from torch import nn

from layerstream import UnsupportedUseError, enable_offload

DIM, BLOCKS = 256, 6


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.proj = nn.Linear(DIM, 4 * DIM)
        self.out = nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        return x + self.out(torch.nn.functional.gelu(self.proj(self.norm(x))))


class ToyDiT(nn.Module):
    _layerwise_offload_blocks_attrs = ["blocks"]

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _model(device: str = "cuda") -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = ToyDiT().to(torch.bfloat16).eval()
    x = torch.randn(8, 64, DIM, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = model.to(device)(x.to(device)).cpu()
    model.cpu()
    return model, x.to(device), expected


def _config(**extra) -> dict:
    return {"mode": "layer", "components": ["dit"], **extra}


def _forwards(model, x, n: int = 3) -> list[torch.Tensor]:
    with torch.no_grad():
        outs = [model(x).cpu() for _ in range(n)]
    torch.cuda.synchronize()
    return outs


def check_pinning(tmp: str) -> str:
    for name, config in (("packed", _config()), ("disk tier", _config(host_budget_gb=2.5 * 2 * DIM * 4 * DIM * 2 / 1e9, disk_dir=tmp))):
        model, x, expected = _model()
        handle = enable_offload(model, config, device="cuda")
        stats = handle.stats()
        ok = stats.pinned_host_bytes == stats.host_bytes > 0 and all(torch.equal(o, expected) for o in _forwards(model, x))
        handle.disable()
        if not ok:
            return f"FAIL {name}: pinned {stats.pinned_host_bytes} of {stats.host_bytes} host bytes"
    return "PASS every host buffer registered (packed and disk tier), outputs bit-identical"


def check_paths(tmp: str) -> str:
    """Three forwards of the packed, float8, disk-tier and deferred-copy (prefetch depth 2) paths."""
    block_bytes = 2 * DIM * 4 * DIM * 2
    configs = {
        "packed": _config(),
        "depth-2": _config(layer_options={"dit": {"prefetch_depth": 2}}),
        "disk tier": _config(host_budget_gb=2.5 * block_bytes / 1e9, disk_dir=tmp),
    }
    for name, config in configs.items():
        model, x, expected = _model()
        handle = enable_offload(model, config, device="cuda")
        outs = _forwards(model, x)
        handle.disable()
        if not all(torch.equal(o, expected) for o in outs):
            return f"FAIL {name}: output differs from resident"
    model, x, _ = _model()
    handle = enable_offload(model, _config(layer_options={"dit": {"storage_dtype": "float8_e4m3fn"}}), device="cuda")
    outs = _forwards(model, x)
    handle.disable()
    if not all(torch.equal(o, outs[0]) for o in outs):
        return "FAIL float8: forwards disagree with each other"
    return "PASS packed, depth-2, disk tier bit-identical to resident; float8 steady (3 forwards each)"


def check_delays() -> str:
    """Slow compute (a sleep kernel before every block) and slow copies (a sleep on the copy stream)."""
    model, x, expected = _model()
    handle = enable_offload(model, _config(), device="cuda")
    hooks = [b.register_forward_pre_hook(lambda m, a: torch.cuda._sleep(2_000_000)) for b in model.blocks]
    slow_compute = _forwards(model, x)
    for h in hooks:
        h.remove()
    engine = handle.backend._engine
    real_issue = engine._issue

    def slow_issue(slot, job, record):
        def slow_job():
            torch.cuda._sleep(2_000_000)  # on the copy stream: the copy lands late
            return job()

        real_issue(slot, slow_job, record)

    engine._issue = slow_issue
    slow_copies = _forwards(model, x)
    handle.disable()
    if not all(torch.equal(o, expected) for o in slow_compute + slow_copies):
        return "FAIL output differs under injected delays"
    return "PASS slow compute and slow copies: bit-identical"


def check_drop() -> str:
    """Drop a pipeline without disable while a copy is in flight, then allocate slot-sized memory at once."""
    model, x, _ = _model()
    handle = enable_offload(model, _config(), device="cuda")
    slot_bytes = handle.placement.slot_nbytes
    _forwards(model, x, 1)  # the last block prefetches the first: a copy is in flight
    del model, handle
    gc.collect()
    probes = [torch.full((slot_bytes,), 7, dtype=torch.uint8, device="cuda") for _ in range(4)]
    torch.cuda.synchronize()
    threads = [t.name for t in threading.enumerate() if t.name.startswith("layerstream")]
    if not all(bool((p == 7).all()) for p in probes):
        return "FAIL a slot-sized allocation after the drop was overwritten"
    if threads:
        return f"FAIL threads left after the drop: {threads}"
    return "PASS dropped pipeline: allocations after it keep their values, no thread left"


def check_sync_debug() -> str:
    model, x, expected = _model()
    handle = enable_offload(model, _config(), device="cuda")
    _forwards(model, x, 2)  # learn the order; the steady state follows
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():
            out = model(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ok = torch.equal(out.cpu(), expected)
    handle.disable()
    return "PASS no host synchronize in the steady state" if ok else "FAIL output differs"


def check_capture() -> str:
    model, x, _ = _model()
    handle = enable_offload(model, _config(), device="cuda")
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.no_grad(), torch.cuda.graph(graph):
            model(x)
    except UnsupportedUseError as e:
        result = "PASS capture refused: " + str(e)[:80]
    except Exception as e:  # noqa: BLE001 - reported as the check's result
        result = f"FAIL capture raised {type(e).__name__}: {e}"
    else:
        result = "FAIL capture was not refused"
    torch.cuda.synchronize()
    handle.disable()
    return result


def check_second_gpu() -> str:
    """In a fresh process (this one has contexts on GPU 0 from the checks above): a model on cuda:1, enabled and
    run from a thread that never set its device, leaves no context of that process on GPU 0."""
    import subprocess

    if torch.cuda.device_count() < 2:
        return "SKIP second GPU: one device"
    done = subprocess.run([sys.executable, __file__, "--second-gpu-child"], capture_output=True, text=True, timeout=300)
    return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else f"FAIL child exited {done.returncode}: {done.stderr[-300:]}"


def _second_gpu_child() -> str:
    try:
        import pynvml
    except ImportError:
        return "SKIP second GPU: pynvml is not installed (it tells which processes hold a context on GPU 0)"
    result = {}

    def on_cuda_1():
        model, x, expected = _model("cuda:1")
        handle = enable_offload(model, _config(), device="cuda:1")
        result["ok"] = all(torch.equal(o, expected) for o in _forwards(model, x))
        handle.disable()

    thread = threading.Thread(target=on_cuda_1)
    thread.start()
    thread.join()
    import os

    pynvml.nvmlInit()
    gpu0 = pynvml.nvmlDeviceGetHandleByIndex(0)
    on_gpu0 = [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(gpu0)]
    if os.getpid() in on_gpu0:
        return "FAIL a context on GPU 0 from a model on cuda:1"
    return ("PASS" if result.get("ok") else "FAIL output differs:") + " model on cuda:1 from a thread: no context on GPU 0"


def main() -> int:
    import tempfile

    checks = [("pinning", check_pinning), ("paths", check_paths), ("delays", check_delays), ("drop", check_drop),
              ("sync-debug", check_sync_debug), ("capture", check_capture), ("second-gpu", check_second_gpu)]
    if sys.argv[1:] == ["--second-gpu-child"]:
        print(_second_gpu_child(), flush=True)
        return 0
    only = set(sys.argv[1:])
    failed = 0
    for name, check in checks:
        if only and name not in only:
            continue
        start = time.perf_counter()
        try:
            with tempfile.TemporaryDirectory() as tmp:
                line = check(tmp) if check in (check_pinning, check_paths) else check()
        except Exception as e:  # noqa: BLE001 - one line per check, whatever happens
            line = f"FAIL {type(e).__name__}: {e}"
            traceback.print_exc(file=sys.stderr)
        failed += line.startswith("FAIL")
        print(f"{name}: {line} ({time.perf_counter() - start:.1f} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
