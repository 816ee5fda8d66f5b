"""Receipts: signed by the server, checked against the request, countersigned by the client."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from moeswarm import protocol as p
from moeswarm.errors import BadResponse, ConfigError

CLIENT = p.Identity.from_seed(bytes(range(32)))
SERVER = p.Identity.from_seed(bytes(range(32, 64)))
OTHER = p.Identity.from_seed(bytes(range(64, 96)))
E = p.ErrorCode


def _request() -> p.ExpertRequest:
    hidden = np.arange(12, dtype=np.float32).reshape(3, 4).astype(ml_dtypes.bfloat16)  # (3, 4)
    experts = (p.ExpertRows(7, np.array([0, 2])), p.ExpertRows(2, np.array([1])))
    return p.ExpertRequest(b"q" * 16, "org/m", 5, 11, hidden, experts, 50)


def _serve(request: p.ExpertRequest) -> p.ExpertResponse:
    outputs = np.ones((request.pairs, 4), dtype=ml_dtypes.bfloat16)  # (P, H)
    receipt = p.make_receipt(SERVER, request, outputs, client=CLIENT.peer_id, expert_flops=999,
                             time_ms=1_700_000_000_000)
    return p.ExpertResponse(request.request_id, outputs, receipt, 120, 300)


def _wire_round_trip(response: p.ExpertResponse) -> p.ExpertResponse:
    got = p.decode(p.encode(response))
    assert isinstance(got, p.ExpertResponse)
    return got


def test_good_response_checks_and_countersigns() -> None:
    request = _request()
    response = _wire_round_trip(_serve(request))
    receipt = p.check_response(request, response, client=CLIENT.peer_id, server=SERVER.peer_id)
    assert (receipt.tokens, receipt.pairs, receipt.experts, receipt.seq) == (3, 3, (7, 2), 11)
    cs = p.countersign(CLIENT, receipt)
    got = p.decode(p.encode(cs))
    assert isinstance(got, p.CountersignedReceipt)
    p.verify_countersigned(got)


def test_hashes_follow_the_spec_independently() -> None:
    request = _request()
    response = _serve(request)
    out = response.outputs
    tensor = (b"\x83\xa4data\xc4" + bytes([out.nbytes]) + out.tobytes() + b"\xa5dtype\xa4bf16"
              + b"\xa5shape\x92\x03\x04")
    assert response.receipt.output_hash == hashlib.sha256(tensor).digest()
    hidden = request.hidden
    experts = (b"\x92\x82\xa6expert\x07\xa4rows\xc4\x08" + np.array([0, 2], "<u4").tobytes()
               + b"\x82\xa6expert\x02\xa4rows\xc4\x04" + np.array([1], "<u4").tobytes())
    hidden_map = (b"\x83\xa4data\xc4\x18" + hidden.tobytes() + b"\xa5dtype\xa4bf16"
                  + b"\xa5shape\x92\x03\x04")
    preimage = b"\x82\xa7experts" + experts + b"\xa6hidden" + hidden_map
    assert response.receipt.input_hash == hashlib.sha256(preimage).digest()


@pytest.mark.parametrize(
    ("field", "value", "code"),
    [
        ("seq", 12, E.BAD_FIELD),
        ("layer", 6, E.BAD_FIELD),
        ("experts", (2, 7), E.BAD_FIELD),
        ("client", OTHER.peer_id, E.BAD_FIELD),
        ("server", OTHER.peer_id, E.BAD_FIELD),
        ("output_hash", bytes(32), E.BAD_FIELD),
        ("expert_flops", 10**9, E.AUTH_FAILED),  # not checkable here, but the signature breaks
        ("time_ms", 1, E.AUTH_FAILED),
    ],
)
def test_tampered_receipt_rejected(field: str, value: Any, code: int) -> None:
    request = _request()
    response = _serve(request)
    bad = replace(response, receipt=replace(response.receipt, **{field: value}))
    with pytest.raises(BadResponse) as info:
        p.check_response(request, bad, client=CLIENT.peer_id, server=SERVER.peer_id)
    assert info.value.code == code


def test_flipped_signature_byte_fails() -> None:
    receipt = _serve(_request()).receipt
    p.verify_receipt(receipt)
    for i in (0, 31, 63):
        sig = bytearray(receipt.sig)
        sig[i] ^= 0x01
        with pytest.raises(BadResponse) as info:
            p.verify_receipt(replace(receipt, sig=bytes(sig)))
        assert info.value.code == E.AUTH_FAILED


def test_wrong_outputs_rejected() -> None:
    request = _request()
    response = _serve(request)
    other = np.full((3, 4), 2, dtype=ml_dtypes.bfloat16)
    with pytest.raises(BadResponse) as info:  # same shape, other values: the hash catches it
        p.check_response(request, replace(response, outputs=other), client=CLIENT.peer_id,
                         server=SERVER.peer_id)
    assert info.value.code == E.BAD_FIELD
    for outputs in (np.ones((2, 4), ml_dtypes.bfloat16), np.ones((3, 4), np.float32)):
        with pytest.raises(BadResponse) as info:
            p.check_response(request, replace(response, outputs=outputs), client=CLIENT.peer_id,
                             server=SERVER.peer_id)
        assert info.value.code == E.BAD_TENSOR
    with pytest.raises(BadResponse):
        p.check_response(request, replace(response, request_id=b"x" * 16), client=CLIENT.peer_id,
                         server=SERVER.peer_id)


def test_countersignature_binds_client_and_server_signature() -> None:
    receipt = _serve(_request()).receipt
    with pytest.raises(ConfigError):
        p.countersign(OTHER, receipt)
    cs = p.countersign(CLIENT, receipt)
    forged = p.CountersignedReceipt(receipt, OTHER.sign("receipt-countersign", b"x"))
    with pytest.raises(BadResponse) as info:
        p.verify_countersigned(forged)
    assert info.value.code == E.AUTH_FAILED
    # the client's signature covers the server's: swapping in another valid-looking receipt fails
    other_receipt = replace(receipt, sig=bytes(64))
    with pytest.raises(BadResponse):
        p.verify_countersigned(replace(cs, receipt=other_receipt))
