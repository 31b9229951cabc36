"""Two threads on one offloaded pipeline never give a wrong output: the raw pipeline refuses the second caller at
the entry of its call, before it touches the scheduler or the streamer; `Omni.generate` makes it wait its turn.
Every output that comes back equals the same seed run alone on a thread of its own, bit for bit (a new thread is
the like-for-like reference: tests/same_threading.py)."""

from __future__ import annotations

import inspect
import threading

import pytest
import torch

pytest.importorskip("diffusers")

from layerstream import ConcurrentUseError, Omni, enable_offload  # noqa: E402
from tests.runtime.tiny_pipelines import DIT, generate, load  # noqa: E402
from tests.same_threading import on_new_thread  # noqa: E402

ROUNDS = 50
FAST = dict(num_inference_steps=1)  # one step keeps 50 rounds short; the preamble is what races


def _race(call, rounds: int = ROUNDS) -> tuple[list, list[BaseException]]:
    """Run `call()` in two threads released together by a barrier, `rounds` times: (outputs, errors)."""
    outputs, errors = [], []
    lock = threading.Lock()
    for _ in range(rounds):
        barrier = threading.Barrier(2)

        def one():
            barrier.wait()
            try:
                out = call()
            except BaseException as e:  # noqa: BLE001 - every error is kept and checked by the test
                with lock:
                    errors.append(e)
            else:
                with lock:
                    outputs.append(out)

        threads = [threading.Thread(target=one) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
            assert not t.is_alive(), "a thread hung"
    return outputs, errors


def test_two_threads_on_the_raw_pipeline_get_the_seed_output_or_a_refusal():
    pipe = load("wan")
    expected = on_new_thread(lambda: generate(pipe, "wan", **FAST))
    handle = enable_offload(pipe, DIT, device="cpu")
    outputs, errors = _race(lambda: generate(pipe, "wan", **FAST))
    handle.disable()
    assert len(outputs) >= ROUNDS  # every round, at least one thread ran
    assert all(isinstance(e, ConcurrentUseError) for e in errors), [repr(e) for e in errors if not isinstance(e, ConcurrentUseError)]
    wrong = [i for i, out in enumerate(outputs) if not torch.equal(out, expected)]
    assert not wrong, f"{len(wrong)} of {len(outputs)} outputs differ from the seed run alone"


def test_a_second_caller_is_refused_before_it_touches_the_scheduler():
    """Thread one waits between its denoising steps (where per-forward ownership would be free); a second call
    is refused at once and leaves the scheduler's timesteps and step index as the first call set them."""
    pipe = load("wan")
    expected = on_new_thread(lambda: generate(pipe, "wan"))
    handle = enable_offload(pipe, DIT, device="cpu")
    between_steps, go_on = threading.Event(), threading.Event()
    result = {}

    def step_end(p, step, timestep, callback_kwargs):
        if step == 0:
            between_steps.set()
            go_on.wait(timeout=60)
        return callback_kwargs

    def first():
        result["out"] = generate(pipe, "wan", callback_on_step_end=step_end)

    t = threading.Thread(target=first)
    t.start()
    assert between_steps.wait(timeout=60)
    scheduler = pipe.scheduler
    before = (scheduler.timesteps.clone(), scheduler.step_index, scheduler.num_inference_steps)
    with pytest.raises(ConcurrentUseError, match="another thread"):
        generate(pipe, "wan", num_inference_steps=7)
    with pytest.raises(ConcurrentUseError):
        pipe.encode_prompt("another prompt", device="cpu")
    with pytest.raises(ConcurrentUseError):
        handle.disable()  # the weights must not go away under the running call
    after = (scheduler.timesteps.clone(), scheduler.step_index, scheduler.num_inference_steps)
    go_on.set()
    t.join(timeout=60)
    assert torch.equal(before[0], after[0]) and before[1:] == after[1:]
    assert torch.equal(result["out"], expected)
    handle.disable()


def test_the_pipeline_keeps_its_class_name_and_signature_and_gets_its_class_back():
    pipe = load("wan")
    cls = type(pipe)
    parameters = inspect.signature(pipe.__call__).parameters
    handle = enable_offload(pipe, DIT, device="cpu")
    assert isinstance(pipe, cls) and type(pipe).__name__ == cls.__name__
    assert inspect.signature(pipe.__call__).parameters == parameters  # callers read it to pick arguments
    handle.disable()
    assert type(pipe) is cls


def test_module_mode_refuses_a_second_caller_too():
    pipe = load("wan")
    expected = on_new_thread(lambda: generate(pipe, "wan", **FAST))
    handle = enable_offload(pipe, {"mode": "module", "components": ["dit"]}, device="cpu")
    outputs, errors = _race(lambda: generate(pipe, "wan", **FAST), rounds=10)
    handle.disable()
    assert all(isinstance(e, ConcurrentUseError) for e in errors)
    assert len(outputs) >= 10 and all(torch.equal(out, expected) for out in outputs)


def test_omni_generate_from_two_threads_waits_its_turn_and_both_get_the_seed_output():
    omni = Omni(model="tiny-wan", diffusion_offload_config=DIT, device="cpu")
    # the smallest size the VAE and patch size allow (tiny-wan's default is 64x64, 9 frames): what races is the
    # call's entry, not its size, and 41 decoded videos at the default size cost seconds
    request = dict(seed=3, num_inference_steps=1, height=32, width=32, num_frames=5, keep_raw=True)
    # on the main thread: Omni gives each call the process's thread count, whichever thread makes it
    expected = omni.generate("a red fox in the snow", **request).raw
    # Omni's lock is one mutex around the call: 20 racing rounds show the waiting; the runtime's own refusal
    # (the tests above) keeps 50
    outputs, errors = _race(lambda: omni.generate("a red fox in the snow", **request).raw, rounds=20)
    omni.close()
    assert not errors, [repr(e) for e in errors]
    assert len(outputs) == 2 * 20
    wrong = [i for i, out in enumerate(outputs) if not (out == expected).all()]
    assert not wrong, f"{len(wrong)} of {len(outputs)} outputs differ from the seed run alone"
