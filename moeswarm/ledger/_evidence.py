"""Signed evidence of a failed audit, and recording it: the server is marked, and its receipts of
that epoch are withheld at settlement (if the epoch is not settled yet).

The evidence record is signed by the ledger key over canonical(body) under the domain
``"moeswarm/v1/ledger-evidence\\0"``; ``sample_hash`` = SHA-256 of the stored audit sample
(request, outputs, countersigned receipt), so anyone with the weights can re-check the call.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Final

import msgpack
from sqlalchemy import insert, select

from moeswarm.errors import BadResponse, ConfigError, SwarmError
from moeswarm.model import Weights
from moeswarm.protocol import (
    ErrorCode,
    Identity,
    canonical,
    peer_id_to_str,
    public_key_from_peer_id,
    verify,
)

from ._audit import AuditConfig, AuditSample, AuditVerdict, check_sample, reexecute
from ._chain import content_problem, receipt_id
from ._models import Evidence, Settlement
from ._store import Ledger

EVIDENCE_KIND: Final = "ledger-evidence"


@dataclass(frozen=True)
class EvidenceRecord:
    """The ledger's signed statement that a server returned wrong outputs for one receipt."""

    ledger: bytes  # the ledger's peer ID
    receipt_id: bytes
    position: int  # the receipt's chain position
    epoch: int  # the receipt's epoch: the server's receipts of this epoch are withheld
    server: bytes
    client: bytes
    model_id: str
    layer: int
    experts: tuple[int, ...]
    max_error: float  # max|output - reference| / max(1, max|reference|)
    tolerance: float
    sample_hash: bytes  # SHA-256 of the stored AuditSample
    withheld: bool  # False when the epoch was already settled (nothing left to withhold)
    detected_ms: int
    sig: bytes = field(default=b"", compare=False)

    def body(self) -> dict[str, Any]:
        return {"client": self.client, "detected_ms": self.detected_ms, "epoch": self.epoch,
                "experts": list(self.experts), "layer": self.layer, "ledger": self.ledger,
                "max_error": float(self.max_error), "model_id": self.model_id, "position": self.position,
                "receipt_id": self.receipt_id, "sample_hash": self.sample_hash, "server": self.server,
                "tolerance": float(self.tolerance), "type": "evidence", "withheld": self.withheld}

    def signed(self, identity: Identity) -> EvidenceRecord:
        return replace(self, sig=identity.sign(EVIDENCE_KIND, canonical(self.body())))

    def verifies(self) -> bool:
        try:
            key = public_key_from_peer_id(self.ledger)
        except SwarmError:
            return False
        return verify(key, EVIDENCE_KIND, canonical(self.body()), self.sig)

    def encode(self) -> bytes:
        return canonical({**self.body(), "sig": self.sig})

    @classmethod
    def decode(cls, data: bytes) -> EvidenceRecord:
        d = msgpack.unpackb(data, raw=False)
        return cls(d["ledger"], d["receipt_id"], d["position"], d["epoch"], d["server"], d["client"], d["model_id"],
                   d["layer"], tuple(d["experts"]), d["max_error"], d["tolerance"], d["sample_hash"], d["withheld"],
                   d["detected_ms"], d["sig"])

    def to_json(self) -> dict[str, Any]:
        return {"type": "evidence", "ledger": peer_id_to_str(self.ledger), "receipt_id": self.receipt_id.hex(),
                "position": self.position, "epoch": self.epoch, "server": peer_id_to_str(self.server),
                "client": peer_id_to_str(self.client), "model_id": self.model_id, "layer": self.layer,
                "experts": list(self.experts), "max_error": self.max_error, "tolerance": self.tolerance,
                "sample_hash": self.sample_hash.hex(), "withheld": self.withheld,
                "detected_ms": self.detected_ms, "sig": self.sig.hex()}


