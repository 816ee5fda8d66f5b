"""Receipts: the server signs what it computed, the client checks and countersigns it.

server sig = Ed25519(server, "moeswarm/v1/receipt\\0" + canonical(body))
client sig = Ed25519(client, "moeswarm/v1/receipt-countersign\\0" + canonical(body) + server sig)

where ``body`` is the receipt map without ``sig``. Hashes are SHA-256 of canonical msgpack.

v1.3 (handshake version 2) batches them: a response may come without a receipt; the server
later sends a ``receipt_batch`` of those calls' receipt bodies and signs one ``BatchStatement``
(client, server, count, Merkle root of the bodies, ``_merkle``):

server sig = Ed25519(server, "moeswarm/v1/receipt-batch\\0" + canonical(statement body))
client sig = Ed25519(client, "moeswarm/v1/receipt-batch-countersign\\0" + canonical(statement body) + server sig)

and each receipt reaches the ledger as a ``BatchedReceipt``: body, statement, index, Merkle path.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from collections.abc import Sequence

import numpy as np

from moeswarm.errors import BadResponse, ConfigError, ProtocolError

from ._codec import receipt_body, rows_bytes, statement_body
from ._identity import Identity, public_key_from_peer_id, verify
from ._limits import MAX_BATCH_RECEIPTS, ErrorCode, SignatureKind
from ._merkle import leaf_hash, merkle_paths, merkle_root, root_from_path
from ._messages import (
    BatchedReceipt, BatchStatement, CountersignedReceipt, ExpertRequest, ExpertResponse, ExpertRows, Receipt,
    ReceiptBatch,
)
from ._tensor import tensor_canonical_parts, tensor_hash
from ._wire import pack  # for maps already in canonical order (receipt_body, statement_body): their canonical bytes


_EXPERTS_KEY = b"\x82" + pack("experts")  # a map of 2 entries, then its first key
_HIDDEN_KEY = pack("hidden")


def input_hash(hidden: np.ndarray, experts: Sequence[ExpertRows]) -> bytes:
    """SHA-256 of canonical ``{"experts": <request experts>, "hidden": <tensor map>}``."""
    h = hashlib.sha256(_EXPERTS_KEY)
    h.update(pack([{"expert": int(e.expert), "rows": rows_bytes(e.rows)} for e in experts]))
    h.update(_HIDDEN_KEY)
    prefix, data, suffix = tensor_canonical_parts(hidden)
    h.update(prefix)
    h.update(data)
    h.update(suffix)
    return h.digest()


def output_hash(outputs: np.ndarray) -> bytes:
    """SHA-256 of the canonical outputs tensor map."""
    return tensor_hash(outputs)


def expert_call_flops(hidden_size: int, intermediate_size: int, tokens: int) -> int:
    """A receipt's ``expert_flops`` for ``tokens`` rows through one routed expert: three
    hidden x intermediate matmuls, 2 FLOPs per multiply-add."""
    return 2 * tokens * 3 * hidden_size * intermediate_size


def make_receipt(
    identity: Identity,
    request: ExpertRequest,
    outputs: np.ndarray,
    *,
    client: bytes,
    expert_flops: int,
    time_ms: int,
    sign: bool = True,
) -> Receipt:
    """The server's signed receipt for serving ``request`` with ``outputs`` (P, H); with
    ``sign=False`` the body alone, for a ``receipt_batch`` (v1.3)."""
    unsigned = Receipt(
        request_id=request.request_id, client=client, server=identity.peer_id,
        model_id=request.model_id, layer=request.layer,
        experts=tuple(int(e.expert) for e in request.experts),
        tokens=int(request.hidden.shape[0]), pairs=request.pairs, expert_flops=expert_flops,
        input_hash=input_hash(request.hidden, request.experts), output_hash=output_hash(outputs),
        time_ms=time_ms, seq=request.seq,
    )
    if not sign:
        return unsigned
    sig = identity.sign(SignatureKind.RECEIPT, pack(receipt_body(unsigned)))
    return replace(unsigned, sig=sig)


def _bad(message: str, code: int = ErrorCode.BAD_FIELD) -> BadResponse:
    return BadResponse(message, code=code)


def verify_receipt(receipt: Receipt) -> None:
    """Check the server's signature under the key inside ``receipt.server``; ``BadResponse`` 9."""
    key = public_key_from_peer_id(receipt.server)
    if not verify(key, SignatureKind.RECEIPT, pack(receipt_body(receipt)), receipt.sig):
        raise _bad("receipt signature does not verify", ErrorCode.AUTH_FAILED)


