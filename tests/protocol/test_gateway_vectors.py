"""protocol_spec/gateway.md's vectors (protocol_spec/vectors/gateway.json), checked against independent
code: msgpack (canonical = sorted keys, smallest encodings), hashlib's SHA-256 and the
cryptography package's Ed25519, not against moeswarm's own encoder; and each record case's
verdict and code through moeswarm's validator."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path
from typing import Any

import msgpack
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from moeswarm.errors import ProtocolError
from moeswarm.protocol import b58decode

VECTORS = Path(__file__).resolve().parents[2] / "protocol_spec" / "vectors"


def _vectors() -> dict[str, Any]:
    return dict(json.loads((VECTORS / "gateway.json").read_text()))


def _public_key(peer_id: str) -> Ed25519PublicKey:
    raw = b58decode(peer_id)  # identity multihash of the libp2p protobuf key: its last 32 bytes are the key
    assert raw[:6] == bytes.fromhex("002408011220")
    return Ed25519PublicKey.from_public_bytes(raw[6:])


def _canonical(value: dict[str, Any]) -> bytes:
    return msgpack.packb(dict(sorted(value.items())), use_bin_type=True)


def _signed(encoded: bytes, kind: str, peer_id: str, sig_hex: str, payload_hex: str) -> dict[str, Any]:
    """The map of ``encoded``; its body (without sig) is what ``peer_id`` signed under ``kind``."""
    value = msgpack.unpackb(encoded, raw=False)
    assert encoded == _canonical(value)
    body = _canonical({k: v for k, v in value.items() if k != "sig"})
    payload = f"moeswarm/v1/{kind}".encode() + b"\x00" + body
    assert payload.hex() == payload_hex and value["sig"].hex() == sig_hex
    _public_key(peer_id).verify(value["sig"], payload)  # raises InvalidSignature
    return dict(value)


def test_the_vectors_file_is_what_the_generator_writes() -> None:
    spec = importlib.util.spec_from_file_location("gateway_generate", VECTORS / "gateway_generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert json.dumps(module.build(), indent=1) + "\n" == (VECTORS / "gateway.json").read_text()


def test_gateway_record_authorization_and_usage_under_independent_code() -> None:
    v = _vectors()
    rec = v["gateway_record"]
    record = _signed(bytes.fromhex(rec["value_hex"]), "gateway", v["gateway_peer_id"], rec["sig_hex"],
                     rec["signed_payload_hex"])
    assert rec["key"] == "/moeswarm/v1/gateway/" + v["gateway_peer_id"]
    assert (record["type"], record["url"], record["price_per_token"], record["free_slots"]) == (
        "gateway", "https://gw.example.org:8443", 2, 13)

    a = v["spending_authorization"]
    auth = _signed(bytes.fromhex(a["encoded_hex"]), "spending-authorization", v["person_peer_id"], a["sig_hex"],
                   a["signed_payload_hex"])
    body = bytes.fromhex(a["body_hex"])
    assert hashlib.sha256(b"moeswarm/v1/spending-authorization-id\x00" + body).hexdigest() == a["id_hex"]
    assert b58decode(v["gateway_peer_id"]) == auth["gateway"] and b58decode(v["person_peer_id"]) == auth["person"]

    u = v["gateway_usage"]
    usage = _signed(bytes.fromhex(u["encoded_hex"]), "gateway-usage", v["person_peer_id"], u["sig_hex"],
                    u["signed_payload_hex"])
    assert usage["authorization"].hex() == a["id_hex"]
    assert u["credits"] == usage["tokens"] * auth["price_per_token"] <= auth["max_credits"]
    assert msgpack.unpackb(bytes.fromhex(v["charge_request_hex"])) == {
        "authorization": bytes.fromhex(a["encoded_hex"]), "usage": bytes.fromhex(u["encoded_hex"])}


def test_gateway_record_cases_get_their_verdict_and_code() -> None:
    from moeswarm.net.gateways import validate_gateway

    codes = set()
    for c in _vectors()["gateway_record"]["cases"]:
        stored = bytes.fromhex(c["stored_hex"]) if c["stored_hex"] else None
        value = bytes.fromhex(c["value_hex"])
        if c["code"] is None:
            assert validate_gateway(c["key"], value, stored, now_ms=c["now_ms"]).encode() == value
            continue
        with pytest.raises(ProtocolError) as info:
            validate_gateway(c["key"], value, stored, now_ms=c["now_ms"])
        assert info.value.code == c["code"], (c["name"], str(info.value))
        codes.add(c["code"])
    assert codes == {4, 9, 14, 15}