def record_evidence(ledger: Ledger, sample: AuditSample, verdict: AuditVerdict) -> EvidenceRecord:
    """Sign and store evidence for a failed audit (once per receipt; the stored one is returned again).

    The sample's receipt is ingested first if the ledger does not hold it yet."""
    if verdict.ok:
        raise ConfigError("evidence is for failed audits only")
    if ledger.identity is None:
        raise ConfigError("evidence is signed: it needs the ledger's key")
    result = ledger.ingest([sample.receipt])[0]
    if result.position is None:
        raise ConfigError(f"the audited receipt cannot enter the ledger: {result.reason} {result.message}")
    row = ledger.find(result.receipt_id or b"")
    data = sample.encode()
    r = sample.receipt.receipt
    with ledger.write() as conn:
        held = conn.execute(select(Evidence.record).where(Evidence.receipt_id == row.receipt_id)).scalar()
        if held is not None:
            return EvidenceRecord.decode(held)
        settled = conn.execute(select(Settlement.epoch).where(Settlement.epoch == row.epoch)).first() is not None
        record = EvidenceRecord(
            ledger.ledger_peer_id, row.receipt_id, row.position, row.epoch, r.server, r.client, r.model_id, r.layer,
            r.experts, verdict.max_error, verdict.tolerance, hashlib.sha256(data).digest(), not settled,
            ledger.clock()).signed(ledger.identity)
        conn.execute(insert(Evidence).values(receipt_id=row.receipt_id, server=r.server, epoch=row.epoch,
                                             record=record.encode(), sample=data, created_ms=record.detected_ms))
    return record


def evidence_for(ledger: Ledger, server: bytes | None = None) -> list[EvidenceRecord]:
    """Every evidence record (of one server, if given), oldest first."""
    query = select(Evidence.record).order_by(Evidence.id)
    if server is not None:
        query = query.where(Evidence.server == server)
    with ledger.read() as conn:
        return [EvidenceRecord.decode(d) for d in conn.execute(query).scalars()]


class LocalJudge:
    """Re-executes with weights held here and records signed evidence in ``ledger`` on a mismatch."""

    def __init__(self, ledger: Ledger, weights: Mapping[str, Weights], config: AuditConfig = AuditConfig()) -> None:
        self.ledger = ledger
        self.weights = dict(weights)  # model_id -> weights holding the experts to audit
        self.config = config

    def largest_sample(self) -> int:
        """Bytes of the largest sample worth reading: hidden rows and outputs of ``max_pairs``
        pairs in float32 at the widest model held, plus the receipt and framing."""
        widest = max((w.config.hidden_size for w in self.weights.values()), default=0)
        return 2 * self.config.max_pairs * widest * 4 + 64 * 1024

    def admit(self, sample: AuditSample) -> None:
        """Everything that costs less than the re-execution, before it: both signatures and the
        hashes (``check_sample``), the receipt within the model's per-call limits and the FLOPs
        bound as the ledger would ingest it, the work within this judge's cap, and a receipt the
        ledger holds or would accept (its client can pay for it: keys with no credit cannot buy
        audits). ``BadResponse`` (the sample's fault) otherwise."""
        check_sample(sample)
        r = sample.receipt.receipt
        problem = content_problem(r, self.ledger.models())
        if problem is not None:
            raise BadResponse(f"audit sample: the ledger refuses its receipt ({problem[1]}): {problem[2]}",
                              code=ErrorCode.BAD_FIELD)
        shape = self.ledger.models()[r.model_id]
        too_much = self.config.work_problem(r.pairs, shape.max_flops(r.pairs))
        if too_much is not None:
            raise BadResponse(f"audit sample: {too_much}", code=ErrorCode.BAD_FIELD)
        try:
            self.ledger.find(receipt_id(r))
        except ConfigError:  # not held yet: it must be a receipt the ledger would accept
            price, held = self.ledger.price(r), self.ledger.balance(r.client)
            if held < price:
                raise BadResponse(f"audit sample: its client holds {held} credits and the call costs {price}: the "
                                  f"ledger would refuse the receipt (insufficient_funds)",
                                  code=ErrorCode.AUTH_FAILED) from None

    def judge(self, sample: AuditSample) -> AuditVerdict:
        """Blocking: check what is cheap (``admit``), re-execute, and record evidence when the server lied."""
        weights = self.weights.get(sample.request.model_id)
        if weights is None:
            raise ConfigError(f"no weights to audit model {sample.request.model_id!r}")
        self.admit(sample)
        verdict = reexecute(sample, weights, self.config.tolerance)
        if not verdict.ok:
            record_evidence(self.ledger, sample, verdict)
        return verdict

    async def __call__(self, sample: AuditSample) -> AuditVerdict:
        return await asyncio.to_thread(self.judge, sample)
