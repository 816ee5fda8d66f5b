"""A chat-template sandbox bounded in steps, time and size (issue 32).

Jinja's ``ImmutableSandboxedEnvironment`` stops a template from reaching Python's internals but
not from burning CPU or memory: ``range`` is capped at 100,000 items, so two nested ``range``
loops are 10^10 iterations, and ``'x' * 10**9`` builds a gigabyte. A chat template comes with a
model folder, i.e. from whoever published the model, and runs on every chat request.  Here a
render gets a budget (``TemplateBudget``): every loop iteration, call, attribute or item lookup
and intercepted operator is a step; the render stops with ``TemplateLimitError`` after
``MAX_STEPS`` steps, ``MAX_SECONDS`` of wall time or ``MAX_CHARS`` characters of output or of
any string or list an operator builds.  Loops are bounded by rewriting each ``{% for %}``'s
iterable into ``bounded_iter(iterable)`` after parsing (an imported name the template cannot
shadow).
"""

from __future__ import annotations

import contextvars
import operator
import time
from collections.abc import Iterable, Iterator
from typing import Any, Final

from jinja2 import nodes
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_STEPS: Final = 1_000_000
"""Loop iterations, calls, lookups and operators in one render (a 200-message chat takes ~10,000)."""
MAX_SECONDS: Final = 2.0
"""Wall time of one render."""
MAX_CHARS: Final = 4 << 20
"""Characters a render may output, and the longest string or list an operator may build."""


class TemplateLimitError(TemplateError):
    """The template went over its budget: the model folder's fault, not the request's."""


class TemplateBudget:
    def __init__(self) -> None:
        self.steps = 0
        self.deadline = time.monotonic() + MAX_SECONDS

    def step(self) -> None:
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise TemplateLimitError(f"the chat template took more than {MAX_STEPS:,} steps")
        if not self.steps & 255 and time.monotonic() > self.deadline:
            raise TemplateLimitError(f"the chat template ran for more than {MAX_SECONDS:g} s")


_BUDGET: contextvars.ContextVar[TemplateBudget | None] = contextvars.ContextVar("moeswarm_template_budget",
                                                                                default=None)


def _step() -> None:
    budget = _BUDGET.get()
    if budget is None:
        raise TemplateLimitError("a chat template renders only through render_bounded")
    budget.step()


def bounded_iter(iterable: Iterable[Any]) -> Iterator[Any]:
    """What every ``{% for %}`` loop iterates: one step per item."""
    for item in iterable:
        _step()
        yield item


def _sized(value: Any) -> Any:
    if isinstance(value, (str, bytes, list, tuple)) and len(value) > MAX_CHARS:
        raise TemplateLimitError(f"the chat template built a value of {len(value):,} items (at most {MAX_CHARS:,})")
    return value


def _times(left: Any, right: Any) -> Any:
    for seq, n in ((left, right), (right, left)):
        if isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_CHARS:
            raise TemplateLimitError(f"the chat template built a value of {len(seq) * n:,} items (at most {MAX_CHARS:,})")
    return operator.mul(left, right)


def _power(left: Any, right: Any) -> Any:
    if isinstance(right, int) and isinstance(left, int) and abs(left) > 1 and right > 64:
        raise TemplateLimitError("the chat template raised a number to a power above 64")
    return operator.pow(left, right)


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """``ImmutableSandboxedEnvironment`` whose renders are bounded by ``render_bounded``'s budget."""

    intercepted_binops = frozenset(["*", "**", "+"])

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = super()._parse(source, name, filename)
        for loop in list(tree.find_all(nodes.For)):
            loop.iter = nodes.Call(nodes.ImportedName(f"{__name__}.bounded_iter"), [loop.iter], [], None, None,
                                   lineno=loop.lineno)
        return tree

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja's names)
        _step()
        return _sized(super().call(__context, __obj, *args, **kwargs))

    def getattr(self, obj: Any, attribute: str) -> Any:
        _step()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _step()
        return super().getitem(obj, argument)

    def call_binop(self, context: Any, op: str, left: Any, right: Any) -> Any:
        _step()
        if op == "*":
            return _times(left, right)
        if op == "**":
            return _power(left, right)
        return _sized(super().call_binop(context, op, left, right))


def render_bounded(template: Any, **variables: Any) -> str:
    """Render a ``BoundedSandbox`` template within a fresh budget (``TemplateLimitError`` past it)."""
    token = _BUDGET.set(TemplateBudget())
    try:
        out: list[str] = []
        size = 0
        for piece in template.generate(**variables):
            size += len(piece)
            if size > MAX_CHARS:
                raise TemplateLimitError(f"the chat template wrote more than {MAX_CHARS:,} characters")
            out.append(piece)
            _step()
        return "".join(out)
    finally:
        _BUDGET.reset(token)