def countersign(identity: Identity, receipt: Receipt) -> CountersignedReceipt:
    """The client's countersignature; check the receipt first (``check_response``)."""
    if receipt.client != identity.peer_id:
        raise ConfigError("only the receipt's client may countersign it")
    payload = pack(receipt_body(receipt)) + receipt.sig
    return CountersignedReceipt(receipt, identity.sign(SignatureKind.RECEIPT_COUNTERSIGN, payload))


def verify_countersigned(cr: CountersignedReceipt) -> None:
    """Check both signatures; ``BadResponse`` code 9 if either fails."""
    verify_receipt(cr.receipt)
    key = public_key_from_peer_id(cr.receipt.client)
    payload = pack(receipt_body(cr.receipt)) + cr.receipt.sig
    if not verify(key, SignatureKind.RECEIPT_COUNTERSIGN, payload, cr.client_sig):
        raise _bad("client countersignature does not verify", ErrorCode.AUTH_FAILED)


def check_response(
    request: ExpertRequest, response: ExpertResponse, *, client: bytes, server: bytes
) -> Receipt:
    """Check a decoded response against the request it answers; return its verified receipt.

    ``client`` and ``server`` are the peer IDs the handshake authenticated. Raises
    ``BadResponse``: code 4 for a mismatch (or no receipt), 5 for wrong output shape/dtype, 9 for a
    bad signature.
    """
    check_outputs(request, response)
    if response.receipt is None:
        raise _bad("the response carries no receipt")
    check_receipt(request, response.outputs, response.receipt, client=client, server=server)
    verify_receipt(response.receipt)
    return response.receipt


def check_outputs(request: ExpertRequest, response: ExpertResponse) -> None:
    """The response answers ``request`` with outputs of its shape and dtype; ``BadResponse`` 4 or 5."""
    pairs, width = request.pairs, request.hidden.shape[1]
    if response.request_id != request.request_id:
        raise _bad("response answers another request")
    if response.outputs.shape != (pairs, width) or response.outputs.dtype != request.hidden.dtype:
        raise _bad(f"outputs are {response.outputs.dtype}{list(response.outputs.shape)}, expected "
                   f"{request.hidden.dtype}[{pairs}, {width}]", ErrorCode.BAD_TENSOR)


def check_receipt(request: ExpertRequest, outputs: np.ndarray, r: Receipt, *, client: bytes, server: bytes) -> None:
    """Every field of receipt ``r`` but its signature matches ``request`` and the ``outputs``
    received; ``BadResponse`` 4 naming the first field that does not."""
    checks = (  # in this order: the first that fails is named; the hashes only when all else matched
        ("request_id", lambda: r.request_id == request.request_id), ("client", lambda: r.client == client),
        ("server", lambda: r.server == server), ("model_id", lambda: r.model_id == request.model_id),
        ("layer", lambda: r.layer == request.layer),
        ("experts", lambda: r.experts == tuple(int(e.expert) for e in request.experts)),
        ("tokens", lambda: r.tokens == request.hidden.shape[0]), ("pairs", lambda: r.pairs == request.pairs),
        ("seq", lambda: r.seq == request.seq),
        ("input_hash", lambda: r.input_hash == input_hash(request.hidden, request.experts)),
        ("output_hash", lambda: r.output_hash == output_hash(outputs)),
    )
    for name, holds in checks:
        if not holds():
            raise _bad(f"receipt.{name} does not match the request")


# ---------------------------------------------------------------- v1.3: receipt batches


def receipt_leaf(receipt: Receipt) -> bytes:
    """The Merkle leaf of a receipt: its canonical body, tagged (``_merkle``)."""
    return leaf_hash(pack(receipt_body(receipt)))


