"""Gateway charges under spending authorizations (issue 30): one row per authorization.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ledger_gateway_charges",
        sa.Column("authorization_id", sa.LargeBinary(32), primary_key=True),
        sa.Column("person", sa.LargeBinary(38), nullable=False),
        sa.Column("gateway", sa.LargeBinary(38), nullable=False),
        sa.Column("authorization", sa.LargeBinary(), nullable=False),
        sa.Column("usage", sa.LargeBinary(), nullable=False),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.Column("charged", sa.BigInteger(), nullable=False),
        sa.Column("updated_ms", sa.BigInteger(), nullable=False),
    )
    op.create_index("ix_ledger_gateway_charges_person", "ledger_gateway_charges", ["person"])


def downgrade() -> None:
    op.drop_index("ix_ledger_gateway_charges_person", "ledger_gateway_charges")
    op.drop_table("ledger_gateway_charges")
