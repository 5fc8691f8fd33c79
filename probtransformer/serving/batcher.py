"""An asyncio micro-batcher: concurrent requests with equal keys run as one call on one worker.

Every request is a ``(key, payload, rows)``. The batcher takes the oldest waiting request, waits
until ``max_wait`` seconds after its arrival for more requests with the same key (or until
their rows reach ``max_rows``), and runs them together as ``run_batch(payloads)`` on the worker
thread. Requests with other keys wait for their own batch, oldest first. While a batch runs,
new requests queue up, so a busy server batches more without waiting longer: a request that
waited through a pass has had its window and runs as soon as the worker is free. A lone
request (the last batch held one request and no other arrived within ``max_wait`` before it)
runs at once, so a single client pays no wait. All model work of the server runs on that one
worker thread, in order (``Pyro``'s global state is not thread-safe); ``run_on_worker`` queues
other work (a text generation) on it.

Like the dynamic batching of model servers (Triton's ``max_queue_delay_microseconds``), but
keyed: requests merge only when they ask for the same draws and flags. Requests whose merged
call fails are run again one by one, so an error reaches only the request that caused it.
``run_batch`` gets a second argument, ``abandoned()``, which says whether every client of the
running batch has left: a long call checks it between its parts and raises ``Abandoned``.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import threading
from collections.abc import Callable, Hashable
from typing import Any


class Abandoned(Exception):
    """Raised by ``run_batch`` that stopped early because every client of its batch left."""


@dataclasses.dataclass(eq=False)
class _Request:
    key: Hashable
    payload: Any
    rows: int
    arrived: float
    future: asyncio.Future
    gap: float  # seconds since the request before it arrived (any key)


class MicroBatcher:
    """Group concurrent requests by key into calls of ``run_batch`` on one worker thread.

    Args:
        run_batch: ``run_batch(payloads, abandoned) -> results``, one result per payload, in
            order. It runs on the worker thread; an exception fails the batch (each request is
            then run alone), except ``Abandoned``. ``abandoned()`` is true once every request
            of the batch has been cancelled (thread-safe).
        max_rows: a batch holds requests of at most this many rows in all (a larger request
            runs alone); 1 turns batching off.
        max_wait: seconds a request waits for others to join its batch.

    Raises:
        ValueError: ``max_rows < 1`` or ``max_wait < 0``.
    """

    def __init__(
        self,
        run_batch: Callable[[list[Any], Callable[[], bool]], list[Any]],
        *,
        max_rows: int,
        max_wait: float,
    ) -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        if max_wait < 0:
            raise ValueError(f"max_wait must be >= 0 seconds, got {max_wait}")
        self.run_batch = run_batch
        self.max_rows = max_rows
        self.max_wait = max_wait
        self.batches = 0  # calls of run_batch made (for /metadata and the tests)
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="model")
        self._pending: collections.deque[_Request] = collections.deque()
        self._arrived = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._last_arrival = -float("inf")
        self._last_batch_requests = 1
        self._running: list[_Request] = []  # the batch on the worker
        self._left = threading.Event()  # every client of the batch on the worker left

    def start(self) -> None:
        """Start batching (call from the running event loop)."""
        self._loop_task = asyncio.get_running_loop().create_task(self._serve())

    async def stop(self) -> None:
        """Finish the requests already waiting, then stop the loop and the worker thread.

        Called once the server has answered or cancelled every request: a batch still on the
        worker then has no client, and stops at its next check (a pass that outlived the drain
        would otherwise hold the process until it ends)."""
        while self._pending:
            await asyncio.sleep(0.01)
        if self._loop_task is not None:
            self._loop_task.cancel()
        self._left.set()
        self._worker.shutdown(wait=True)

    async def submit(self, key: Hashable, payload: Any, rows: int) -> Any:
        """Queue a request and wait for its result (its exception is raised here). A request
        cancelled while it waits (its client left) is dropped."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        request = _Request(key, payload, rows, now, loop.create_future(), now - self._last_arrival)
        self._last_arrival = now
        self._pending.append(request)
        self._arrived.set()
        try:
            return await request.future
        finally:
            if request.future.cancelled():
                self._arrived.set()  # its batching window need not wait any longer
                if request in self._running and all(r.future.done() for r in self._running):
                    self._left.set()  # the worker stops its pass at the next check

    async def run_on_worker(self, function: Callable[[], Any]) -> Any:
        """Run ``function()`` on the worker thread, after the work queued before it."""
        return await asyncio.get_running_loop().run_in_executor(self._worker, function)

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while self._pending and self._pending[0].future.done():
                self._pending.popleft()  # its client left
            if not self._pending:
                self._arrived.clear()
                await self._arrived.wait()
                continue
            first = self._pending[0]
            # the window closes max_wait after the request arrived (a request that waited through
            # a pass runs at once); a lone request (the last batch was one request, none other
            # came within a window before it, none waits beside it) runs at once: a single
            # client pays no wait
            lone = (
                self._last_batch_requests == 1
                and first.gap >= self.max_wait
                and len(self._pending) == 1
            )
            deadline = first.arrived if lone else first.arrived + self.max_wait
            while self._rows_waiting(first.key) < self.max_rows and not first.future.done():
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), remaining)
                except TimeoutError:
                    break
            if first.future.done():
                continue  # its client left while it waited: choose again
            batch = self._take(first.key)
            if batch:
                self._last_batch_requests = len(batch)
                self._running, self._left = batch, threading.Event()
                outcomes = await loop.run_in_executor(self._worker, self._run, batch, self._left)
                self._running = []
                for request, (ok, value) in zip(batch, outcomes, strict=True):
                    if request.future.done():  # the client went away
                        continue
                    if ok:
                        request.future.set_result(value)
                    else:
                        request.future.set_exception(value)

    def _rows_waiting(self, key: Hashable) -> int:
        return sum(r.rows for r in self._pending if r.key == key and not r.future.done())

    def _take(self, key: Hashable) -> list[_Request]:
        """The oldest waiting requests with ``key``, up to ``max_rows`` rows (at least one)."""
        batch, rows, kept = [], 0, collections.deque()
        for request in self._pending:
            if request.future.done():
                continue  # cancelled while waiting
            if request.key == key and (not batch or rows + request.rows <= self.max_rows):
                batch.append(request)
                rows += request.rows
            else:
                kept.append(request)
        self._pending = kept
        return batch

    def _run(self, batch: list[_Request], left: threading.Event) -> list[tuple[bool, Any]]:
        """On the worker: the batch in one call; if that fails, each request alone."""
        self.batches += 1
        try:
            results = self.run_batch([r.payload for r in batch], left.is_set)
            return [(True, result) for result in results]
        except Exception as e:
            if len(batch) == 1 or isinstance(e, Abandoned):
                return [(False, e)] * len(batch)
        outcomes = []
        for request in batch:
            self.batches += 1
            try:
                outcomes.append((True, self.run_batch([request.payload], left.is_set)[0]))
            except Exception as e:
                outcomes.append((False, e))
        return outcomes