def sign_batch(identity: Identity, client: bytes, receipts: Sequence[Receipt]) -> ReceiptBatch:
    """The server's ``receipt_batch`` of ``receipts`` (bodies, ``sig`` empty) for ``client``."""
    if not 1 <= len(receipts) <= MAX_BATCH_RECEIPTS:
        raise ConfigError(f"a batch holds 1..{MAX_BATCH_RECEIPTS} receipts, not {len(receipts)}")
    unsigned = tuple(replace(r, sig=b"") if r.sig else r for r in receipts)
    st = BatchStatement(client, identity.peer_id, len(unsigned), merkle_root([receipt_leaf(r) for r in unsigned]))
    sig = identity.sign(SignatureKind.RECEIPT_BATCH, pack(statement_body(st)))
    return ReceiptBatch(replace(st, sig=sig), unsigned)


def statement_problem(st: BatchStatement, client_sig: bytes | None = None) -> str | None:
    """Why the statement's server signature (and, given, the client's countersignature) does not
    verify: ``"bad_server_signature"``, ``"bad_client_signature"`` or ``"malformed"`` (a peer ID
    that is not an Ed25519 one); None when they verify."""
    try:
        server_key = public_key_from_peer_id(st.server)
        client_key = public_key_from_peer_id(st.client)
    except ProtocolError:
        return "malformed"
    body = pack(statement_body(st))
    if not verify(server_key, SignatureKind.RECEIPT_BATCH, body, st.sig):
        return "bad_server_signature"
    if client_sig is not None and not verify(client_key, SignatureKind.RECEIPT_BATCH_COUNTERSIGN,
                                             body + st.sig, client_sig):
        return "bad_client_signature"
    return None


def countersign_batch(identity: Identity, batch: ReceiptBatch) -> list[BatchedReceipt]:
    """Check the batch's root and server signature and countersign its statement once; returns
    one ``BatchedReceipt`` per receipt (the caller checked each receipt against its call first:
    ``check_receipt``). ``BadResponse`` 4 for a root that is not the receipts', 9 for a signature."""
    st = batch.statement
    if st.client != identity.peer_id:
        raise ConfigError("only the batch's client may countersign it")
    leaves = [receipt_leaf(r) for r in batch.receipts]
    if len(leaves) != st.count or merkle_root(leaves) != st.root:
        raise _bad("the batch statement's Merkle root is not its receipts'")
    if statement_problem(st) is not None:
        raise _bad("receipt batch signature does not verify", ErrorCode.AUTH_FAILED)
    client_sig = identity.sign(SignatureKind.RECEIPT_BATCH_COUNTERSIGN, pack(statement_body(st)) + st.sig)
    return [BatchedReceipt(r, st, i, path, client_sig)
            for i, (r, path) in enumerate(zip(batch.receipts, merkle_paths(leaves)))]


def batched_problem(br: BatchedReceipt, body: bytes | None = None) -> str | None:
    """Why a ``BatchedReceipt`` does not hold (what the ledger checks): ``"bad_batch_proof"`` when
    its body is not leaf ``index`` under the statement's root, else ``statement_problem``'s
    reasons; None when it holds. ``body``: its canonical receipt body, if already encoded."""
    if not batch_proof_holds(br, body):
        return "bad_batch_proof"
    return statement_problem(br.statement, br.client_sig)


def batch_proof_holds(br: BatchedReceipt, body: bytes | None = None) -> bool:
    """Whether the receipt (canonical ``body``, if already encoded) is leaf ``index`` under the
    statement's root, and names the statement's client and server."""
    if br.receipt.client != br.statement.client or br.receipt.server != br.statement.server:
        return False
    leaf = leaf_hash(body if body is not None else pack(receipt_body(br.receipt)))
    return root_from_path(leaf, br.index, br.statement.count, br.path) == br.statement.root


def verify_record(record: CountersignedReceipt | BatchedReceipt) -> None:
    """Check a receipt as submitted to the ledger, of either kind: both signatures of a
    countersigned receipt (v1.2), or a batched one's place under its statement and the statement's
    two signatures (v1.3); ``BadResponse`` 9 (4 for a batched receipt that is not in its batch)."""
    if isinstance(record, CountersignedReceipt):
        verify_countersigned(record)
        return
    problem = batched_problem(record)
    if problem == "bad_batch_proof":
        raise _bad("the receipt is not the leaf its Merkle path names under the batch statement")
    if problem is not None:
        raise _bad(f"batched receipt: {problem.replace('_', ' ')}", ErrorCode.AUTH_FAILED)
