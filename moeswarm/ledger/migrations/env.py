"""Alembic environment of the ledger. ``moeswarm.ledger._db.migrate`` passes an open connection in
``config.attributes["connection"]`` (inside its own transaction and lock); the ``alembic`` command
line can also be used with ``-x url=...`` or ``sqlalchemy.url`` set."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection, create_engine

from moeswarm.ledger._models import VERSION_TABLE, Base

config = context.config
connection = config.attributes.get("connection")


def _run(conn: Connection) -> None:
    context.configure(connection=conn, target_metadata=Base.metadata, version_table=VERSION_TABLE,
                      render_as_batch=True, compare_type=True)
    with context.begin_transaction():
        context.run_migrations()


if connection is not None:
    _run(connection)
else:  # the alembic command line
    url = context.get_x_argument(as_dictionary=True).get("url") or config.get_main_option("sqlalchemy.url")
    if not url:
        raise SystemExit("give the database: alembic -x url=sqlite:///ledger.db ...")
    engine = create_engine(url)
    with engine.begin() as conn:
        _run(conn)
    engine.dispose()
