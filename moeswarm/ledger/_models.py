"""The ledger's tables (SQLAlchemy 2 declarative). The schema itself is created and changed only by
the Alembic migrations in ``migrations/versions``; these classes must describe the same tables.

Every table name starts with ``ledger_`` so the ledger can share a database with other parts.
Peer IDs are the 38 raw bytes, hashes 32 bytes. Unsigned protocol counters are stored as BIGINT
(ingest refuses values above 2**63 - 1). Credit amounts are BIGINT too, and no stored amount can
overflow it: credit is conserved, so every balance, escrow and payment is at most the sum of all
grants, which ``Ledger.grant`` keeps at or below 2**63 - 1; sums are taken in Python ints.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

VERSION_TABLE = "ledger_alembic_version"


class Base(DeclarativeBase):
    metadata = MetaData()


class Meta(Base):
    """Facts fixed when the ledger is created: its public key, its epoch length."""

    __tablename__ = "ledger_meta"
    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(Text)


class Head(Base):
    """The one row (id 1) naming the chain's last entry, signed by the ledger; appenders lock it."""

    __tablename__ = "ledger_head"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    position: Mapped[int] = mapped_column(BigInteger)  # last entry's position, 0 when empty
    entry_hash: Mapped[bytes] = mapped_column(LargeBinary(32))  # its entry hash (GENESIS_HASH when empty)
    received_ms: Mapped[int] = mapped_column(BigInteger)  # its received_ms (received times never go back)
    sealed_ms: Mapped[int] = mapped_column(BigInteger)  # end of the last settled epoch: nothing lands before it
    sig: Mapped[bytes] = mapped_column(LargeBinary(64))  # ledger signature over (position, entry_hash)


class Entry(Base):
    """One chain entry: a countersigned receipt. ``record`` is authoritative; the other receipt
    columns are copies for queries, which ``verify`` checks against it."""

    __tablename__ = "ledger_entries"
    position: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)  # 1, 2, ...
    entry_hash: Mapped[bytes] = mapped_column(LargeBinary(32))
    prev_hash: Mapped[bytes] = mapped_column(LargeBinary(32))
    received_ms: Mapped[int] = mapped_column(BigInteger)  # ledger's clock when appended
    epoch: Mapped[int] = mapped_column(BigInteger)  # received_ms // epoch_ms
    record: Mapped[bytes] = mapped_column(LargeBinary)  # canonical countersigned_receipt
    receipt_id: Mapped[bytes] = mapped_column(LargeBinary(32))
    client: Mapped[bytes] = mapped_column(LargeBinary(38))
    server: Mapped[bytes] = mapped_column(LargeBinary(38))
    request_id: Mapped[bytes] = mapped_column(LargeBinary(16))
    model_id: Mapped[str] = mapped_column(String(128))
    layer: Mapped[int] = mapped_column(BigInteger)
    tokens: Mapped[int] = mapped_column(BigInteger)
    pairs: Mapped[int] = mapped_column(BigInteger)
    expert_flops: Mapped[int] = mapped_column(BigInteger)
    time_ms: Mapped[int] = mapped_column(BigInteger)  # server's clock, from the receipt
    seq: Mapped[int] = mapped_column(BigInteger)
    amount: Mapped[int] = mapped_column(BigInteger, server_default="0")  # credits the client paid (escrowed
    # for the server until its epoch settles); 0 for receipts appended before double-entry (revision 0002)

    __table_args__ = (
        UniqueConstraint("receipt_id", name="uq_ledger_entries_receipt_id"),
        UniqueConstraint("request_id", "client", name="uq_ledger_entries_request"),  # also the request id index
        UniqueConstraint("client", "server", "seq", name="uq_ledger_entries_pair_seq"),
        Index("ix_ledger_entries_epoch", "epoch"),
        Index("ix_ledger_entries_server", "server"),
        Index("ix_ledger_entries_time", "time_ms"),
        Index("ix_ledger_entries_model_layer", "model_id", "layer"),
    )


