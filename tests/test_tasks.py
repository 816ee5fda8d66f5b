"""cancel_and_wait: stopping a background task must not swallow the caller's own cancellation
(a probe loop closing a dead client while being cancelled used to run on forever), and must
stop a task that lost a cancellation to library code (Python 3.11's ``asyncio.wait_for``)."""

from __future__ import annotations

import asyncio

import pytest

from moeswarm._tasks import cancel_and_wait


async def _slow_to_stop() -> None:
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        await asyncio.sleep(0.05)  # cleanup that takes a moment, as closing a TLS stream does
        raise


def test_the_callers_cancellation_is_not_swallowed() -> None:
    async def main() -> tuple[bool, bool]:
        background = asyncio.create_task(_slow_to_stop())
        await asyncio.sleep(0)

        async def closer() -> None:
            await cancel_and_wait(background)
            await asyncio.sleep(3600)  # with the old idiom the closer ran on to here, and stayed

        task = asyncio.create_task(closer())
        await asyncio.sleep(0.01)  # the closer now waits for the background task to stop
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=2)
        return task in done and task.cancelled(), background.cancelled()

    assert asyncio.run(main()) == (True, True)


def test_the_tasks_own_cancellation_is_absorbed_and_its_errors_propagate() -> None:
    async def fails() -> None:
        raise ValueError("boom")

    async def main() -> None:
        background = asyncio.create_task(_slow_to_stop())
        await asyncio.sleep(0)
        await cancel_and_wait(background)  # returns normally
        assert background.cancelled()
        await cancel_and_wait(None)
        failed = asyncio.create_task(fails())
        await asyncio.sleep(0)
        with pytest.raises(ValueError):
            await cancel_and_wait(failed)

    asyncio.run(main())


def test_a_task_that_lost_its_cancellation_is_cancelled_again() -> None:
    """The shape of the CI hang: a loop whose awaited answer and cancellation arrived together,
    so 3.11's ``wait_for`` returned the answer and the loop went on probing."""
    async def forgets_once() -> int:
        swallowed = 0
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed += 1  # what wait_for did on 3.11: returned, as if nobody had cancelled

    async def main() -> tuple[bool, float]:
        background = asyncio.create_task(forgets_once())
        await asyncio.sleep(0)
        t0 = asyncio.get_running_loop().time()
        await cancel_and_wait(background, recancel_after_s=0.05)
        return background.cancelled(), asyncio.get_running_loop().time() - t0

    cancelled, seconds = asyncio.run(main())
    assert cancelled and seconds < 5


def test_a_task_that_never_stops_is_left_after_a_bounded_wait(caplog: pytest.LogCaptureFixture) -> None:
    async def immortal() -> None:
        for _ in range(100):  # bounded (1 s), so the test's loop can end
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                pass

    async def main() -> bool:
        background = asyncio.create_task(immortal())
        await asyncio.sleep(0)
        await cancel_and_wait(background, recancel_after_s=0.02, max_cancels=3)
        running = not background.done()
        background.cancel()  # one more, for the test's own cleanup: the task ignores it too
        await asyncio.wait({background}, timeout=30)
        return running

    assert asyncio.run(main())
    assert "ignored 3 cancellations" in caplog.text
