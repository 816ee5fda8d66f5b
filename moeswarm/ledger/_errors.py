"""The ledger's own exceptions, each a narrower case of the project's tree (``moeswarm.errors``)."""

from __future__ import annotations

from moeswarm.errors import ConfigError, SwarmError


class DatabaseMissing(ConfigError):
    """``--db`` names no ledger: the SQLite file or the PostgreSQL database does not exist."""


class LedgerCorrupt(SwarmError):
    """The stored chain fails verification (tampered or damaged storage); names the entry."""

    def __init__(self, message: str, *, position: int | None = None) -> None:
        self.position = position
        super().__init__(message)
