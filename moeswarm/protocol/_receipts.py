"""Receipts: the server signs what it computed, the client checks and countersigns it.

server sig = Ed25519(server, "moeswarm/v1/receipt\\0" + canonical(body))
client sig = Ed25519(client, "moeswarm/v1/receipt-countersign\\0" + canonical(body) + server sig)

where ``body`` is the receipt map without ``sig``. Hashes are SHA-256 of canonical msgpack.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from collections.abc import Sequence

import numpy as np

from moeswarm.errors import BadResponse, ConfigError

from ._codec import receipt_body, rows_bytes
from ._identity import Identity, public_key_from_peer_id, verify
from ._limits import ErrorCode, SignatureKind
from ._messages import CountersignedReceipt, ExpertRequest, ExpertResponse, ExpertRows, Receipt
from ._tensor import tensor_canonical_parts, tensor_hash
from ._wire import canonical, pack


def input_hash(hidden: np.ndarray, experts: Sequence[ExpertRows]) -> bytes:
    """SHA-256 of canonical ``{"experts": <request experts>, "hidden": <tensor map>}``."""
    h = hashlib.sha256(b"\x82" + pack("experts"))
    h.update(pack([{"expert": int(e.expert), "rows": rows_bytes(e.rows)} for e in experts]))
    h.update(pack("hidden"))
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
) -> Receipt:
    """The server's signed receipt for serving ``request`` with ``outputs`` (P, H)."""
    unsigned = Receipt(
        request_id=request.request_id, client=client, server=identity.peer_id,
        model_id=request.model_id, layer=request.layer,
        experts=tuple(int(e.expert) for e in request.experts),
        tokens=int(request.hidden.shape[0]), pairs=request.pairs, expert_flops=expert_flops,
        input_hash=input_hash(request.hidden, request.experts), output_hash=output_hash(outputs),
        time_ms=time_ms, seq=request.seq,
    )
    sig = identity.sign(SignatureKind.RECEIPT, canonical(receipt_body(unsigned)))
    return replace(unsigned, sig=sig)


def _bad(message: str, code: int = ErrorCode.BAD_FIELD) -> BadResponse:
    return BadResponse(message, code=code)


def verify_receipt(receipt: Receipt) -> None:
    """Check the server's signature under the key inside ``receipt.server``; ``BadResponse`` 9."""
    key = public_key_from_peer_id(receipt.server)
    if not verify(key, SignatureKind.RECEIPT, canonical(receipt_body(receipt)), receipt.sig):
        raise _bad("receipt signature does not verify", ErrorCode.AUTH_FAILED)


def countersign(identity: Identity, receipt: Receipt) -> CountersignedReceipt:
    """The client's countersignature; check the receipt first (``check_response``)."""
    if receipt.client != identity.peer_id:
        raise ConfigError("only the receipt's client may countersign it")
    payload = canonical(receipt_body(receipt)) + receipt.sig
    return CountersignedReceipt(receipt, identity.sign(SignatureKind.RECEIPT_COUNTERSIGN, payload))


def verify_countersigned(cr: CountersignedReceipt) -> None:
    """Check both signatures; ``BadResponse`` code 9 if either fails."""
    verify_receipt(cr.receipt)
    key = public_key_from_peer_id(cr.receipt.client)
    payload = canonical(receipt_body(cr.receipt)) + cr.receipt.sig
    if not verify(key, SignatureKind.RECEIPT_COUNTERSIGN, payload, cr.client_sig):
        raise _bad("client countersignature does not verify", ErrorCode.AUTH_FAILED)


def check_response(
    request: ExpertRequest, response: ExpertResponse, *, client: bytes, server: bytes
) -> Receipt:
    """Check a decoded response against the request it answers; return its verified receipt.

    ``client`` and ``server`` are the peer IDs the handshake authenticated. Raises
    ``BadResponse``: code 4 for a mismatch, 5 for wrong output shape/dtype, 9 for a bad signature.
    """
    tokens, width = request.hidden.shape
    pairs = request.pairs
    if response.request_id != request.request_id:
        raise _bad("response answers another request")
    if response.outputs.shape != (pairs, width) or response.outputs.dtype != request.hidden.dtype:
        raise _bad(f"outputs are {response.outputs.dtype}{list(response.outputs.shape)}, expected "
                   f"{request.hidden.dtype}[{pairs}, {width}]", ErrorCode.BAD_TENSOR)
    r = response.receipt
    expected = {
        "request_id": request.request_id, "client": client, "server": server,
        "model_id": request.model_id, "layer": request.layer,
        "experts": tuple(int(e.expert) for e in request.experts), "tokens": tokens,
        "pairs": pairs, "seq": request.seq,
        "input_hash": input_hash(request.hidden, request.experts),
        "output_hash": output_hash(response.outputs),
    }
    for name, value in expected.items():
        if getattr(r, name) != value:
            raise _bad(f"receipt.{name} does not match the request")
    verify_receipt(r)
    return r
