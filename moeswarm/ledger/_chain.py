"""Pure pieces of the ledger: receipt ids, entry hashes, the FLOPs bound, and receipt checks.

Hashes (SHA-256, each domain-separated by a tag that no other hash in the project uses):

    receipt_id = SHA-256("moeswarm/v1/ledger-receipt\\0" || canonical(receipt body))
    entry_hash = SHA-256("moeswarm/v1/ledger-entry\\0" || prev_hash (32) || position (u64 BE)
                         || received_ms (u64 BE) || record)

``record`` is the canonical encoding of the ``countersigned_receipt`` message (both
signatures included), or (v1.3) of the ``batched_receipt`` message (the receipt body, its batch's
statement with both signatures, and the Merkle path from the body to the statement's root): the
bytes the chain stores and commits to. The receipt body is what both
signatures cover (``protocol.receipt_body``), so two records of the same body are one receipt.
The first entry's ``prev_hash`` is ``GENESIS_HASH`` (32 zero bytes).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Final, Literal

import msgpack

from moeswarm.errors import ProtocolError
from moeswarm.protocol import (
    DEFAULT_MAX_FRAME,
    BatchedReceipt,
    BatchStatement,
    CountersignedReceipt,
    Receipt,
    SignatureKind,
    canonical,
    decode,
    expert_call_flops,
    public_key_from_peer_id,
    batch_proof_holds,
    encode,
    receipt_body,
    statement_problem,
    verify,
)

SubmittedReceipt = CountersignedReceipt | BatchedReceipt
"""What the ledger takes: a v1.2 countersigned receipt or a v1.3 batched one."""

GENESIS_HASH: Final = bytes(32)
MAX_STORED_INT: Final = 2**63 - 1  # SQL BIGINT; larger counters are refused ("out_of_range")

Status = Literal["accepted", "duplicate", "rejected", "retry"]
"""accepted: appended now; duplicate: already held (no-op); rejected: refused for good (the
reason says why); retry: not decided (e.g. its model is not registered yet), submit it again."""


class Reason:
    """Why a receipt was not appended (``IngestResult.reason``)."""

    MALFORMED: Final = "malformed"  # not a valid countersigned_receipt message
    BAD_SERVER_SIGNATURE: Final = "bad_server_signature"
    BAD_CLIENT_SIGNATURE: Final = "bad_client_signature"
    SELF_DEALING: Final = "client_is_server"  # a peer cannot countersign its own work
    UNKNOWN_MODEL: Final = "unknown_model"  # no (hidden, ffn) registered for its model: retry
    FLOPS_EXCEED_FORMULA: Final = "flops_exceed_formula"
    EXCEEDS_MODEL_LIMITS: Final = "exceeds_model_limits"  # more tokens or pairs than one call of the model has
    INSUFFICIENT_FUNDS: Final = "insufficient_funds"  # the client's balance does not cover the call's price
    ZERO_FLOPS: Final = "zero_flops"  # a receipt for no work (expert_flops = 0): a call of P >= 1 pairs did some
    OUT_OF_RANGE: Final = "out_of_range"  # a counter above 2**63 - 1
    DUPLICATE: Final = "duplicate"  # the same receipt body is already in the chain
    REPLAY: Final = "replay"  # same (client, request_id), different content
    SEQ_REUSED: Final = "seq_reused"  # same (client, server, seq), another request
    SEQ_REGRESSION: Final = "seq_regression"  # seq older than the pair's window
    BAD_BATCH_PROOF: Final = "bad_batch_proof"  # v1.3: the receipt is not the leaf its path names under its statement


@dataclass(frozen=True)
class ModelShape:
    """What the FLOPs formula and the per-call limits need to know about a model's routed experts."""

    hidden: int  # hidden size H
    ffn: int  # expert FFN width F (moe_intermediate_size)
    top_k: int = 0  # experts per token (num_experts_per_tok); 0 = unknown: pairs capped by tokens x experts
    max_tokens: int = 0  # tokens one call may carry; 0 = as many 16-bit rows of H as a largest frame holds

    @property
    def token_limit(self) -> int:
        """Most tokens one receipt may claim."""
        return self.max_tokens or max(1, DEFAULT_MAX_FRAME // (2 * self.hidden))

    def pair_limit(self, tokens: int, experts: int) -> int:
        """Most (expert, token) pairs a call of ``tokens`` tokens to ``experts`` experts has."""
        return tokens * (min(experts, self.top_k) if self.top_k else experts)

    def max_flops(self, pairs: int) -> int:
        """The most ``pairs`` (expert, token) pairs can cost: 6 * H * F each."""
        return expert_call_flops(self.hidden, self.ffn, pairs)


@dataclass(frozen=True, slots=True)
class Prepared:
    """A countersigned receipt whose signatures and FLOPs passed, with its hashes precomputed."""

    receipt: Receipt
    record: bytes  # canonical countersigned_receipt (or batched_receipt) encoding: what the chain stores
    receipt_id: bytes  # 32 bytes, see the module docstring

    @property
    def sort_key(self) -> tuple[bytes, bytes, int, bytes]:
        """Chain order inside one batch: by pair and seq, so batch order never matters."""
        r = self.receipt
        return r.client, r.server, r.seq, self.receipt_id


@dataclass(frozen=True, slots=True)
class Refused:
    """A receipt that could not be prepared: ``status`` is ``rejected`` or ``retry``."""

    status: Status
    reason: str
    message: str
    receipt_id: bytes | None = None


def _sha(tag: bytes, *parts: bytes) -> bytes:
    h = hashlib.sha256(tag)
    for p in parts:
        h.update(p)
    return h.digest()


def receipt_id_of_body(body: bytes) -> bytes:
    """The receipt id of a canonical receipt body."""
    return _sha(b"moeswarm/v1/ledger-receipt\0", body)


def receipt_id(receipt: Receipt) -> bytes:
    """The receipt id: SHA-256 over the body both signatures cover (not the signatures)."""
    return receipt_id_of_body(canonical(receipt_body(receipt)))


def entry_hash(prev: bytes, position: int, received_ms: int, record: bytes) -> bytes:
    """The hash of chain entry ``position`` (1-based), committing to the previous entry's hash."""
    return _sha(b"moeswarm/v1/ledger-entry\0", prev, position.to_bytes(8, "big"),
                received_ms.to_bytes(8, "big"), record)


_SIGNATURE_MESSAGES: Final = {
    Reason.MALFORMED: "a peer ID is not an Ed25519 peer ID",
    Reason.BAD_SERVER_SIGNATURE: "the server's signature does not verify",
    Reason.BAD_CLIENT_SIGNATURE: "the client's countersignature does not verify",
    Reason.BAD_BATCH_PROOF: "the receipt is not the leaf its Merkle path names under its batch's signed root",
}


def encode_record(cr: SubmittedReceipt) -> tuple[bytes, bytes]:
    """(canonical receipt body, canonical record) in one pass: the same bytes as
    ``canonical(receipt_body(r))`` and ``encode(cr)``, without encoding the body twice."""
    if isinstance(cr, BatchedReceipt):
        return msgpack.packb(receipt_body(cr.receipt), use_bin_type=True), encode(cr)
    body_map = receipt_body(cr.receipt)  # a dict already in canonical key order, ints checked
    body = msgpack.packb(body_map, use_bin_type=True)
    receipt_map = {k: body_map[k] for k in _RECEIPT_KEYS_BEFORE_SIG}
    receipt_map["sig"] = bytes(cr.receipt.sig)
    receipt_map.update((k, body_map[k]) for k in _RECEIPT_KEYS_AFTER_SIG)
    record = msgpack.packb({"client_sig": bytes(cr.client_sig), "receipt": receipt_map,
                            "type": CountersignedReceipt.TYPE}, use_bin_type=True)
    return body, record


_RECEIPT_KEYS_BEFORE_SIG: Final = ("client", "expert_flops", "experts", "input_hash", "layer", "model_id",
                                   "output_hash", "pairs", "request_id", "seq", "server")
_RECEIPT_KEYS_AFTER_SIG: Final = ("time_ms", "tokens")


def signature_problem(cr: SubmittedReceipt, body: bytes) -> str | None:
    """The reason both signatures do not verify over ``body`` (canonical receipt body), or None.
    A batched receipt: its body must be the leaf its path names under its statement's root
    (``bad_batch_proof``), and the statement's two signatures must verify (checked once per
    statement while it is recent: a batch's receipts share it)."""
    if isinstance(cr, BatchedReceipt):
        if not batch_proof_holds(cr, body):
            return Reason.BAD_BATCH_PROOF
        return _statement_problem(cr.statement, cr.client_sig)
    r = cr.receipt
    try:
        server_key = public_key_from_peer_id(r.server)
        client_key = public_key_from_peer_id(r.client)
    except ProtocolError:
        return Reason.MALFORMED
    if not verify(server_key, SignatureKind.RECEIPT, body, r.sig):
        return Reason.BAD_SERVER_SIGNATURE
    if not verify(client_key, SignatureKind.RECEIPT_COUNTERSIGN, body + r.sig, cr.client_sig):
        return Reason.BAD_CLIENT_SIGNATURE
    return None


@lru_cache(maxsize=1024)
def _statement_problem(statement: BatchStatement, client_sig: bytes) -> str | None:
    problem = statement_problem(statement, client_sig)
    return {"malformed": Reason.MALFORMED, "bad_server_signature": Reason.BAD_SERVER_SIGNATURE,
            "bad_client_signature": Reason.BAD_CLIENT_SIGNATURE, None: None}[problem]


def content_problem(r: Receipt, shapes: Mapping[str, ModelShape], *,
                    limits: bool = True) -> tuple[Status, str, str] | None:
    """What is wrong with a receipt's fields (not its signatures), or None.

    The FLOPs bound is 6 * H * F per (expert, token) pair, with pairs capped at
    tokens * len(experts) (the codec already enforces that for decoded receipts). With ``limits``
    (ingestion) the call must also fit one call of the model: tokens at most ``token_limit``,
    pairs at most tokens x top_k, and claim some work (``expert_flops`` > 0). Verification of stored
    entries passes ``limits=False``: entries appended before revision 0002 were checked by the FLOPs
    bound alone."""
    if r.client == r.server:
        return "rejected", Reason.SELF_DEALING, "the client and the server are the same peer"
    if max(r.seq, r.expert_flops, r.time_ms, r.tokens, r.pairs) > MAX_STORED_INT:
        return "rejected", Reason.OUT_OF_RANGE, "a counter is above 2**63 - 1"
    if limits and r.expert_flops == 0:
        return "rejected", Reason.ZERO_FLOPS, "claims 0 expert-FLOPs: a call of one pair or more does work"
    shape = shapes.get(r.model_id)
    if shape is None:
        return "retry", Reason.UNKNOWN_MODEL, f"model {r.model_id!r} has no registered expert shape"
    if limits and (r.tokens > shape.token_limit or r.pairs > shape.pair_limit(r.tokens, len(r.experts))):
        message = (f"claims {r.tokens} tokens and {r.pairs} pairs; one call of {r.model_id} carries at most "
                   f"{shape.token_limit} tokens and {shape.top_k or len(r.experts)} experts per token")
        return "rejected", Reason.EXCEEDS_MODEL_LIMITS, message
    pairs = min(r.pairs, r.tokens * len(r.experts))
    bound = shape.max_flops(pairs)
    if r.expert_flops > bound:
        return ("rejected", Reason.FLOPS_EXCEED_FORMULA,
                f"claims {r.expert_flops} FLOPs; {pairs} pairs of {r.model_id} cost at most {bound}")
    return None


def prepare(item: bytes | SubmittedReceipt, shapes: Mapping[str, ModelShape]) -> Prepared | Refused:
    """Decode (if bytes), check both signatures and the FLOPs bound, precompute the hashes."""
    if isinstance(item, bytes):
        try:
            cr = decode(item)
        except ProtocolError as e:
            return Refused("rejected", Reason.MALFORMED, str(e))
        if not isinstance(cr, (CountersignedReceipt, BatchedReceipt)):
            return Refused("rejected", Reason.MALFORMED,
                           f"expected a countersigned_receipt or a batched_receipt, got {cr.TYPE}")
    else:
        cr = item
    try:
        body, record = encode_record(cr)
    except Exception as e:  # noqa: BLE001 - objects built in-process may hold anything
        return Refused("rejected", Reason.MALFORMED, f"cannot encode: {e}")
    rid = receipt_id_of_body(body)
    bad_sig = signature_problem(cr, body)
    if bad_sig is not None:
        return Refused("rejected", bad_sig, _SIGNATURE_MESSAGES[bad_sig], rid)
    problem = content_problem(cr.receipt, shapes)
    if problem is not None:
        return Refused(problem[0], problem[1], problem[2], rid)
    return Prepared(cr.receipt, record, rid)
