"""Evidence that a holder returned wrong expert outputs: a signed DHT record anyone can check.

A backbone that catches a holder lying (its outputs differ from the backbone's own recomputation,
or from the majority of other holders, beyond the wire dtype's tolerance) sends one small
challenge, one row through one expert, to the accused and to one or more other holders, and
publishes what came back::

    /moeswarm/v1/<model_id>/evidence/<accused peer, base58btc>

    {type: "output_evidence", model_id, accused, reporter, detected_ms,
     request:   the expert_request sent to the accused (encoded),
     responses: [the accused's expert_response, each witness's expert_response] (encoded),
     sig:       the reporter's Ed25519 signature over canonical(the map without sig)}

Every response carries its server's signed receipt over the input and output hashes, so a reader
checks without weights and without any call (``validate_evidence``): the reporter signed the
record; every receipt verifies, was issued to the reporter for the same model, layer, experts and
input hash (recomputed from the request); every response's outputs hash to its receipt's; the
witnesses agree with one another within tolerance and the accused differs from them beyond it.
What it cannot tell without weights: whether the reporter and its witnesses collude to frame an
honest holder (a reader holding the weights can recompute the one row; protocol_spec/security.md).
A stored valid record is never replaced: one proof is enough.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

import numpy as np

from ..errors import ProtocolError, SwarmError
from ..protocol import (
    ErrorCode,
    ExpertRequest,
    ExpertResponse,
    Identity,
    canonical,
    decode,
    encode,
    input_hash,
    is_peer_id,
    output_hash,
    peer_id_from_str,
    peer_id_to_str,
    public_key_from_peer_id,
    verify,
    verify_receipt,
)
from ..protocol._wire import Fields, bad, unpack

EVIDENCE_KIND: Final = "output-evidence"
"""Signature domain of evidence records (after the protocol's ``moeswarm/v1/`` prefix)."""
MAX_EVIDENCE_BYTES: Final = 192 * 1024
"""Largest evidence record: one row of a 7168-wide model in float32, four times, plus receipts."""
MAX_WITNESSES: Final = 3
_KEY = re.compile(r"/moeswarm/v1/(.+)/evidence/([1-9A-HJ-NP-Za-km-z]+)")


def output_tolerance(dtype: np.dtype[Any] | str) -> float:
    """Largest ``max|a - b| / max(1, max|ref|)`` two honest holders may differ by, for outputs sent
    in ``dtype``: 8 units in the last place of the wire dtype (rounding on both sides plus another
    summation order), and never below 1e-4 (float32 math on other BLAS builds or hardware)."""
    return max(8 * float(np.finfo(np.dtype(dtype)).eps), 1e-4)


def relative_error(outputs: np.ndarray, reference: np.ndarray) -> float:
    """``max|outputs - reference| / max(1, max|reference|)``, as the ledger's audits measure it."""
    a, b = outputs.astype(np.float32), reference.astype(np.float32)
    return float(np.abs(a - b).max(initial=0.0)) / max(1.0, float(np.abs(b).max(initial=0.0)))


def evidence_key(model_id: str, accused: bytes) -> str:
    return f"/moeswarm/v1/{model_id}/evidence/{peer_id_to_str(accused)}"


def is_evidence_key(key: str) -> bool:
    return _KEY.fullmatch(key) is not None


@dataclass(frozen=True, eq=False)
class OutputEvidence:
    """See the module docstring; ``responses[0]`` is the accused's, the rest are witnesses'."""

    model_id: str
    accused: bytes
    reporter: bytes
    detected_ms: int
    request: ExpertRequest
    responses: tuple[ExpertResponse, ...]
    sig: bytes = b""

    def body(self) -> dict[str, Any]:
        return {"accused": self.accused, "detected_ms": self.detected_ms, "model_id": self.model_id,
                "reporter": self.reporter, "request": encode(self.request),
                "responses": [encode(r) for r in self.responses], "type": "output_evidence"}

    def signed(self, identity: Identity) -> OutputEvidence:
        return replace(self, sig=identity.sign(EVIDENCE_KIND, canonical(self.body())))

    def encode(self) -> bytes:
        return canonical({**self.body(), "sig": self.sig})

    @property
    def witnesses(self) -> tuple[bytes, ...]:
        return tuple(r.receipt.server for r in self.responses[1:])

    @classmethod
    def decode(cls, data: bytes) -> OutputEvidence:
        """``ProtocolError`` for anything that is not a well-formed record (nothing is verified)."""
        if len(data) > MAX_EVIDENCE_BYTES:
            bad(f"evidence of {len(data)} bytes exceeds {MAX_EVIDENCE_BYTES}", code=ErrorCode.FRAME_TOO_LARGE)
        f = Fields(unpack(data), "output_evidence")
        if f.raw("type") != "output_evidence":
            bad("not an output evidence record")
        accused, reporter = f.bin("accused"), f.bin("reporter")
        if not (is_peer_id(accused) and is_peer_id(reporter)):
            bad("output_evidence.accused and .reporter must be Ed25519 peer IDs")
        model_id = f.text("model_id", max_bytes=128)
        request = decode(f.bin("request"))
        responses = tuple(decode(_bin(r)) for r in f.array("responses", lo=2, hi=1 + MAX_WITNESSES))
        if not isinstance(request, ExpertRequest) or not all(isinstance(r, ExpertResponse) for r in responses):
            bad("output_evidence must hold an expert_request and expert_responses")
        if any(r.receipt is None for r in responses):  # type: ignore[union-attr]
            bad("every response of output_evidence must carry its signed receipt")
        return cls(model_id, accused, reporter, f.uint("detected_ms"), request, responses,  # type: ignore[arg-type]
                   f.bin("sig", size=64))


def _bin(value: Any) -> bytes:
    if type(value) is not bytes:
        bad("output_evidence.responses must hold bin")
    return value


def validate_evidence(key: str, value: bytes, stored: bytes | None = None) -> OutputEvidence:
    """Accept an evidence record for ``key`` or raise ``ProtocolError`` (see the module docstring).
    A valid record already ``stored`` is kept (code 14): one proof is enough."""
    m = _KEY.fullmatch(key)
    if m is None:
        bad(f"not an evidence key: {key!r:.120}")
    ev = OutputEvidence.decode(value)
    try:
        named = peer_id_from_str(m.group(2))
    except SwarmError:
        bad("the key does not name a peer ID")
    if ev.accused != named or ev.model_id != m.group(1):
        bad("the record accuses another peer or model than its key names")
    check_evidence(ev)
    if stored is not None and stored != value:
        try:
            validate_evidence(key, stored)
        except ProtocolError:
            return ev  # what is stored is void: replace it
        raise ProtocolError("this holder already has valid evidence against it", code=ErrorCode.STALE)
    return ev


def check_evidence(ev: OutputEvidence) -> float:
    """The pure check of a decoded record; returns the accused's error against the witnesses."""
    try:
        ok = verify(public_key_from_peer_id(ev.reporter), EVIDENCE_KIND, canonical(ev.body()), ev.sig)
    except SwarmError:
        ok = False
    if not ok:
        raise ProtocolError("evidence signature does not verify", code=ErrorCode.AUTH_FAILED)
    req = ev.request
    if req.model_id != ev.model_id:
        bad("the challenge names another model")
    servers = [r.receipt.server for r in ev.responses]
    if servers[0] != ev.accused or len(set(servers)) != len(servers) or ev.reporter in servers:
        bad("the first response must be the accused's, each witness another peer, none the reporter's")
    expected = {"client": ev.reporter, "model_id": ev.model_id, "layer": req.layer,
                "experts": tuple(int(e.expert) for e in req.experts), "tokens": int(req.hidden.shape[0]),
                "pairs": req.pairs, "input_hash": input_hash(req.hidden, req.experts)}
    for response in ev.responses:
        r = response.receipt
        for name, want in expected.items():
            if getattr(r, name) != want:
                bad(f"receipt of {peer_id_to_str(r.server)} differs from the challenge in {name}")
        if response.outputs.shape != (req.pairs, req.hidden.shape[1]) or response.outputs.dtype != req.hidden.dtype:
            bad("a response's outputs do not fit the challenge", code=ErrorCode.BAD_TENSOR)
        if output_hash(response.outputs) != r.output_hash:
            bad("a response's outputs differ from its receipt's output_hash")
        try:
            verify_receipt(r)
        except SwarmError:
            raise ProtocolError(f"the receipt of {peer_id_to_str(r.server)} does not verify",
                                code=ErrorCode.AUTH_FAILED) from None
    tolerance = output_tolerance(req.hidden.dtype)
    reference = ev.responses[1].outputs
    for witness in ev.responses[2:]:
        if relative_error(witness.outputs, reference) > tolerance:
            bad("the witnesses disagree with one another")
    error = relative_error(ev.responses[0].outputs, reference)
    if error <= tolerance:
        bad(f"the accused's outputs agree with the witnesses' ({error:.3g} <= {tolerance:.3g})")
    return error


def select_evidence(key: str, values: Sequence[bytes]) -> int:
    """Index of the valid record detected first (any valid one proves the same)."""
    best: tuple[int, bytes] | None = None
    index, error = -1, None
    for i, value in enumerate(values):
        try:
            ev = validate_evidence(key, value)
        except ProtocolError as e:
            error = e
            continue
        if best is None or (ev.detected_ms, value) < best:
            best, index = (ev.detected_ms, value), i
    if index < 0:
        raise error or ProtocolError("no valid evidence", code=ErrorCode.BAD_FIELD)
    return index
