"""The GPU checks of the CUDA path, one line each (`PASS`/`FAIL`/`SKIP name: detail`); run by gpu_checks.sh.

Each check builds a toy DiT in bf16 on the GPU and compares the streamed output with the resident one, bit for
bit, under one hazard: page registration of every host buffer, the CUDA sanitizer (run the script again with
TORCH_CUDA_SANITIZER=1: gpu_checks.sh does), slow compute and slow copies on a user stream, a pipeline dropped
without `disable()`, no host synchronize in the steady state, graph capture, and a second GPU from a thread that
never set its device. Three more measure what streaming still costs the compute thread (one ratio each, from
one run): the disk tier's copies queued by the engine's issuing thread against queued by the compute thread,
the blocking copy back of blocks that write their buffers, and the copy per saved weight in backward. Written
for a GPU and not yet run on one: each check catches its own error and reports it.

    python benchmarks/gpu_checks.py [check ...]
    python benchmarks/gpu_checks.py --cpu-simulation [PAIRS [DISK_PER_COMPUTE]]   # no GPU: a CPU figure
    python benchmarks/gpu_checks.py --list                     # the checks' names
"""

from __future__ import annotations

import gc
import contextlib
import sys
import threading
import time
import traceback

import torch
from torch import nn

from layerstream import UnsupportedUseError, enable_offload
from layerstream.runtime.engines.accelerator_api import AcceleratorApi
from layerstream.runtime.engines.copy_engine import AcceleratorCopyEngine

DIM, BLOCKS = 256, 6


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.proj = nn.Linear(DIM, 4 * DIM)
        self.out = nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        return x + self.out(torch.nn.functional.gelu(self.proj(self.norm(x))))


