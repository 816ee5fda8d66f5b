"""Synchronous code on the event loop's thread that can still wait for the loop: the forward pass
of a small step, run in a greenlet, so a MoE layer's dispatch costs no thread hop.

``await run_on_loop(fn, *args)`` runs ``fn`` in a greenlet on the loop's thread. Inside it,
``wait_on(awaitable)`` suspends ``fn`` (the greenlet switches back to ``run_on_loop``, which awaits
the awaitable on the loop: other tasks run meanwhile) and returns the awaitable's result (or
raises its exception) once it is done. Compute inside ``fn`` blocks the loop, so only small
steps belong here (decode: a few tokens); prefill chunks stay in a worker thread.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from greenlet import getcurrent, greenlet

T = TypeVar("T")


class _Wait:
    __slots__ = ("awaitable",)

    def __init__(self, awaitable: Awaitable[Any]) -> None:
        self.awaitable = awaitable


class _LoopGreenlet(greenlet):  # type: ignore[misc]
    """A greenlet that ``run_on_loop`` drives: its ``wait_on`` calls are awaited on the loop."""


def on_loop_greenlet() -> bool:
    """Whether the caller runs inside ``run_on_loop`` (so it may ``wait_on``)."""
    return isinstance(getcurrent(), _LoopGreenlet)


def wait_on(awaitable: Awaitable[T]) -> T:
    """From inside ``run_on_loop``: the awaitable's result, the loop running meanwhile."""
    current = getcurrent()
    if not isinstance(current, _LoopGreenlet):
        raise RuntimeError("wait_on is only for code run by run_on_loop")
    return current.parent.switch(_Wait(awaitable))  # type: ignore[no-any-return]


async def run_on_loop(fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn(*args)`` on this thread in a greenlet, awaiting on the loop whatever it ``wait_on``s."""
    g = _LoopGreenlet(fn)
    value = g.switch(*args)
    while isinstance(value, _Wait):
        try:
            result = await value.awaitable
        except BaseException as e:  # noqa: BLE001 - raised inside fn, where it waited
            value = g.throw(e)
        else:
            value = g.switch(result)
    return value  # type: ignore[no-any-return]
