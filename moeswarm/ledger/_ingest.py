"""The pure core of ingestion: which receipts of a batch are appended, in which order, and why not.

``plan_batch`` sees a batch of prepared receipts (signatures and FLOPs already checked) and what
the store already holds for the batch's keys, and decides. The accepted receipts are appended
in ``Prepared.sort_key`` order (client, server, seq, receipt id), so the order a batch arrives
in changes neither the chain nor the results.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from moeswarm.protocol import Receipt, peer_id_to_str

from ._chain import Prepared, Reason, Refused, Status

PairKey = tuple[bytes, bytes]  # (client, server)


@dataclass(frozen=True)
class IngestResult:
    """What happened to one submitted receipt. ``position`` is its chain position when held."""

    status: Status
    reason: str = ""  # "" when accepted; one of ``Reason`` otherwise
    receipt_id: bytes | None = None
    position: int | None = None
    message: str = ""  # for people

    @property
    def acknowledged(self) -> bool:
        """Decided for good (committed, or refused for good): the submitter may forget it."""
        return self.status != "retry"

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status, "reason": self.reason, "position": self.position,
                "receipt_id": self.receipt_id.hex() if self.receipt_id else None, "message": self.message}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> IngestResult:
        rid = d.get("receipt_id")
        return cls(d["status"], d.get("reason") or "", bytes.fromhex(rid) if rid else None, d.get("position"),
                   d.get("message") or "")


@dataclass
class Known:
    """What the chain already holds for a batch's keys (the store fills it with three queries)."""

    by_request: dict[PairKey, tuple[bytes, int]] = field(default_factory=dict)  # (client, request_id) -> (id, position)
    seqs: set[tuple[bytes, bytes, int]] = field(default_factory=set)  # (client, server, seq) in the chain
    high: dict[PairKey, int] = field(default_factory=dict)  # (client, server) -> highest seq in the chain


def plan_batch(items: Sequence[Prepared | Refused], known: Known, *, first_position: int, seq_window: int,
               funds: Mapping[bytes, int], cost: Callable[[Receipt], int],
               ) -> tuple[list[tuple[Prepared, int]], list[IngestResult]]:
    """Decide a batch: ((receipt, amount paid) to append in chain order, one result per item in input order).

    A receipt is a duplicate when its (client, request_id) is held with the same receipt id, a
    replay when held with another; ``seq_reused`` when its (client, server, seq) is held;
    ``seq_regression`` when its seq is more than ``seq_window`` below the pair's highest seq;
    ``insufficient_funds`` when ``cost(receipt)`` exceeds what its client still holds (``funds``,
    its balance before the batch, less what the batch's earlier receipts already took).
    Appended receipts get positions ``first_position``, ``first_position + 1``, ...
    """
    results: list[IngestResult | None] = [None] * len(items)
    for i, item in enumerate(items):
        if isinstance(item, Refused):
            results[i] = IngestResult(item.status, item.reason, item.receipt_id, None, item.message)
    order = sorted((i for i, item in enumerate(items) if isinstance(item, Prepared)),
                   key=lambda i: items[i].sort_key)  # type: ignore[union-attr]
    by_request = dict(known.by_request)
    seqs = set(known.seqs)
    high = dict(known.high)
    left = dict(funds)
    accepted: list[tuple[Prepared, int]] = []
    for i in order:
        p = items[i]
        assert isinstance(p, Prepared)
        r = p.receipt
        held = by_request.get((r.client, r.request_id))
        pair = (r.client, r.server)
        if held is not None:
            if held[0] == p.receipt_id:
                results[i] = IngestResult("duplicate", Reason.DUPLICATE, p.receipt_id, held[1],
                                          "already in the ledger")
            else:
                results[i] = IngestResult("rejected", Reason.REPLAY, p.receipt_id, None,
                                          f"request id {r.request_id.hex()} is held with other content "
                                          f"(entry {held[1]})")
            continue
        if (r.client, r.server, r.seq) in seqs:
            results[i] = IngestResult("rejected", Reason.SEQ_REUSED, p.receipt_id, None,
                                      f"seq {r.seq} of this client and server is already used")
            continue
        top = high.get(pair)
        if top is not None and r.seq < top - seq_window:
            results[i] = IngestResult("rejected", Reason.SEQ_REGRESSION, p.receipt_id, None,
                                      f"seq {r.seq} is more than {seq_window} below this pair's {top}")
            continue
        amount = cost(r)
        if amount > left.get(r.client, 0):
            results[i] = IngestResult("rejected", Reason.INSUFFICIENT_FUNDS, p.receipt_id, None,
                                      f"client {peer_id_to_str(r.client)} holds {left.get(r.client, 0)} credits; "
                                      f"this call costs {amount}")
            continue
        left[r.client] = left.get(r.client, 0) - amount
        position = first_position + len(accepted)
        accepted.append((p, amount))
        by_request[(r.client, r.request_id)] = (p.receipt_id, position)
        seqs.add((r.client, r.server, r.seq))
        high[pair] = r.seq if top is None else max(top, r.seq)
        results[i] = IngestResult("accepted", "", p.receipt_id, position)
    return accepted, [r for r in results if r is not None]
