"""Databases: ``--db`` parsing, engines, write transactions, migrations, and error translation.

``--db`` is a file path (SQLite) or any SQLAlchemy URL; ``postgresql://`` and ``postgres://``
mean PostgreSQL through psycopg 3. SQLite runs in WAL mode with ``synchronous=FULL`` by default;
write transactions start with ``BEGIN IMMEDIATE`` (one writer at a time, across processes), reads
with a plain ``BEGIN``. On PostgreSQL the appenders serialise on the chain head's row lock.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

from alembic import command
from alembic.config import Config
from sqlalchemy import Connection, Engine, create_engine, event, inspect, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import (
    ArgumentError,
    DBAPIError,
    NoSuchModuleError,
    OperationalError,
    SQLAlchemyError,
)

from moeswarm.errors import ConfigError, Unreachable

from ._errors import DatabaseMissing
from ._models import VERSION_TABLE

MIGRATIONS: Final = Path(__file__).resolve().parent / "migrations"
_PG_MIGRATION_LOCK: Final = 0x6D6F_6573_6C65_6467  # pg_advisory_xact_lock key while migrating


def database_url(text_: str) -> URL:
    """A file path or a SQLAlchemy URL as a URL; ``ConfigError`` for what is neither."""
    if "://" not in text_:
        if not text_.strip():
            raise ConfigError("--db is empty: give a file path or a database URL")
        return URL.create("sqlite+pysqlite", database=str(Path(text_).expanduser().absolute()))
    try:
        url = make_url(text_)
    except (ArgumentError, ValueError):
        raise ConfigError(f"--db {text_!r} is neither a file path nor a database URL "
                          "(e.g. ledger.db or postgresql://user@host/dbname)") from None
    if url.drivername in ("postgresql", "postgres"):
        url = url.set(drivername="postgresql+psycopg")
    if url.get_backend_name() == "sqlite" and url.database in (None, "", ":memory:"):
        raise ConfigError("an in-memory SQLite database would lose the ledger: give a file path")
    return url


def describe(url: URL) -> str:
    """The URL for messages, password hidden."""
    return url.render_as_string(hide_password=True)


def _sqlite_engine(url: URL, synchronous: str, busy_timeout_s: float) -> Engine:
    engine = create_engine(url, connect_args={"timeout": busy_timeout_s, "check_same_thread": False})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # we issue BEGIN ourselves (below)
        cur = dbapi_connection.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute(f"PRAGMA synchronous={synchronous}")
        cur.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
        cur.execute("PRAGMA cache_size=-16384")  # 16 MiB page cache per connection (default: 2 MiB)
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get("ledger_write") else "BEGIN")

    return engine


def open_engine(url: URL, *, create: bool, sqlite_synchronous: str = "FULL", busy_timeout_s: float = 30.0) -> Engine:
    """An engine on ``url`` whose database exists (or may be created when ``create``)."""
    if sqlite_synchronous.upper() not in ("OFF", "NORMAL", "FULL", "EXTRA"):
        raise ConfigError(f"sqlite synchronous must be OFF, NORMAL, FULL or EXTRA, not {sqlite_synchronous!r}")
    if url.get_backend_name() == "sqlite":
        path = Path(str(url.database))
        if not path.exists():
            if not create:
                raise DatabaseMissing(f"no ledger database at {path} (`moeswarm-ledger serve --db {path}` "
                                      "creates one)")
            if not path.parent.is_dir():
                raise ConfigError(f"cannot create {path}: folder {path.parent} does not exist")
        engine = _sqlite_engine(url, sqlite_synchronous.upper(), busy_timeout_s)
    else:
        try:
            engine = create_engine(url, pool_pre_ping=True)
        except NoSuchModuleError:
            raise ConfigError(f"no SQLAlchemy driver for {url.drivername!r} (--db {describe(url)})") from None
        except (ArgumentError, ImportError) as e:
            raise ConfigError(f"cannot use --db {describe(url)}: {e}") from None
    try:
        with engine.connect() as conn:
            has_ledger = inspect(conn).has_table(VERSION_TABLE)
    except DBAPIError as e:
        engine.dispose()
        raise translate(e, url) from None
    if not has_ledger and not create:
        engine.dispose()
        raise DatabaseMissing(f"{describe(url)} holds no ledger (`moeswarm-ledger serve --db ...` creates one)")
    return engine


def translate(e: SQLAlchemyError, url: URL) -> Exception:
    """A SQLAlchemy error as one of ours: missing database, unreachable server, or misuse."""
    first = str(getattr(e, "orig", None) or e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if isinstance(e, OperationalError):
        if "does not exist" in first:
            return DatabaseMissing(f"{describe(url)}: {first}")
        return Unreachable(f"cannot use the database {describe(url)}: {first}")
    return ConfigError(f"database error on {describe(url)}: {first}")


@contextlib.contextmanager
def write_tx(engine: Engine) -> Iterator[Connection]:
    """A transaction that may write: ``BEGIN IMMEDIATE`` on SQLite; committed when the block ends."""
    with engine.connect() as conn:
        conn.execution_options(ledger_write=True)
        with conn.begin():
            yield conn


def migrate(engine: Engine) -> None:
    """Bring the schema to the newest revision (a no-op when it is there), under a lock."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    with write_tx(engine) as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_MIGRATION_LOCK})
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")
