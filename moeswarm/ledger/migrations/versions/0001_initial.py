"""The ledger's first schema: meta, head, entries (the hash chain), models, settlements, evidence.

Revision ID: 0001
Revises:
Create Date: 2026-11-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ledger_meta",
        sa.Column("key", sa.String(64), primary_key=True),
        sa.Column("value", sa.Text(), nullable=False),
    )
    op.create_table(
        "ledger_head",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("position", sa.BigInteger(), nullable=False),
        sa.Column("entry_hash", sa.LargeBinary(32), nullable=False),
        sa.Column("received_ms", sa.BigInteger(), nullable=False),
        sa.Column("sealed_ms", sa.BigInteger(), nullable=False),
        sa.Column("sig", sa.LargeBinary(64), nullable=False),
    )
    op.create_table(
        "ledger_entries",
        sa.Column("position", sa.BigInteger(), primary_key=True, autoincrement=False),
        sa.Column("entry_hash", sa.LargeBinary(32), nullable=False),
        sa.Column("prev_hash", sa.LargeBinary(32), nullable=False),
        sa.Column("received_ms", sa.BigInteger(), nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("record", sa.LargeBinary(), nullable=False),
        sa.Column("receipt_id", sa.LargeBinary(32), nullable=False),
        sa.Column("client", sa.LargeBinary(38), nullable=False),
        sa.Column("server", sa.LargeBinary(38), nullable=False),
        sa.Column("request_id", sa.LargeBinary(16), nullable=False),
        sa.Column("model_id", sa.String(128), nullable=False),
        sa.Column("layer", sa.BigInteger(), nullable=False),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.Column("pairs", sa.BigInteger(), nullable=False),
        sa.Column("expert_flops", sa.BigInteger(), nullable=False),
        sa.Column("time_ms", sa.BigInteger(), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.UniqueConstraint("receipt_id", name="uq_ledger_entries_receipt_id"),
        sa.UniqueConstraint("request_id", "client", name="uq_ledger_entries_request"),
        sa.UniqueConstraint("client", "server", "seq", name="uq_ledger_entries_pair_seq"),
    )
    op.create_index("ix_ledger_entries_epoch", "ledger_entries", ["epoch"])
    op.create_index("ix_ledger_entries_server", "ledger_entries", ["server"])
    op.create_index("ix_ledger_entries_time", "ledger_entries", ["time_ms"])
    op.create_index("ix_ledger_entries_model_layer", "ledger_entries", ["model_id", "layer"])
    op.create_table(
        "ledger_models",
        sa.Column("model_id", sa.String(128), primary_key=True),
        sa.Column("hidden", sa.BigInteger(), nullable=False),
        sa.Column("ffn", sa.BigInteger(), nullable=False),
        sa.Column("source", sa.String(16), nullable=False),
        sa.Column("registered_ms", sa.BigInteger(), nullable=False),
    )
    op.create_table(
        "ledger_settlements",
        sa.Column("epoch", sa.BigInteger(), primary_key=True, autoincrement=False),
        sa.Column("merkle_root", sa.LargeBinary(32), nullable=False),
        sa.Column("statement", sa.LargeBinary(), nullable=False),
        sa.Column("settled_ms", sa.BigInteger(), nullable=False),
    )
    op.create_table(
        "ledger_evidence",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("receipt_id", sa.LargeBinary(32), nullable=False),
        sa.Column("server", sa.LargeBinary(38), nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("record", sa.LargeBinary(), nullable=False),
        sa.Column("sample", sa.LargeBinary(), nullable=False),
        sa.Column("created_ms", sa.BigInteger(), nullable=False),
        sa.UniqueConstraint("receipt_id", name="uq_ledger_evidence_receipt_id"),
    )
    op.create_index("ix_ledger_evidence_server", "ledger_evidence", ["server"])
    op.create_index("ix_ledger_evidence_epoch", "ledger_evidence", ["epoch"])


def downgrade() -> None:
    for table in ("ledger_evidence", "ledger_settlements", "ledger_models", "ledger_entries", "ledger_head",
                  "ledger_meta"):
        op.drop_table(table)