class CountingBlock(Block):
    """A block that writes one of its buffers in forward (a step counter): streaming copies it back after it."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(1))
        self.writes = True

    def forward(self, x):
        if self.writes:
            self.calls.add_(1)
        return super().forward(x)


class ToyDiT(nn.Module):
    _layerwise_offload_blocks_attrs = ["blocks"]

    def __init__(self, block=Block):
        super().__init__()
        self.blocks = nn.ModuleList(block() for _ in range(BLOCKS))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _model(device: str = "cuda", block=Block) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = ToyDiT(block).to(torch.bfloat16).eval()
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
    """Slow compute (a sleep kernel before every block) and slow copies (a sleep on the copy stream), the model
    running on a user stream (the engine waits and releases on the caller's current stream, not the default)."""
    model, x, expected = _model()
    handle = enable_offload(model, _config(), device="cuda")
    user = torch.cuda.Stream()
    user.wait_stream(torch.cuda.current_stream())  # x was made on the default stream
    hooks = [b.register_forward_pre_hook(lambda m, a: torch.cuda._sleep(2_000_000)) for b in model.blocks]
    with torch.cuda.stream(user):
        slow_compute = _forwards(model, x)
    for h in hooks:
        h.remove()
    engine = handle.backend._engine
    real_queue = engine._queue_copy

    def slow_queue(slot, job, record, copy):
        def slow_job():
            torch.cuda._sleep(2_000_000)  # on the copy stream: the copy lands late
            return job()

        real_queue(slot, slow_job, record, copy)

    engine._queue_copy = slow_queue
    with torch.cuda.stream(user):
        slow_copies = _forwards(model, x)
    handle.disable()
    if not all(torch.equal(o, expected) for o in slow_compute + slow_copies):
        return "FAIL output differs under injected delays on a user stream"
    return "PASS slow compute and slow copies on a user stream: bit-identical"


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
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:  # a verdict printed before an abort at exit is no pass
        return f"FAIL child exited {done.returncode}: {(lines or ['no verdict'])[-1]}; {done.stderr[-300:]}"
    return lines[-1]


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


def _timed_forwards(model, x, n: int = 5) -> tuple[list[torch.Tensor], float]:
    """(outputs, seconds per forward) of `n` forwards after one warm-up."""
    with torch.no_grad():
        model(x)
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = [model(x) for _ in range(n)]
        torch.cuda.synchronize()
    return [o.cpu() for o in outs], (time.perf_counter() - start) / n


def check_write_back() -> str:
    """Blocks that write a buffer in forward: each is copied back to the host store after the block, a host-side
    copy that waits for the block's kernels (measured: forward time with the writes against without them)."""
    model, x, _ = _model(block=CountingBlock)
    reference = ToyDiT(CountingBlock).to(torch.bfloat16).eval().cuda()
    reference.load_state_dict(model.state_dict())
    handle = enable_offload(model, _config(), device="cuda")
    for block in model.blocks:
        block.writes = False
    _, without = _timed_forwards(model, x)
    for block in model.blocks:
        block.writes = True
    outs, with_writes = _timed_forwards(model, x)
    expected, _ = _timed_forwards(reference, x)
    written = handle.stats().bytes_written_back
    handle.disable()
    counts_agree = all(torch.equal(a.calls.cpu(), b.calls.cpu()) for a, b in zip(model.blocks, reference.blocks))
    if not (counts_agree and all(torch.equal(o, e) for o, e in zip(outs, expected))):
        return "FAIL written buffers or outputs differ from resident"
    return (f"PASS buffers written in forward kept ({written} bytes copied back); forward {with_writes / without:.2f}x "
            f"of the same forward without writes ({(with_writes - without) / BLOCKS * 1e3:.3f} ms per block)")


def check_backward() -> str:
    """Gradients with respect to the input through streamed blocks (frozen weights): each saved weight comes
    back from the host store in backward, one blocking copy each (measured against the resident backward)."""
    from layerstream.runtime.torch_contract import saved_tensors

    model, x, _ = _model()
    model.requires_grad_(False)
    reference = ToyDiT().to(torch.bfloat16).eval().cuda().requires_grad_(False)
    reference.load_state_dict(model.state_dict())

    def backward_seconds(m, n: int = 3):
        grads, total = [], 0.0
        for _ in range(n + 1):
            xi = x.detach().clone().requires_grad_(True)
            out = m(xi).float().sum()
            torch.cuda.synchronize()
            start = time.perf_counter()
            out.backward()
            torch.cuda.synchronize()
            total += time.perf_counter() - start if grads else 0.0  # (the first is a warm-up)
            grads.append(xi.grad.cpu())
        return grads, total / n

    expected, resident = backward_seconds(reference)
    handle = enable_offload(model, _config(), device="cuda")
    real, copies = saved_tensors.SlotAlias.materialize, []
    saved_tensors.SlotAlias.materialize = lambda self: copies.append(1) or real(self)
    try:
        grads, streamed = backward_seconds(model)
    finally:
        saved_tensors.SlotAlias.materialize = real
        handle.disable()
    if not all(torch.equal(g, e) for g, e in zip(grads, expected)):
        return "FAIL input gradients differ from resident"
    per_backward = len(copies) // len(grads)
    return (f"PASS input gradients bit-identical; backward {streamed / resident:.2f}x of resident, "
            f"{per_backward} saved weights copied back each ({(streamed - resident) / max(per_backward, 1) * 1e3:.3f} ms each)")


def _disk_tier_run(model, x, config, device: str, engine_factory, *, simulated_disk_gbps=None, n: int = 3):
    """(outputs, (stall, issue) host seconds per block call, seconds per forward) over `n` forwards after a
    warm-up, from the runtime's own accounting: `stall_seconds` is compute waiting for bytes that are late,
    `copy_issue_seconds` compute queuing copies (of the blocks after it) before its own kernels."""
    handle = enable_offload(model, config, device=device, engine_factory=engine_factory, simulated_disk_gbps=simulated_disk_gbps)
    with torch.no_grad():
        model(x)  # learns the order; the read-ahead follows it from now on
        before = handle.stats()
        start = time.perf_counter()
        outs = [model(x).cpu() for _ in range(n)]  # (.cpu() waits for the forward)
        seconds = (time.perf_counter() - start) / n
    after, calls = handle.stats(), n * len(model.blocks)
    handle.disable()
    blocked = ((after.stall_seconds - before.stall_seconds) / calls, (after.copy_issue_seconds - before.copy_issue_seconds) / calls)
    return outs, blocked, seconds


def _blocked_line(before: tuple[float, float], after: tuple[float, float]) -> str:
    return (f"compute thread per block: queuing copies {before[1] * 1e3:.2f} -> {after[1] * 1e3:.2f} ms, "
            f"waiting for late bytes {before[0] * 1e3:.2f} -> {after[0] * 1e3:.2f} ms")


def check_compute_thread(tmp: str) -> str:
    """Disk tier: the engine's issuing thread queues disk blocks' copies (after their reads) against the compute
    thread queuing them itself (issue_thread=False, the behaviour before). Bit-identical, and the compute thread's
    host time blocked per block and the forward time as ratios of one run."""
    model, x, expected = _model()
    config = _config(host_budget_gb=2.5 * 2 * DIM * 4 * DIM * 2 / 1e9, disk_dir=tmp)
    rows = {}
    for issue_thread in (False, True):
        factory = lambda d, n, it=issue_thread: AcceleratorCopyEngine(d, n, issue_thread=it)  # noqa: E731
        rows[issue_thread] = _disk_tier_run(model, x, config, "cuda", factory)
    if not all(torch.equal(o, expected) for outs, _, _ in rows.values() for o in outs):
        return "FAIL disk tier: output differs from resident"
    (_, before, t_before), (_, after, t_after) = rows[False], rows[True]
    return (f"PASS disk tier bit-identical; issuing thread against compute thread: {_blocked_line(before, after)}; "
            f"forward {t_after / t_before:.2f}x")


class SyncCpuApi(AcceleratorApi):
    """A stand-in for torch.cuda on the CPU for `--cpu-simulation` (overriding every call of `AcceleratorApi`):
    one synchronous device, so every copy is done when its job returns and every event is complete; what is
    simulated is which host thread runs which job."""

    class Stream:
        def __init__(self, device=None):
            pass

        def wait_event(self, event):
            pass  # synchronous: the release it waits for is already done

        def synchronize(self):
            pass

    class Event:
        def __init__(self, enable_timing=False):
            pass

        def record(self, stream=None):
            pass

        def synchronize(self):
            pass

    _stream = Stream()

    @staticmethod
    def stream(stream):
        return contextlib.nullcontext()

    def current_stream(self, device=None):
        return self._stream

    @staticmethod
    def device(device):
        return contextlib.nullcontext()  # one device: always the current one

    @staticmethod
    def is_current_stream_capturing():
        return False  # no graphs on the CPU

    @staticmethod
    def record_stream(tensor, stream):
        pass  # CPU memory: the job holding the slot keeps it alive

    @staticmethod
    def host_register(buffer):
        return False  # nothing to page-lock

    @staticmethod
    def host_unregister(buffer):
        pass  # nothing was page-locked


def cpu_simulation(num_pairs: int = 3, disk_per_compute: float = 3.0) -> str:
    """The compute-thread check on the CPU: the accelerator engine over `SyncCpuApi`, the disk tier read from a
    simulated disk that reads a block in `disk_per_compute` times its compute, float32 on one intra-op thread (a CPU figure, not a GPU one: the
    stand-in copies synchronously, so a copy the compute thread queues costs it a memcpy here, in both rows).
    The two engines run in turns, `num_pairs` times; the medians are reported."""
    import statistics
    import tempfile

    torch.set_num_threads(1)  # one compute thread, as the GPU's host side has: the I/O threads get the other cores
    torch.manual_seed(0)
    model = ToyDiT().eval()
    x = torch.randn(8, 64, DIM)
    with torch.no_grad():
        expected = model(x)
        start = time.perf_counter()
        model(x)
        compute_per_block = (time.perf_counter() - start) / BLOCKS
    block_bytes = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    disk_gbps = block_bytes / (disk_per_compute * compute_per_block) / 1e9
    api = SyncCpuApi()
    rows: dict[bool, list] = {False: [], True: []}
    for _ in range(num_pairs):
        for issue_thread in (False, True):
            with tempfile.TemporaryDirectory() as tmp:
                config = _config(host_budget_gb=2.5 * block_bytes / 1e9, disk_dir=tmp)
                factory = lambda d, n, it=issue_thread: AcceleratorCopyEngine(d, n, api=api, issue_thread=it)  # noqa: E731
                rows[issue_thread].append(_disk_tier_run(model, x, config, "cpu", factory, simulated_disk_gbps=disk_gbps))
    if not all(torch.equal(o, expected) for runs in rows.values() for outs, _, _ in runs for o in outs):
        return "FAIL cpu simulation: output differs from resident"
    before, after = (tuple(statistics.median(r[1][i] for r in rows[k]) for i in (0, 1)) for k in (False, True))
    t_before, t_after = (statistics.median(r[2] for r in rows[k]) for k in (False, True))
    return (f"PASS CPU simulation ({BLOCKS} blocks, {BLOCKS - 2} on a {disk_gbps:.2f} GB/s simulated disk, "
            f"{compute_per_block * 1e3:.1f} ms compute a block), issuing thread against compute thread: "
            f"{_blocked_line(before, after)}; forward {t_after / t_before:.2f}x; bit-identical")


def main() -> int:
    import tempfile

    checks = [("pinning", check_pinning), ("paths", check_paths), ("delays", check_delays), ("drop", check_drop),
              ("sync-debug", check_sync_debug), ("capture", check_capture), ("second-gpu", check_second_gpu),
              ("compute-thread", check_compute_thread), ("write-back", check_write_back), ("backward", check_backward)]
    if sys.argv[1:] == ["--second-gpu-child"]:
        print(_second_gpu_child(), flush=True)
        return 0
    if sys.argv[1:2] == ["--cpu-simulation"]:
        line = cpu_simulation(*(t(v) for t, v in zip((int, float), sys.argv[2:4])))
        print(f"compute-thread: {line}", flush=True)
        return 1 if line.startswith("FAIL") else 0
    if sys.argv[1:] == ["--list"]:
        print(" ".join(name for name, _ in checks))
        return 0
    only = set(sys.argv[1:])
    failed = 0
    for name, check in checks:
        if only and name not in only:
            continue
        start = time.perf_counter()
        try:
            with tempfile.TemporaryDirectory() as tmp:
                line = check(tmp) if check in (check_pinning, check_paths, check_compute_thread) else check()
        except Exception as e:  # noqa: BLE001 - one line per check, whatever happens
            line = f"FAIL {type(e).__name__}: {e}"
            traceback.print_exc(file=sys.stderr)
        failed += line.startswith("FAIL")
        print(f"{name}: {line} ({time.perf_counter() - start:.1f} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
