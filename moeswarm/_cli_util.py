"""Shared pieces of the command lines."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable
from functools import wraps
from typing import Any, TypeVar

import click

from .errors import ConfigError, SwarmError

F = TypeVar("F", bound=Callable[..., Any])


def friendly_errors(fn: F) -> F:
    """Turn our own errors into one line on stderr and exit code 2 (no traceback)."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except SwarmError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)

    return wrapper  # type: ignore[return-value]


def http_limit_options(fn: F) -> F:
    """``--http-header-timeout``, ``--http-idle-timeout``, ``--http-max-conns-per-ip``: the bounds every
    HTTP service keeps per connection (``moeswarm.net.http_guard.HttpLimits``); read them with
    ``http_limits(kwargs)``."""
    options = [
        click.option("--http-header-timeout", default=20.0, show_default=True, metavar="SECONDS",
                     type=click.FloatRange(min=0, min_open=True),
                     help="HTTP: a request head must arrive within this (else 408 and closed)."),
        click.option("--http-idle-timeout", default=75.0, show_default=True, metavar="SECONDS",
                     type=click.FloatRange(min=0, min_open=True),
                     help="HTTP: close a connection idle this long between requests."),
        click.option("--http-max-conns-per-ip", default=64, show_default=True, type=click.IntRange(min=1),
                     help="HTTP: open connections per IPv4 address or IPv6 /64 (more get 429)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def http_limits(options: dict[str, Any]) -> Any:
    """The ``HttpLimits`` of ``http_limit_options`` (popped from ``options``)."""
    from .net.http_guard import HttpLimits

    return HttpLimits(header_timeout_s=options.pop("http_header_timeout"),
                      idle_timeout_s=options.pop("http_idle_timeout"),
                      max_conns_per_ip=options.pop("http_max_conns_per_ip"))


def spans(values: Iterable[int]) -> str:
    """Sorted integers as inclusive ranges a person reads: ``0-2, 5, 7-8``."""
    out: list[str] = []
    run: list[int] = []
    for v in sorted(set(values)):
        if run and v == run[-1] + 1:
            run.append(v)
            continue
        if run:
            out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [v]
    if run:
        out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ", ".join(out)


def echo_prompt(text: str) -> None:
    """The prompt on stdout, dimmed on a terminal (as is when piped), so the continuation stands out."""
    click.echo("the prompt (dimmed), then what the model writes:" if sys.stdout.isatty()
               else "the prompt, then what the model writes:", err=True)
    click.echo(click.style(text, dim=True), nl=False)
    sys.stdout.flush()


def stream(tokens: Iterable[int], feed: Callable[[int], str] | None) -> list[int]:
    """Print each token's text as it comes (``feed``: the tokenizer's stream; None: ids only), then
    tokens/s on stderr; the tokens."""
    out: list[int] = []
    start = time.perf_counter()
    first: float | None = None
    for token in tokens:
        if first is None:
            first = time.perf_counter() - start
        out.append(token)
        if feed is not None:
            click.echo(feed(token), nl=False)
            sys.stdout.flush()
    seconds = time.perf_counter() - start
    click.echo()
    if out:
        click.echo(f"{len(out)} tokens in {seconds:.2f} s: {len(out) / seconds:.1f} tokens/s "
                   f"(the first after {first:.2f} s)", err=True)
    return out


def served_summary(pairs: set[tuple[int, int]]) -> str:
    """``layer 0: experts 0-2, 5; layer 1: experts 3`` for the (layer, expert) pairs a peer served."""
    layers: dict[int, list[int]] = {}
    for layer, expert in sorted(pairs):
        layers.setdefault(layer, []).append(expert)
    return "; ".join(f"layer {L}: experts {spans(experts)}" for L, experts in layers.items())


def console() -> Any:
    """A rich Console for tables: a terminal's own width; piped, as wide as the lines are (rich
    would wrap them at 80 columns), unless COLUMNS says otherwise."""
    import os

    from rich.console import Console

    term = Console()
    if term.is_terminal or "COLUMNS" in os.environ:
        return term
    return Console(width=PIPED_WIDTH)


PIPED_WIDTH = 400  # columns of tables written to a pipe or file: wider than any row we print


def host_port(text: str, option: str = "--listen", default_host: str | None = None) -> tuple[str, int]:
    """A listening option's ``HOST:PORT`` -> (host without IPv6 brackets, port); ``:PORT`` means
    ``default_host`` where one is given.  ``ConfigError`` naming ``option`` otherwise."""
    host, _, port = text.rpartition(":")
    host = host.strip("[]") or (default_host or "")
    if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{option} takes HOST:PORT, not {text!r}")
    return host, int(port)

DEFAULT_MTP_DRAFT = 2  # draft tokens per step of `--draft mtp` when --speculative is not given
