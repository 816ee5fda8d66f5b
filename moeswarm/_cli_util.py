"""Shared pieces of the command lines."""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar

import click

from .errors import SwarmError

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
