"""Server-sent events of a job: published from the worker thread (``call_soon_threadsafe``, which keeps their
order) into an asyncio queue per event stream."""

from __future__ import annotations

import asyncio
import json
import threading
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal

EventName = Literal["status", "progress", "preview"]
KEEPALIVE_SECONDS = 15.0  # a comment line this often keeps proxies from closing a quiet stream


@dataclass(frozen=True)
class JobEvent:
    name: EventName
    data: dict[str, Any]

    def encode(self) -> str:
        return f"event: {self.name}\ndata: {json.dumps(self.data)}\n\n"


class JobEvents:
    """Subscriptions per job id; `publish` may be called from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._subscribers: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Queue]]] = defaultdict(list)

    def subscribe(self, job_id: str) -> asyncio.Queue:
        """A queue on the running loop that receives the job's events from now on."""
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._subscribers[job_id].append((asyncio.get_running_loop(), queue))
        return queue

    def unsubscribe(self, job_id: str, queue: asyncio.Queue) -> None:
        with self._lock:
            subscribers = self._subscribers.get(job_id, [])
            subscribers[:] = [entry for entry in subscribers if entry[1] is not queue]
            if not subscribers:
                self._subscribers.pop(job_id, None)

    def wants(self, job_id: str) -> bool:
        """Whether any stream watches the job (a preview nobody reads need not be drawn)."""
        with self._lock:
            return bool(self._subscribers.get(job_id))

    def publish(self, job_id: str, event: JobEvent) -> None:
        with self._lock:
            subscribers = list(self._subscribers.get(job_id, ()))
        for loop, queue in subscribers:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, event)
            except RuntimeError:  # the loop is closed (the server is stopping): nobody is left to read it
                pass


async def stream_events(
    events: JobEvents, job_id: str, snapshot: Callable[[], dict[str, Any] | None]
) -> AsyncIterator[str]:
    """A job's event stream: its status now (`snapshot()`, None once deleted), then its events until it ends."""
    queue = events.subscribe(job_id)  # before the snapshot: no event between the two is missed
    try:
        current = await asyncio.to_thread(snapshot)
        if current is None:
            return
        last_status = current["status"]
        yield JobEvent("status", current).encode()
        while last_status not in ("completed", "failed"):
            try:
                event: JobEvent = await asyncio.wait_for(queue.get(), KEEPALIVE_SECONDS)
            except asyncio.TimeoutError:
                if await asyncio.to_thread(snapshot) is None:
                    return  # deleted while nothing happened
                yield ": keep-alive\n\n"
                continue
            if event.name == "status":
                if event.data.get("deleted"):
                    return
                if event.data["status"] == last_status:
                    continue  # already sent in the snapshot
                last_status = event.data["status"]
            yield event.encode()
    finally:
        events.unsubscribe(job_id, queue)
