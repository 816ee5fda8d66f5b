"""The ledger store: an append-only, hash-chained log of countersigned receipts in SQL.

``Ledger`` opens (and migrates) the database, appends batches atomically, and answers queries;
settlement, proofs, audits and verification build on it in their own modules. Appends are
serialised: a process-wide lock plus the chain head's row lock (``SELECT ... FOR UPDATE`` on
PostgreSQL; ``BEGIN IMMEDIATE`` on SQLite). ``ingest`` returns only after its transaction has
committed, so every result it reports as accepted or duplicate is durable.

Appending a receipt also moves credit: its client pays ``ledger.price(receipt)`` (its FLOPs at
``ledger.pricing``, at least ``min_receipt_credits``) into escrow, in the same transaction, or the receipt is refused (``insufficient_funds``); see
``_accounts`` for the double-entry rules.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Final, cast

from sqlalchemy import Connection, Row, Table, func, insert, select, tuple_, update
from sqlalchemy.exc import SQLAlchemyError

from moeswarm.errors import ConfigError
from moeswarm.protocol import (
    BatchedReceipt,
    CountersignedReceipt,
    Identity,
    Receipt,
    canonical,
    peer_id_to_str,
    public_key_from_peer_id,
    verify,
)

from ._accounts import (
    GRANT_KIND,
    GrantRecord,
    Standing,
    apply_deltas,
    balances_of,
    check_grant_amount,
    count_grants,
    grant_body,
    standing_of,
    top_payers,
    total_granted,
)
from ._chain import (
    GENESIS_HASH,
    MAX_STORED_INT,
    ModelShape,
    Prepared,
    Reason,
    Refused,
    entry_hash,
    prepare,
)
from ._db import database_url, describe, migrate, open_engine, translate, write_tx
from ._ingest import IngestResult, Known, plan_batch
from ._models import Entry, Grant, Head, Meta, Model
from ._settle import FlatPrice, Pricing, credits

HEAD_KIND: Final = "ledger-head"
_CHUNK: Final = 500  # keys per IN (...) lookup
ENTRIES = cast(Table, Entry.__table__)
FLAT: Final = FlatPrice()  # one credit per expert-FLOP, until the market supplies prices
HEAD = cast(Table, Head.__table__)


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(frozen=True)
class StoreConfig:
    """Where the ledger lives and the rules it appends by."""

    db: str  # a file path (SQLite) or any SQLAlchemy URL (postgresql://user@host/db)
    create: bool = False  # create and migrate a missing database (else DatabaseMissing)
    epoch_s: int = 3600  # settlement epoch length, seconds; fixed when the ledger is created
    seq_window: int = 4096  # a receipt's seq may trail its (client, server) pair's highest by this much
    sqlite_synchronous: str = "FULL"  # SQLite durability: FULL survives power loss, NORMAL a process crash
    busy_timeout_s: float = 30.0  # SQLite: how long a writer waits for another process's transaction
    max_batch: int = 10_000  # receipts per ingest call
    verify_threads: int = 2  # threads checking signatures of one batch (Ed25519 releases the GIL)
    min_receipt_credits: int = 1  # the least a receipt costs its client, whatever its FLOPs and price


@dataclass(frozen=True)
class HeadInfo:
    position: int  # entries in the chain
    entry_hash: bytes
    received_ms: int
    sealed_ms: int  # end of the last settled epoch
    sig: bytes


def head_payload(ledger: bytes, position: int, entry_hash_: bytes) -> bytes:
    """What the ledger signs for its head: canonical {entry_hash, ledger, position}."""
    return canonical({"entry_hash": entry_hash_, "ledger": ledger, "position": position})


class Ledger:
    """An open ledger database. ``identity`` (the ledger's key) is needed to append and sign."""

    def __init__(self, config: StoreConfig, identity: Identity | None = None,
                 clock: Callable[[], int] = now_ms, pricing: Pricing = FLAT) -> None:
        if config.epoch_s < 1:
            raise ConfigError("epoch_s must be at least one second")
        if config.verify_threads < 1:
            raise ConfigError("verify_threads must be at least 1")
        if config.min_receipt_credits < 1:
            raise ConfigError("min_receipt_credits must be at least 1: a receipt that costs nothing is free to flood")
        self.config = config
        self.identity = identity
        self.clock = clock  # unix milliseconds
        self.pricing = pricing  # what a receipt's client pays its server, fixed when the receipt is appended
        self.url = database_url(config.db)
        self.engine = open_engine(self.url, create=config.create, sqlite_synchronous=config.sqlite_synchronous,
                                  busy_timeout_s=config.busy_timeout_s)
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None  # for verify_threads > 1, made on first use
        try:
            migrate(self.engine)
            self._init_meta()
            self._shapes = self.models()
        except SQLAlchemyError as e:
            self.engine.dispose()
            raise translate(e, self.url) from None
        except BaseException:
            self.engine.dispose()
            raise

    # ------------------------------------------------------------------ lifecycle and meta

    def _init_meta(self) -> None:
        with write_tx(self.engine) as conn:
            meta = {r.key: r.value for r in conn.execute(select(Meta.key, Meta.value))}
            if "ledger_peer_id" not in meta:
                if self.identity is None:
                    raise ConfigError("creating a ledger needs its key (--key)")
                meta = {"ledger_peer_id": self.identity.peer_id.hex(), "epoch_ms": str(self.config.epoch_s * 1000),
                        "created_ms": str(self.clock()), "format": "1"}
                conn.execute(insert(Meta), [{"key": k, "value": v} for k, v in meta.items()])
                conn.execute(insert(HEAD).values(id=1, position=0, entry_hash=GENESIS_HASH, received_ms=0,
                                                 sealed_ms=0, sig=self._sign_head(0, GENESIS_HASH)))
        self.ledger_peer_id = bytes.fromhex(meta["ledger_peer_id"])
        self.epoch_ms = int(meta["epoch_ms"])
        if self.identity is not None and self.identity.peer_id != self.ledger_peer_id:
            raise ConfigError(f"this ledger belongs to key {peer_id_to_str(self.ledger_peer_id)}, "
                              f"not {self.identity.peer_id_str} (--key)")

    def _sign_head(self, position: int, h: bytes) -> bytes:
        if self.identity is None:
            raise ConfigError("appending needs the ledger's key (--key)")
        return self.identity.sign(HEAD_KIND, head_payload(self.identity.peer_id, position, h))

    def head_verifies(self, head: HeadInfo, ledger: bytes | None = None) -> bool:
        ledger = ledger or self.ledger_peer_id
        return verify(public_key_from_peer_id(ledger), HEAD_KIND, head_payload(ledger, head.position,
                                                                                 head.entry_hash), head.sig)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        self.engine.dispose()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Ledger({describe(self.url)})"

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    @contextmanager
    def read(self) -> Iterator[Connection]:
        """A read transaction on one consistent snapshot, SQLAlchemy errors translated."""
        try:
            with self.engine.connect() as conn:
                if self.dialect == "postgresql":  # one snapshot for the whole transaction
                    conn.execution_options(isolation_level="REPEATABLE READ")
                with conn.begin():
                    yield conn
        except SQLAlchemyError as e:
            raise translate(e, self.url) from None

    @contextmanager
    def write(self) -> Iterator[Connection]:
        """A write transaction holding the chain head's lock; committed when the block ends."""
        try:
            with self._lock, write_tx(self.engine) as conn:
                yield conn
        except SQLAlchemyError as e:
            raise translate(e, self.url) from None

    def head_in(self, conn: Connection, *, lock: bool = False) -> HeadInfo:
        """The chain head as ``conn`` sees it; ``lock`` takes its row lock (appenders do)."""
        query = select(HEAD).where(HEAD.c.id == 1)
        row = conn.execute(query.with_for_update() if lock else query).one()
        return HeadInfo(row.position, row.entry_hash, row.received_ms, row.sealed_ms, row.sig)

    def head(self) -> HeadInfo:
        with self.read() as conn:
            return self.head_in(conn)

    def epoch_of(self, ms: int) -> int:
        return ms // self.epoch_ms

    # ------------------------------------------------------------------ models (FLOPs bound)

    def models(self) -> dict[str, ModelShape]:
        with self.read() as conn:
            rows = conn.execute(select(Model.model_id, Model.hidden, Model.ffn, Model.top_k, Model.max_tokens)).all()
        return {r.model_id: ModelShape(r.hidden, r.ffn, r.top_k, r.max_tokens) for r in rows}

    def register_model(self, model_id: str, shape: ModelShape, source: str = "operator") -> bool:
        """Record a model's expert shape and per-call limits (the operator does: ``models add``);
        True if new. A different shape for a known id is refused."""
        if shape.hidden < 1 or shape.ffn < 1 or shape.top_k < 0 or shape.max_tokens < 0:
            raise ConfigError(f"model {model_id!r}: hidden and ffn must be positive, top_k and max_tokens >= 0")
        if max(shape.hidden, shape.ffn, shape.top_k, shape.max_tokens) > MAX_STORED_INT:
            raise ConfigError(f"model {model_id!r}: a dimension is above 2**63 - 1")
        with self.write() as conn:
            held = conn.execute(select(Model.hidden, Model.ffn, Model.top_k, Model.max_tokens)
                                .where(Model.model_id == model_id)).first()
            if held is not None:
                old = ModelShape(held.hidden, held.ffn, held.top_k, held.max_tokens)
                if (old.hidden, old.ffn) != (shape.hidden, shape.ffn):
                    raise ConfigError(f"model {model_id!r} is registered as hidden {held.hidden}, ffn {held.ffn}; "
                                      f"refusing hidden {shape.hidden}, ffn {shape.ffn}")
                if old == shape:
                    return False
                # same FLOPs shape, new per-call limits (a ledger migrated from 0001 learns them)
                conn.execute(update(Model).where(Model.model_id == model_id)
                             .values(top_k=shape.top_k, max_tokens=shape.max_tokens))
                self._shapes[model_id] = shape
                return False
            conn.execute(insert(Model).values(model_id=model_id, hidden=shape.hidden, ffn=shape.ffn,
                                              top_k=shape.top_k, max_tokens=shape.max_tokens,
                                              source=source, registered_ms=self.clock()))
        self._shapes[model_id] = shape
        return True

    # ------------------------------------------------------------------ ingest

    def prepare(self, items: Sequence[bytes | CountersignedReceipt | BatchedReceipt]) -> list[Prepared | Refused]:
        """Decode and check signatures and FLOPs (CPU only, no database, no lock)."""
        shapes = self._shapes
        threads = min(self.config.verify_threads, len(items) // 64)
        if threads > 1:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.config.verify_threads, thread_name_prefix="ledger-verify")
            step = -(-len(items) // threads)
            parts = self._pool.map(lambda i: [prepare(x, shapes) for x in items[i : i + step]],
                                   range(0, len(items), step))
            out = [p for part in parts for p in part]
        else:
            out = [prepare(item, shapes) for item in items]
        if any(isinstance(p, Refused) and p.reason == Reason.UNKNOWN_MODEL for p in out):
            self._shapes = self.models()  # another process may have registered it
            out = [prepare(item, self._shapes) if isinstance(p, Refused) and p.reason == Reason.UNKNOWN_MODEL
                   else p for item, p in zip(items, out)]
        return out

    def ingest(self, items: Sequence[bytes | CountersignedReceipt | BatchedReceipt]) -> list[IngestResult]:
        """Append a batch in one transaction; one result per item, in order, after the commit."""
        if len(items) > self.config.max_batch:
            raise ConfigError(f"a batch holds at most {self.config.max_batch} receipts, not {len(items)}")
        return self.append_prepared(self.prepare(items))

    def price(self, receipt: Receipt) -> int:
        """What ``receipt`` costs its client: its FLOPs at ``pricing``, at least ``min_receipt_credits``."""
        return max(credits(receipt, self.pricing), self.config.min_receipt_credits)

    def append_prepared(self, prepared: Sequence[Prepared | Refused]) -> list[IngestResult]:
        candidates = [p for p in prepared if isinstance(p, Prepared)]
        cost = self.price

        if not candidates:
            return plan_batch(prepared, Known(), first_position=1, seq_window=self.config.seq_window,
                              funds={}, cost=cost)[1]
        with self.write() as conn:
            head = self.head_in(conn, lock=True)  # grants and settlements take it too: balances hold still
            known = self._known(conn, candidates)
            funds = balances_of(conn, (p.receipt.client for p in candidates))
            accepted, results = plan_batch(prepared, known, first_position=head.position + 1,
                                           seq_window=self.config.seq_window, funds=funds, cost=cost)
            if accepted:
                received = max(self.clock(), head.received_ms, head.sealed_ms)
                prev, rows, epoch = head.entry_hash, [], self.epoch_of(received)
                paid: dict[bytes, int] = {}
                for position, (p, amount) in enumerate(accepted, head.position + 1):
                    h = entry_hash(prev, position, received, p.record)
                    rows.append(_row(p, position, prev, h, received, epoch, amount))
                    prev = h
                    paid[p.receipt.client] = paid.get(p.receipt.client, 0) - amount
                conn.exec_driver_sql(_insert_sql(conn.dialect.paramstyle), rows)
                apply_deltas(conn, paid, received)  # into escrow until the epoch settles
                last = head.position + len(accepted)
                conn.execute(update(HEAD).where(HEAD.c.id == 1).values(
                    position=last, entry_hash=prev, received_ms=received, sig=self._sign_head(last, prev)))
        return results

    def _known(self, conn: Connection, items: Sequence[Prepared]) -> Known:
        """What the chain holds for these receipts' keys, in three index lookups: each pair's highest
        seq (one scalar subquery per pair), the request ids (driver SQL, the hot path), and the
        seqs of receipts at or below their pair's highest seq (rare: seqs increase)."""
        known = Known()
        c = ENTRIES.c
        pairs = list({(p.receipt.client, p.receipt.server) for p in items})
        for chunk in _chunks(pairs, 100):
            tops = conn.execute(select(*(select(func.max(c.seq)).where(c.client == client, c.server == server)
                                         .scalar_subquery() for client, server in chunk))).one()
            known.high.update((pair, top) for pair, top in zip(chunk, tops) if top is not None)
        wanted = {(p.receipt.client, p.receipt.request_id) for p in items}
        for chunk in _chunks(list({rid for _, rid in wanted})):
            if conn.dialect.name == "postgresql":  # one array parameter: no 512-item IN list to parse
                rows = conn.exec_driver_sql("SELECT client, request_id, receipt_id, position FROM ledger_entries "
                                            "WHERE request_id = ANY(%s)", (chunk,))
            else:
                marks = ", ".join(["?"] * len(chunk))
                rows = conn.exec_driver_sql("SELECT client, request_id, receipt_id, position FROM ledger_entries "
                                            f"WHERE request_id IN ({marks})", tuple(chunk))
            for client, rid, receipt_id_, position in rows:
                if (bytes(client), bytes(rid)) in wanted:
                    known.by_request[(bytes(client), bytes(rid))] = (bytes(receipt_id_), position)
        stale = list({(p.receipt.client, p.receipt.server, p.receipt.seq) for p in items
                      if p.receipt.seq <= known.high.get((p.receipt.client, p.receipt.server), -1)})
        for chunk in _chunks(stale):
            known.seqs.update((r.client, r.server, r.seq) for r in conn.execute(
                select(c.client, c.server, c.seq).where(tuple_(c.client, c.server, c.seq).in_(chunk))))
        return known

    # ------------------------------------------------------------------ accounts (double-entry)

    def grant(self, peer: bytes, amount: int) -> GrantRecord:
        """Credit ``amount`` to ``peer``: the only way credit enters the ledger, signed by its key."""
        if self.identity is None:
            raise ConfigError("a grant is signed by the ledger operator's key (--key)")
        public_key_from_peer_id(peer)  # a peer ID we could ever verify (ProtocolError otherwise)
        with self.write() as conn:
            self.head_in(conn, lock=True)
            check_grant_amount(amount, total_granted(conn))
            seq, now = count_grants(conn) + 1, self.clock()
            record = grant_body(self.ledger_peer_id, peer, amount, seq, now)
            sig = self.identity.sign(GRANT_KIND, record)
            conn.execute(insert(Grant).values(id=seq, peer=peer, amount=amount, record=record, sig=sig,
                                              created_ms=now))
            apply_deltas(conn, {peer: amount}, now)
        return GrantRecord(seq, peer, amount, now, record, sig)

    def balance(self, peer: bytes) -> int:
        """``peer``'s spendable credits (0 without an account)."""
        with self.read() as conn:
            return balances_of(conn, [peer]).get(peer, 0)

    def standing(self, peers: Sequence[bytes], since_ms: int = 0) -> dict[bytes, Standing]:
        """Balance and paid calls (appended at or after ``since_ms``) of each peer."""
        with self.read() as conn:
            return standing_of(conn, peers, since_ms)

    def top_payers(self, since_ms: int, limit: int) -> list[bytes]:
        """Clients that paid the most for calls appended since ``since_ms`` (most first)."""
        with self.read() as conn:
            return top_payers(conn, since_ms, limit)

    # ------------------------------------------------------------------ reads

    def find(self, receipt_id: str | bytes) -> Row[Any]:
        """The entry of a receipt id (bytes, or hex: the full id or an unambiguous prefix)."""
        if isinstance(receipt_id, bytes):
            lo = hi = receipt_id
        else:
            text = receipt_id.strip().lower()
            if len(text) < 8 or len(text) % 2 or any(ch not in "0123456789abcdef" for ch in text):
                raise ConfigError(f"{receipt_id!r} is not a receipt id (hex, at least 8 digits, even length)")
            prefix = bytes.fromhex(text)
            lo, hi = prefix + bytes(32 - len(prefix)), prefix + b"\xff" * (32 - len(prefix))
        with self.read() as conn:
            rows = conn.execute(select(ENTRIES).where(ENTRIES.c.receipt_id.between(lo, hi)).limit(2)).all()
        if not rows:
            raise ConfigError(f"no receipt {receipt_id if isinstance(receipt_id, str) else receipt_id.hex()} "
                              "in this ledger")
        if len(rows) > 1:
            raise ConfigError(f"receipt id prefix {receipt_id!r} is ambiguous; give more digits")
        return rows[0]

    def count(self) -> int:
        return self.head().position

    def epoch_rows(self, conn: Connection, epoch: int) -> list[Row[Any]]:
        """Every entry of one epoch, in chain order."""
        return list(conn.execute(select(ENTRIES).where(ENTRIES.c.epoch == epoch).order_by(ENTRIES.c.position)))


_COLUMNS: Final = ("position", "prev_hash", "entry_hash", "received_ms", "epoch", "record", "receipt_id", "client",
                   "server", "request_id", "model_id", "layer", "tokens", "pairs", "expert_flops", "time_ms", "seq",
                   "amount")


def _insert_sql(paramstyle: str) -> str:
    """The entries INSERT as driver SQL: executemany without SQLAlchemy's per-value processing
    (bytes, ints and str need none on sqlite3 or psycopg), the hot path of ingestion."""
    mark = "?" if paramstyle == "qmark" else "%s"
    return f"INSERT INTO ledger_entries ({', '.join(_COLUMNS)}) VALUES ({', '.join([mark] * len(_COLUMNS))})"


def _row(p: Prepared, position: int, prev: bytes, h: bytes, received: int, epoch: int,
         amount: int) -> tuple[Any, ...]:
    r = p.receipt
    return (position, prev, h, received, epoch, p.record, p.receipt_id, r.client, r.server, r.request_id,
            r.model_id, r.layer, r.tokens, r.pairs, r.expert_flops, r.time_ms, r.seq, amount)


def _chunks(items: list[Any], size: int = _CHUNK) -> Iterable[list[Any]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]
