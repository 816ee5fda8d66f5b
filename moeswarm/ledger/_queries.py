"""Read-only queries for the CLI and the service: receipts with filters, and the ledger key file."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import or_, select

from moeswarm._keys import load_key_file
from moeswarm.protocol import BatchedReceipt, CountersignedReceipt, Identity, decode, peer_id_to_str

from ._store import ENTRIES, Ledger


@dataclass(frozen=True)
class ReceiptRow:
    """One stored receipt, as listed by ``moeswarm-ledger receipts``."""

    position: int
    receipt_id: bytes
    epoch: int
    received_ms: int
    client: bytes
    server: bytes
    model_id: str
    layer: int
    experts: tuple[int, ...]
    tokens: int
    pairs: int
    expert_flops: int
    time_ms: int
    seq: int

    def to_json(self) -> dict[str, Any]:
        return {"position": self.position, "receipt_id": self.receipt_id.hex(), "epoch": self.epoch,
                "received_ms": self.received_ms, "client": peer_id_to_str(self.client),
                "server": peer_id_to_str(self.server), "model_id": self.model_id, "layer": self.layer,
                "experts": list(self.experts), "tokens": self.tokens, "pairs": self.pairs,
                "expert_flops": self.expert_flops, "time_ms": self.time_ms, "seq": self.seq}


def list_receipts(ledger: Ledger, *, peer: bytes | None = None, model: str | None = None,
                  layer: int | None = None, since_ms: int | None = None, until_ms: int | None = None,
                  limit: int | None = None) -> list[ReceiptRow]:
    """Receipts in chain order. ``peer`` matches the client or the server; times are the
    receipt's own ``time_ms`` (the server's clock), ``since`` inclusive, ``until`` exclusive."""
    c = ENTRIES.c
    query = select(ENTRIES).order_by(c.position)
    if peer is not None:
        query = query.where(or_(c.client == peer, c.server == peer))
    if model is not None:
        query = query.where(c.model_id == model)
    if layer is not None:
        query = query.where(c.layer == layer)
    if since_ms is not None:
        query = query.where(c.time_ms >= since_ms)
    if until_ms is not None:
        query = query.where(c.time_ms < until_ms)
    if limit is not None:
        query = query.limit(limit)
    with ledger.read() as conn:
        rows = conn.execute(query).all()
    out = []
    for r in rows:
        cr = decode(r.record)
        experts = cr.receipt.experts if isinstance(cr, (CountersignedReceipt, BatchedReceipt)) else ()
        out.append(ReceiptRow(r.position, r.receipt_id, r.epoch, r.received_ms, r.client, r.server, r.model_id,
                              r.layer, experts, r.tokens, r.pairs, r.expert_flops, r.time_ms, r.seq))
    return out


def default_key_path(db: str) -> Path:
    """Where the ledger key lives unless ``--key`` says: beside a SQLite file, else ./ledger.key."""
    if "://" not in db:
        return Path(db).expanduser().with_name(Path(db).name + ".key")
    return Path("ledger.key")


def load_key(path: str | os.PathLike[str], *, create: bool) -> Identity:
    """The ledger's Ed25519 key (a 32-byte seed file), created with mode 0600 if ``create``."""
    return load_key_file(path, create=create, what="ledger key", missing_hint=" (give --key)")
