"""Alembic migrations of the ledger schema, run by ``moeswarm.ledger`` whenever it opens a database."""
