"""Fixtures of the ledger tests: every ``db`` test runs on SQLite and on a real PostgreSQL server.

PostgreSQL comes from ``MOESWARM_TEST_PG_URL`` when set (``eval "$(bash scripts/test-setup.sh)"``);
otherwise the session starts a private cluster with ``scripts/test-setup.sh`` in a temporary folder
and stops it at the end. Without PostgreSQL the PostgreSQL half fails, saying why: it is never
skipped (issue 16: a skipped half proved nothing). Each test gets its own schema (``search_path``), dropped afterwards.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
from ledger_support import MODEL, SHAPE, Clock
from sqlalchemy import create_engine, text

from moeswarm.ledger import Ledger, StoreConfig
from moeswarm.protocol import Identity

ROOT = Path(__file__).resolve().parents[2]
SETUP = ROOT / "scripts" / "test-setup.sh"


def _unavailable(reason: str) -> None:
    pytest.fail(f"PostgreSQL is required (scripts/test-setup.sh installs and starts it as root): {reason}")


@pytest.fixture(scope="session")
def pg_server() -> Iterator[str | None]:
    """The base URL of a PostgreSQL test database, or None when there is none."""
    url = os.environ.get("MOESWARM_TEST_PG_URL")
    if url:
        yield url
        return
    folder = Path(tempfile.mkdtemp(prefix="moeswarm-test-pg-"))  # not pytest's tmp: postgres must reach it
    folder.chmod(0o755)
    env = {**os.environ, "MOESWARM_PG_DIR": str(folder), "MOESWARM_PG_STOP_MODE": "immediate",
           "MOESWARM_PG_PORT": str(40000 + os.getpid() % 20000)}
    try:
        out = subprocess.run(["bash", str(SETUP)], env=env, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        yield f"!{e}"
        return
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("export MOESWARM_TEST_PG_URL=")), None)
    if out.returncode != 0 or line is None:
        yield f"!scripts/test-setup.sh failed: {out.stderr.strip()[-500:]}"
        return
    try:
        yield line.split("=", 1)[1].strip("'")
    finally:
        subprocess.run(["bash", str(SETUP), "stop"], env=env, capture_output=True, timeout=120)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def pg_url(pg_server: str | None) -> Iterator[str]:
    """A fresh schema in the PostgreSQL test database, as a URL whose search_path points at it."""
    with pg_schema(pg_server) as url:
        yield url


@contextlib.contextmanager
def pg_schema(pg_server: str | None) -> Iterator[str]:
    if pg_server is None or pg_server.startswith("!"):
        _unavailable((pg_server or "!")[1:])
    assert pg_server is not None
    schema = "t_" + uuid.uuid4().hex[:12]
    engine = create_engine(pg_server.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        with engine.begin() as conn:
            conn.execute(text(f"CREATE SCHEMA {schema}"))
    except Exception as e:  # noqa: BLE001 - any failure to reach the server
        engine.dispose()
        _unavailable(str(e).splitlines()[0])
    sep = "&" if "?" in pg_server else "?"
    try:
        yield f"{pg_server}{sep}options={quote(f'-csearch_path={schema}')}"
    finally:
        with engine.begin() as conn:
            conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))
        engine.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def new_db(backend: str, tmp_path: Path, pg_server: str | None) -> Iterator[Callable[[], str]]:
    """Makes databases that hold no ledger yet, on this test's backend (SQLite files or PG schemas)."""
    with contextlib.ExitStack() as stack:
        names = itertools.count()

        def make() -> str:
            if backend == "sqlite":
                return str(tmp_path / f"ledger{next(names)}.db")
            return stack.enter_context(pg_schema(pg_server))

        yield make


@pytest.fixture
def db_url(new_db: Callable[[], str]) -> str:
    """A database that holds no ledger yet: a SQLite file path, or a PostgreSQL URL."""
    return new_db()


@pytest.fixture
def ledger_key() -> Identity:
    return Identity.from_seed(bytes(range(32)))


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def ledger(db_url: str, ledger_key: Identity, clock: Clock) -> Iterator[Ledger]:
    """A new ledger on each backend, with the test model registered and a settable clock."""
    with Ledger(StoreConfig(db_url, create=True), ledger_key, clock=clock) as led:
        led.register_model(MODEL, SHAPE)
        yield led
