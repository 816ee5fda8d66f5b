"""cancel_and_wait: stopping a background task must not swallow the caller's own cancellation
(a probe loop closing a dead client while being cancelled used to run on forever)."""

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
