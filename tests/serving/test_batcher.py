"""The micro-batcher on its own: merging by key, dropping requests whose client left, and
errors reaching only the request that caused them."""

import asyncio
import threading
import time

from probtransformer.serving.batcher import Abandoned, MicroBatcher


def _run(scenario):
    return asyncio.run(scenario())


def test_requests_with_equal_keys_share_a_call_and_others_wait_their_turn():
    calls = []

    def run_batch(payloads, abandoned):
        calls.append(list(payloads))
        return [p * 10 for p in payloads]

    async def scenario():
        batcher = MicroBatcher(run_batch, max_rows=3, max_wait=0.05)
        batcher.start()
        submitted = [
            batcher.submit(key, p, 1)
            for key, p in [("a", 1), ("b", 2), ("a", 3), ("a", 4), ("a", 5)]
        ]
        results = await asyncio.gather(*submitted)
        await batcher.stop()
        return results

    assert _run(scenario) == [10, 20, 30, 40, 50]
    assert calls == [[1, 3, 4], [2], [5]]  # at most 3 rows; the oldest request's key first


def test_a_request_whose_client_left_is_not_computed():
    calls = []

    async def scenario():
        batcher = MicroBatcher(lambda ps, _: calls.append(list(ps)) or ps, max_rows=8, max_wait=0.2)
        batcher.start()
        kept = asyncio.ensure_future(batcher.submit("k", 1, 1))
        left = asyncio.ensure_future(batcher.submit("k", 2, 1))
        await asyncio.sleep(0.05)
        left.cancel()
        result = await kept
        await batcher.stop()
        return result

    assert _run(scenario) == 1
    assert calls == [[1]]


def _parts_of_10_ms(count: int):
    """``(run_batch, parts, started)``: a call of ``count`` 10-ms parts that checks
    ``abandoned()`` before each, appending each finished part to ``parts``."""
    parts, started = [], threading.Event()

    def run_batch(payloads, abandoned):
        started.set()
        for part in range(count):
            if abandoned():
                raise Abandoned("every client left")
            parts.append(part)
            time.sleep(0.01)
        return payloads

    return run_batch, parts, started


def test_a_running_call_learns_that_every_client_left_and_a_shared_one_does_not():
    """``abandoned()`` turns true only when the last client of the running batch leaves; the
    call then stops between its parts and the worker is free for the next request."""
    run_batch, parts, started = _parts_of_10_ms(200)

    async def scenario():
        batcher = MicroBatcher(run_batch, max_rows=8, max_wait=0.05)
        batcher.start()
        first = asyncio.ensure_future(batcher.submit("k", 1, 1))
        second = asyncio.ensure_future(batcher.submit("k", 2, 1))
        await asyncio.get_running_loop().run_in_executor(None, started.wait)
        first.cancel()
        at_first_cancel = len(parts)
        await asyncio.sleep(0.1)
        after_first = len(parts)  # one client is still there: the call goes on
        second.cancel()
        await asyncio.sleep(0.1)
        stopped_at = len(parts)
        await asyncio.sleep(0.1)
        assert len(parts) == stopped_at  # the call stopped
        parts.clear()
        await asyncio.wait_for(batcher.submit("j", 3, 1), timeout=10)  # the worker is free
        await batcher.stop()
        return at_first_cancel, after_first, stopped_at

    at_first_cancel, after_first, stopped_at = _run(scenario)
    assert at_first_cancel < after_first <= stopped_at < 100
    assert len(parts) == 200  # the next request ran whole


def test_stopping_ends_a_running_call_whose_clients_were_cancelled_by_the_shutdown():
    """uvicorn cancels the requests that outlive its drain, then the lifespan calls ``stop``
    before the cancelled waits run again: the call must stop at its next check, not hold the
    process until its last part."""
    run_batch, parts, started = _parts_of_10_ms(1000)

    async def scenario():
        batcher = MicroBatcher(run_batch, max_rows=8, max_wait=0.0)
        batcher.start()
        answer = asyncio.ensure_future(batcher.submit("k", 1, 1))
        await asyncio.get_running_loop().run_in_executor(None, started.wait)
        answer.cancel()  # no await: stop runs before the cancelled wait does
        await batcher.stop()

    _run(scenario)
    assert len(parts) < 100


def test_a_failing_merged_call_is_retried_one_request_at_a_time():
    def run_batch(payloads, abandoned):
        if "bad" in payloads:
            raise ValueError("bad input")
        return payloads

    async def scenario():
        batcher = MicroBatcher(run_batch, max_rows=8, max_wait=0.05)
        batcher.start()
        results = await asyncio.gather(
            *(batcher.submit("k", p, 1) for p in ("ok", "bad", "fine")), return_exceptions=True
        )
        await batcher.stop()
        return results

    ok, bad, fine = _run(scenario)
    assert (ok, fine) == ("ok", "fine")
    assert isinstance(bad, ValueError) and str(bad) == "bad input"


def test_a_request_whose_client_left_does_not_hold_its_window_open():
    """Stopping waits for the queue; a cancelled request in a long window must not hold it."""

    async def scenario():
        batcher = MicroBatcher(lambda ps, _: ps, max_rows=8, max_wait=30.0)
        batcher.start()
        await asyncio.wait_for(batcher.submit("j", 0, 1), timeout=5)  # lone: runs at once
        left = asyncio.ensure_future(batcher.submit("k", 1, 1))  # close behind: a window
        await asyncio.sleep(0.05)
        left.cancel()
        await asyncio.wait_for(batcher.stop(), timeout=5)

    _run(scenario)


def test_a_lone_request_runs_at_once_and_a_close_follower_waits_for_company():
    """No wait for a single client; a request close behind another opens the window (here
    30 s, ended by the second request filling ``max_rows``)."""
    calls = []

    async def scenario():
        batcher = MicroBatcher(
            lambda ps, _: calls.append(list(ps)) or ps, max_rows=2, max_wait=30.0
        )
        batcher.start()
        assert await asyncio.wait_for(batcher.submit("k", 1, 1), timeout=5) == 1
        second = asyncio.ensure_future(batcher.submit("k", 2, 1))
        await asyncio.sleep(0.05)
        assert calls == [[1]]  # the second waits in its window
        third = asyncio.ensure_future(batcher.submit("k", 3, 1))
        results = await asyncio.wait_for(asyncio.gather(second, third), timeout=5)
        await batcher.stop()
        return results

    assert _run(scenario) == [2, 3]
    assert calls == [[1], [2, 3]]


def test_a_request_that_waited_through_a_pass_runs_as_soon_as_the_worker_is_free():
    """Its window (0.5 s from arrival) closed during the 1-s pass: it does not wait another
    window for company when the worker frees (a later request is not merged into it)."""
    calls = []

    def run_batch(payloads, abandoned):
        calls.append(list(payloads))
        if payloads == [1]:
            time.sleep(1.0)
        return payloads

    async def scenario():
        batcher = MicroBatcher(run_batch, max_rows=8, max_wait=0.5)
        batcher.start()
        first = asyncio.ensure_future(batcher.submit("k", 1, 1))  # lone: runs at once
        await asyncio.sleep(0.1)
        second = asyncio.ensure_future(batcher.submit("k", 2, 1))
        await asyncio.sleep(1.1)  # the pass ended at about 1.0 s
        third = asyncio.ensure_future(batcher.submit("k", 3, 1))
        results = await asyncio.wait_for(asyncio.gather(first, second, third), timeout=10)
        await batcher.stop()
        return results

    assert _run(scenario) == [1, 2, 3]
    assert calls == [[1], [2], [3]]
