"""Double-entry credit: accounts, operator-signed grants, the amount each receipt moved, and the
per-call limits of a model (experts per token, tokens per call).

Every receipt and chain link stays as it was. Receipts appended before this revision moved no
credit (``amount`` 0): the old ledger minted their credit from nothing, which is what this
revision ends; an operator who wants to honour earlier earnings grants them explicitly.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("ledger_entries") as batch:
        batch.add_column(sa.Column("amount", sa.BigInteger(), nullable=False, server_default="0"))
    with op.batch_alter_table("ledger_models") as batch:
        batch.add_column(sa.Column("top_k", sa.BigInteger(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("max_tokens", sa.BigInteger(), nullable=False, server_default="0"))
    op.create_table(
        "ledger_accounts",
        sa.Column("peer", sa.LargeBinary(38), primary_key=True),
        sa.Column("balance", sa.BigInteger(), nullable=False),
        sa.Column("updated_ms", sa.BigInteger(), nullable=False),
    )
    op.create_table(
        "ledger_grants",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("peer", sa.LargeBinary(38), nullable=False),
        sa.Column("amount", sa.BigInteger(), nullable=False),
        sa.Column("record", sa.LargeBinary(), nullable=False),
        sa.Column("sig", sa.LargeBinary(64), nullable=False),
        sa.Column("created_ms", sa.BigInteger(), nullable=False),
    )
    op.create_index("ix_ledger_grants_peer", "ledger_grants", ["peer"])


def downgrade() -> None:
    op.drop_index("ix_ledger_grants_peer", "ledger_grants")
    op.drop_table("ledger_grants")
    op.drop_table("ledger_accounts")
    with op.batch_alter_table("ledger_models") as batch:
        batch.drop_column("max_tokens")
        batch.drop_column("top_k")
    with op.batch_alter_table("ledger_entries") as batch:
        batch.drop_column("amount")
