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
