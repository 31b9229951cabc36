"""The one loop that makes a group's outputs, in process or on a rank: `run_group`.
A group is one request alone (an `Omni.run` per output, each encoded and released before the next starts) or a
batch (one `Omni.run_batch`). Between steps, and before each output, `checkpoint(where)` may raise to stop;
outputs nobody wants (a placeholder's, a request stopped in its batch) are dropped without being encoded."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from layerstream.outputs import OutputEncoding, default_encoding
from layerstream.omni import RunStats
from layerstream.request import GenerationRequest
from layerstream.server.served import StepObserver

Checkpoint = Callable[[str], None]


@dataclass(frozen=True)
class GroupWork:
    """What one pipeline group runs: one request alone or one batch call (pickled to a rank)."""

    requests: tuple[GenerationRequest, ...]  # one alone, or a batch's (not checked again on a rank)
    batch_call: bool  # one `Omni.run_batch` (else `Omni.run` per output of the one request)
    placeholder: bool = False  # an idle rank's copy of another's work: the same forwards, outputs dropped
    encodings: tuple[OutputEncoding | None, ...] = ()  # per request (None, or missing: the kind's default)

    @classmethod
    def of(cls, jobs: Any, *, batch_call: bool) -> GroupWork:
        """The work of queued jobs (their `ServedRequest`s)."""
        served = [job.served for job in jobs]
        return cls(tuple(s.request for s in served), batch_call=batch_call, encodings=tuple(s.encoding for s in served))

    def as_placeholder(self) -> GroupWork:
        """The cheapest work with the same forwards: a batch call of one output, or the request alone."""
        first = self.requests[0]
        if self.batch_call:
            return GroupWork((replace(first, n=1),), batch_call=True, placeholder=True)
        return GroupWork((first,), batch_call=False, placeholder=True)

    def encode(self, index: int, result: Any) -> bytes:
        encoding = self.encodings[index] if index < len(self.encodings) else None
        return (encoding or default_encoding(result.kind)).encode(result)


@dataclass
class RequestResult:
    """One request's outputs, encoded (sent back pickled from a rank, as bytes), and what a response reports."""

    files: list[bytes] = field(default_factory=list)
    runs: list[RunStats] = field(default_factory=list)
    frames_shape: tuple[int, ...] = ()


def run_group(
    omni: Any, work: GroupWork, checkpoint: Checkpoint, *, observer: StepObserver | None = None,
    wanted: Callable[[int], bool] = lambda index: True,
) -> list[RequestResult]:
    """Make every output of `work` on `omni`; one `RequestResult` per request (`wanted(i)` False: unencoded)."""

    def steps(where: str) -> Callable[[int, int, float], None]:
        def on_step(step: int, total: int, seconds: float) -> None:
            checkpoint(f"after step {step} of {total} ({where})")
            if observer is not None:  # between steps, on this thread: the counters are whole
                observer.stepped(step, total, seconds, omni.stats())

        return on_step

    def keep(index: int) -> bool:
        return not work.placeholder and wanted(index)

    if work.batch_call:
        return _run_batch(omni, work, steps, keep)
    (request,) = work.requests
    on_latents = observer.latents if observer is not None and observer.wants_latents else None
    answer = RequestResult()
    for index, output in enumerate(request.outputs()):
        where = f"output {index + 1} of {request.n}"
        checkpoint(f"before {where}")
        result = omni.run(output, on_step=steps(where), on_latents=on_latents)
        if keep(0):
            answer.files.append(work.encode(0, result))
        answer.runs.append(result.stats)
        answer.frames_shape = result.frames.shape
        # drop the float and uint8 frames now: otherwise `result` holds them while the next output runs
        del result
    return [answer]


def _run_batch(omni: Any, work: GroupWork, steps, keep: Callable[[int], bool]) -> list[RequestResult]:
    requests = work.requests
    where = f"a batch of {len(requests)} request(s), {sum(r.n for r in requests)} output(s)"
    results: list[Any] = omni.run_batch(list(requests), on_step=steps(where))
    answers, offset = [], 0
    for number, request in enumerate(requests):
        mine = range(offset, offset + request.n)
        offset += request.n
        answer = RequestResult(runs=[results[mine[0]].stats], frames_shape=results[mine[0]].frames.shape)
        for k in mine:
            if keep(number):
                answer.files.append(work.encode(number, results[k]))
            results[k] = None  # its float and uint8 frames are not needed once encoded
        answers.append(answer)
    return answers