class Model(Base):
    """Expert shapes for the FLOPs bound, per model id."""

    __tablename__ = "ledger_models"
    model_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    hidden: Mapped[int] = mapped_column(BigInteger)
    ffn: Mapped[int] = mapped_column(BigInteger)
    top_k: Mapped[int] = mapped_column(BigInteger, server_default="0")  # experts per token; 0 = unknown
    max_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")  # tokens per call; 0 = by frame size
    source: Mapped[str] = mapped_column(String(16))  # "operator"; "serve"/"client" in ledgers before 0002
    registered_ms: Mapped[int] = mapped_column(BigInteger)


class Settlement(Base):
    """A signed settlement statement per epoch; an epoch is settled at most once."""

    __tablename__ = "ledger_settlements"
    epoch: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    merkle_root: Mapped[bytes] = mapped_column(LargeBinary(32))
    statement: Mapped[bytes] = mapped_column(LargeBinary)  # Statement.encode()
    settled_ms: Mapped[int] = mapped_column(BigInteger)


class Evidence(Base):
    """A failed audit, signed by the ledger; its server's receipts of that epoch are withheld."""

    __tablename__ = "ledger_evidence"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    receipt_id: Mapped[bytes] = mapped_column(LargeBinary(32))
    server: Mapped[bytes] = mapped_column(LargeBinary(38))
    epoch: Mapped[int] = mapped_column(BigInteger)
    record: Mapped[bytes] = mapped_column(LargeBinary)  # Evidence.encode(): signed body
    sample: Mapped[bytes] = mapped_column(LargeBinary)  # the audited call (request, outputs, receipt)
    created_ms: Mapped[int] = mapped_column(BigInteger)

    __table_args__ = (
        UniqueConstraint("receipt_id", name="uq_ledger_evidence_receipt_id"),
        Index("ix_ledger_evidence_server", "server"),
        Index("ix_ledger_evidence_epoch", "epoch"),
    )


class Account(Base):
    """A peer's spendable credit: grants plus settled earnings minus what it paid for calls."""

    __tablename__ = "ledger_accounts"
    peer: Mapped[bytes] = mapped_column(LargeBinary(38), primary_key=True)
    balance: Mapped[int] = mapped_column(BigInteger)  # >= 0, credits
    updated_ms: Mapped[int] = mapped_column(BigInteger)


class Grant(Base):
    """Credit entering the ledger: signed by the ledger operator's key (the only way credit is made)."""

    __tablename__ = "ledger_grants"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    peer: Mapped[bytes] = mapped_column(LargeBinary(38))
    amount: Mapped[int] = mapped_column(BigInteger)  # > 0
    record: Mapped[bytes] = mapped_column(LargeBinary)  # canonical grant body (see _accounts.grant_body)
    sig: Mapped[bytes] = mapped_column(LargeBinary(64))  # the ledger key's signature, kind "ledger-grant"
    created_ms: Mapped[int] = mapped_column(BigInteger)

    __table_args__ = (Index("ix_ledger_grants_peer", "peer"),)


class GatewayCharge(Base):
    """What a gateway has charged under one spending authorization (``_authorizations.py``): the
    authorization and the latest usage acknowledgement, both signed by the person, are authoritative."""

    __tablename__ = "ledger_gateway_charges"
    authorization_id: Mapped[bytes] = mapped_column(LargeBinary(32), primary_key=True)
    person: Mapped[bytes] = mapped_column(LargeBinary(38))  # the account that pays
    gateway: Mapped[bytes] = mapped_column(LargeBinary(38))  # the account paid
    authorization: Mapped[bytes] = mapped_column(LargeBinary)  # SpendingAuthorization.encode()
    usage: Mapped[bytes] = mapped_column(LargeBinary)  # the latest UsageAck.encode()
    tokens: Mapped[int] = mapped_column(BigInteger)  # tokens it acknowledges
    charged: Mapped[int] = mapped_column(BigInteger)  # credits moved in all: tokens x price_per_token
    updated_ms: Mapped[int] = mapped_column(BigInteger)

    __table_args__ = (Index("ix_ledger_gateway_charges_person", "person"),)
