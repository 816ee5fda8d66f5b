"""Stopping background tasks, and the one cancellation pitfall of Python 3.11's ``asyncio.wait_for``.

On 3.11 ``asyncio.wait_for`` swallows a cancellation that arrives in the same loop iteration
as the awaited result (CPython gh-86296, fixed in 3.12): it returns the result and the task
runs on as if nobody had cancelled it.  A probe loop whose ``ping`` is answered just as the
backbone shuts down then sleeps and probes forever, and the shutdown waits for it forever.
The project therefore bounds awaits with ``asyncio.timeout`` (which re-raises the caller's
cancellation), and ``cancel_and_wait`` cancels again if a task shrugged a cancellation off.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger(__name__)


async def cancel_and_wait(task: asyncio.Task[Any] | None, *, recancel_after_s: float = 5.0,
                          max_cancels: int = 6) -> None:
    """Cancel ``task`` and wait until it has finished.

    The usual ``task.cancel(); with suppress(CancelledError): await task`` also swallows a
    cancellation of the *caller* that arrives while it waits, and the caller then runs on: a
    loop that closes a client in an error path, and is itself being cancelled, never stops.
    Here the caller's cancellation propagates, the task's own is absorbed, and any other
    exception the task ended with propagates.

    A task still running ``recancel_after_s`` after a cancellation (its cleanup is done by
    then; it lost the cancellation to library code such as 3.11's ``wait_for``) is cancelled
    again, at most ``max_cancels`` times in all; then it is logged and left running rather
    than hanging whoever is shutting down."""
    if task is None:
        return
    ours: asyncio.CancelledError | None = None  # the caller's own cancellation, re-raised once the task is done
    for _ in range(max_cancels):
        if task.done():
            break
        task.cancel()
        try:
            await asyncio.wait({task}, timeout=recancel_after_s)  # never cancels the task itself
        except asyncio.CancelledError as e:
            ours = e  # still let the task finish its cleanup, as awaiting it would
    if not task.done():
        log.error("task %s ignored %d cancellations in %.0f s; leaving it running",
                  task.get_name(), max_cancels, max_cancels * recancel_after_s)
    elif not task.cancelled():
        error = task.exception()  # retrieved either way, so asyncio never logs it as lost
        if error is not None and ours is None:
            raise error
    if ours is not None:
        raise ours
