"""Runs on a real-width checkpoint end cleanly: exit code 0 and the output written, for every storage form and
tier, whether or not the program disables offload before it ends.

The last block of a forward prefetches the first, so a copy is in flight when a run ends; a lossless block's copy
decodes for a while in torch ops (about 0.1 s per real-width block on one core). Left to the interpreter's
finalisation, that daemon thread was ended inside PyTorch's C++ frames and the process aborted (exit 134,
"terminate called without an active exception"): only a process's own exit shows it, so each case is a process.
Guidance doubles the forwards, as a user's run does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("diffusers")

pytestmark = pytest.mark.slow

REQUEST = ["--steps", "2", "--height", "32", "--width", "32", "--num-frames", "1", "--guidance-scale", "3.0", "--seed", "0"]
DISK_BUDGET_GB = 0.1
"""A host budget of about one real-width block (92 MB in bfloat16): the other blocks stream from disk."""


def _config(storage: str, tier: str, disk_dir: Path) -> dict:
    options = {} if storage == "bfloat16" else {"storage_dtype": storage}
    config = {"mode": "layer", "components": ["dit"], "layer_options": {"dit": options}}
    if tier == "disk":
        config.update(host_budget_gb=DISK_BUDGET_GB, disk_dir=str(disk_dir))
    return config


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=900, env=os.environ.copy())


@pytest.mark.parametrize(
    "storage, tier",
    [("bfloat16", "host"), ("float8_e4m3fn", "disk"), ("lossless", "disk")],  # every form and tier (and each pair in the script below)
)
def test_generate_exits_0_after_writing_its_output(real_width_wan_folder, tmp_path, storage, tier):
    config = _config(storage, tier, tmp_path / "spill")
    argv = [sys.executable, "-m", "layerstream", "generate", "--model", str(real_width_wan_folder), "--dtype", "bfloat16",
            *REQUEST, "--diffusion-offload-config", json.dumps(config), "--output", "out.gif"]  # fmt: skip
    done = _run(argv, tmp_path)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stderr[-3000:]}"
    assert "terminate called" not in done.stderr
    assert (tmp_path / "out.gif").stat().st_size > 0
    assert "time per step" in done.stdout  # the summary was printed before the exit


SCRIPT = """
import atexit, json, os, sys, threading


def no_thread_of_ours_left():
    # registered before layerstream is imported, so it runs after layerstream's own exit hook (last in, first
    # out) and before finalisation: the moment a daemon thread still inside a torch op would abort the process
    alive = sorted(t.name for t in threading.enumerate() if t.name.startswith("layerstream-") and t.is_alive())
    if alive:
        print("still running at exit:", ", ".join(alive), file=sys.stderr, flush=True)
        os._exit(3)


atexit.register(no_thread_of_ours_left)

from layerstream import Omni

folder, cases = sys.argv[1], json.loads(sys.argv[2])
kept = []
for name, config in cases.items():
    omni = Omni(model=folder, diffusion_offload_config=config, dtype="bfloat16")
    result = omni.generate("a fox", height=32, width=32, num_frames=1, num_inference_steps=2, guidance_scale=3.0, seed=0)
    result.save(name + ".gif")
    kept.append(omni)  # never closed: every engine is still open, a copy in flight, when the script ends
    print("done", name, flush=True)
"""


def test_an_omni_script_that_never_closes_exits_0(real_width_wan_folder, tmp_path):
    """Every form and tier in one process (one interpreter's imports, six engines open at its exit), and no
    thread of layerstream's left running when the interpreter begins to finalise: whether a copy is still in
    flight then is a race (the abort came 2 runs in 3 on a loaded machine), the threads left are not."""
    cases = {
        f"{storage}-{tier}": _config(storage, tier, tmp_path / f"spill-{storage}")
        for storage in ("bfloat16", "float8_e4m3fn", "lossless")
        for tier in ("host", "disk")
    }
    script = tmp_path / "never_closes.py"
    script.write_text(textwrap.dedent(SCRIPT))
    done = _run([sys.executable, str(script), str(real_width_wan_folder), json.dumps(cases)], tmp_path)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stderr[-3000:]}"
    assert "terminate called" not in done.stderr
    assert done.stdout.split("\n")[:-1] == [f"done {name}" for name in cases]
    assert all((tmp_path / f"{name}.gif").stat().st_size > 0 for name in cases)
