"""Stopping background tasks without swallowing the caller's own cancellation."""

from __future__ import annotations

import asyncio
from typing import Any


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` and wait until it has finished.

    The usual ``task.cancel(); with suppress(CancelledError): await task`` also swallows a
    cancellation of the *caller* that arrives while it waits, and the caller then runs on: a
    loop that closes a client in an error path, and is itself being cancelled, never stops.
    Here the task's own ``CancelledError`` is absorbed, the caller's is re-raised; any other
    exception the task ended with propagates."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise
