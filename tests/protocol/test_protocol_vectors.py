"""The published vectors: up to date, and each one checked against an independent oracle
where one exists (RFC 8032, libp2p, struct, hashlib, cryptography)."""

from __future__ import annotations

import asyncio
import hashlib
import struct
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from moeswarm import protocol as p
from moeswarm.errors import ProtocolError
from moeswarm.protocol._wire import unpack

VECTORS = Path(__file__).resolve().parents[2] / "protocol_spec" / "vectors"
MESSAGE_FILES = sorted(path.name for path in (VECTORS / "messages").glob("*.json"))

# RFC 8032 section 7.1, TEST 1 and TEST 2: seed -> public key
RFC8032 = {
    "9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60":
        "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a",
    "4ccd089b28ff96da9db6c346ec114e0f5b8a319f35aba624da8cf6ed4fb8a6fb":
        "3d4017c3e843895a92b70aa74d1b7ebc9c982ccf2ec4968cc0cd55f12af4660c",
}


def test_files_are_up_to_date(generator: ModuleType) -> None:
    for name, content in generator.build().items():
        assert (VECTORS / name).read_text(encoding="utf-8") == generator.render(content), name
    assert len(MESSAGE_FILES) >= 10


@pytest.mark.parametrize("name", MESSAGE_FILES)
def test_message_vector_round_trips(name: str, load_vector: Callable[[str], Any],
                                    generator: ModuleType) -> None:
    v = load_vector(f"messages/{name}")
    body = bytes.fromhex(v["body_hex"])
    assert bytes.fromhex(v["frame_hex"]) == struct.pack(">I", len(body)) + body
    msg = p.decode(body)
    assert msg.TYPE == v["type"]
    assert p.encode(msg) == body
    assert p.frame(msg).hex() == v["frame_hex"]
    wire = generator.from_json(v["wire"])
    assert unpack(body) == wire
    assert p.canonical(wire) == body


def test_identity_vectors_match_rfc8032_and_libp2p(load_vector: Callable[[str], Any]) -> None:
    from libp2p.crypto.ed25519 import Ed25519PublicKey as Libp2pKey
    from libp2p.peer.id import ID

    for v in load_vector("identity.json"):
        assert RFC8032[v["seed_hex"]] == v["public_key_hex"]
        key = Libp2pKey.from_bytes(bytes.fromhex(v["public_key_hex"]))
        assert key.serialize().hex() == v["public_key_protobuf_hex"]
        pid = ID.from_pubkey(key)
        assert pid.to_bytes().hex() == v["peer_id_hex"]
        assert pid.to_base58() == v["peer_id_base58"]
        assert v["peer_id_base58"].startswith("12D3KooW")


def test_canonical_vectors(load_vector: Callable[[str], Any], generator: ModuleType) -> None:
    cases = {c["name"]: c for c in load_vector("canonical.json")}
    for case in cases.values():
        assert p.canonical(generator.from_json(case["value"])).hex() == case["canonical_hex"]
    # independent spot checks, written by hand from the msgpack specification
    assert cases["uint boundaries"]["canonical_hex"].startswith("9a007fcc80ccffcd0100cdffffce00010000")
    assert cases["negative int boundaries"]["canonical_hex"].startswith("99ffe0d0dfd080d1ff7fd18000")
    keys = cases["map keys sorted by UTF-8 bytes"]["canonical_hex"]
    assert keys == "86a14204a16102a2616103a16201a17a06a2c3a905"


def _bf16_bits(x: float) -> bytes:
    return struct.pack("<f", x)[2:]  # exact for values representable in bf16


def test_tensor_vectors(load_vector: Callable[[str], Any]) -> None:
    packers = {
        "f32": lambda xs: struct.pack(f"<{len(xs)}f", *xs),
        "f16": lambda xs: struct.pack(f"<{len(xs)}e", *xs),
        "bf16": lambda xs: b"".join(_bf16_bits(x) for x in xs),
    }
    seen = set()
    for v in load_vector("tensors.json"):
        data = bytes.fromhex(v["data_hex"])
        assert data == packers[v["dtype"]](v["values"])
        canonical = bytes.fromhex(v["canonical_hex"])
        assert hashlib.sha256(canonical).hexdigest() == v["sha256_hex"]
        arr = p.tensor_from_wire(unpack(canonical))
        assert list(arr.shape) == v["shape"]
        assert arr.astype(np.float64).reshape(-1).tolist() == v["values"]
        assert p.tensor_hash(arr).hex() == v["sha256_hex"]
        seen.add(v["dtype"])
    assert seen == {"f32", "f16", "bf16"}


def test_signature_vectors(load_vector: Callable[[str], Any]) -> None:
    cases = load_vector("signatures.json")
    assert {c["kind"] for c in cases} == {"auth", "receipt", "receipt-countersign", "announcement",
                                          "receipt-batch", "receipt-batch-countersign"}
    for c in cases:
        signed = bytes.fromhex(c["signed_bytes_hex"])
        expected = (b"moeswarm/v1/" + c["kind"].encode() + b"\0"
                    + bytes.fromhex(c["canonical_body_hex"]) + bytes.fromhex(c["suffix_hex"]))
        assert signed == expected
        key = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(c["signer_seed_hex"]))
        sig = bytes.fromhex(c["signature_hex"])
        assert key.sign(signed) == sig  # Ed25519 is deterministic
        public = key.public_key()
        public.verify(sig, signed)
        with pytest.raises(InvalidSignature):
            public.verify(sig, signed[:-1] + bytes([signed[-1] ^ 1]))
        with pytest.raises(InvalidSignature):
            public.verify(bytes([sig[0] ^ 1]) + sig[1:], signed)
        raw = public.public_bytes_raw()
        assert p.peer_id_to_str(p.peer_id_from_public_key(raw)) == c["signer_peer_id"]
        payload = signed[len(b"moeswarm/v1/" + c["kind"].encode() + b"\0"):]
        assert p.verify(raw, c["kind"], payload, sig)
        assert not p.verify(raw, c["kind"], payload + b"\0", sig)
        assert not p.verify(raw, "other", payload, sig)


def test_hash_vectors(load_vector: Callable[[str], Any]) -> None:
    v = load_vector("hashes.json")
    assert hashlib.sha256(bytes.fromhex(v["input_hash_preimage_hex"])).hexdigest() == v["input_hash_hex"]
    assert hashlib.sha256(bytes.fromhex(v["output_hash_preimage_hex"])).hexdigest() == v["output_hash_hex"]
    request = p.decode(bytes.fromhex(load_vector("messages/expert_request.json")["body_hex"]))
    response = p.decode(bytes.fromhex(load_vector("messages/expert_response.json")["body_hex"]))
    assert isinstance(request, p.ExpertRequest) and isinstance(response, p.ExpertResponse)
    assert p.input_hash(request.hidden, request.experts).hex() == v["input_hash_hex"]
    assert response.receipt.input_hash.hex() == v["input_hash_hex"]
    assert response.receipt.output_hash.hex() == v["output_hash_hex"]


def _body_cases(load_vector: Callable[[str], Any]) -> list[dict[str, Any]]:
    return [c for c in load_vector("invalid.json") if "body_hex" in c]


def test_invalid_bodies_rejected_with_their_code(load_vector: Callable[[str], Any]) -> None:
    cases = _body_cases(load_vector)
    assert len(cases) > 30
    for c in cases:
        with pytest.raises(ProtocolError) as info:
            p.decode(bytes.fromhex(c["body_hex"]))
        assert info.value.code == c["code"], (c["name"], str(info.value))


def test_invalid_frame_headers_rejected_with_their_code(load_vector: Callable[[str], Any]) -> None:
    cases = [c for c in load_vector("invalid.json") if "frame_hex" in c]
    assert len(cases) == 2

    async def run(c: dict[str, Any]) -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(bytes.fromhex(c["frame_hex"]))  # no body and no EOF: must not wait
        with pytest.raises(ProtocolError) as info:
            await asyncio.wait_for(p.read_frame(reader, max_size=c["max_frame"]), 1.0)
        assert info.value.code == c["code"]

    for c in cases:
        asyncio.run(run(c))


def test_forward_compat_vectors(load_vector: Callable[[str], Any]) -> None:
    for c in load_vector("forward_compat.json"):
        msg = p.decode(bytes.fromhex(c["body_hex"]))
        assert p.encode(msg).hex() == c["reencoded_hex"], c["name"]


def test_record_vectors(load_vector: Callable[[str], Any]) -> None:
    v = load_vector("records.json")
    server = load_vector("identity.json")[1]
    assert v["announcement_key"] == v["provider_key"] + "/" + server["peer_id_base58"]
    assert v["provider_key"] == "/moeswarm/v1/example-org/tiny-moe/L3"
    codes = set()
    for c in v["cases"]:
        stored = bytes.fromhex(c["stored_hex"]) if c["stored_hex"] else None
        value = bytes.fromhex(c["value_hex"])
        if c["code"] is None:
            record = p.validate_record(c["key"], value, stored, now_ms=c["now_ms"])
            assert p.encode(record) == value
        else:
            with pytest.raises(ProtocolError) as info:
                p.validate_record(c["key"], value, stored, now_ms=c["now_ms"])
            assert info.value.code == c["code"], (c["name"], str(info.value))
            codes.add(c["code"])
    assert codes == {3, 4, 9, 14, 15}


def test_catalogue_vectors(load_vector: Callable[[str], Any]) -> None:
    """The swarm catalogue's entries (``protocol_spec`` section 13): each case's verdict and code."""
    import hashlib

    from moeswarm.net.catalogue import CatalogueEntry, validate_catalogue
    from moeswarm.net.records import validate_any

    v = load_vector("catalogue.json")
    server = load_vector("identity.json")[1]
    assert v["provider_key"] == "/moeswarm/v1/catalogue"
    assert v["entry_key"] == v["provider_key"] + "/" + server["peer_id_base58"]
    entry = CatalogueEntry.decode(bytes.fromhex(v["entry_hex"]))
    config = bytes.fromhex(v["config_hex"])
    assert entry.models[0].config_digest == hashlib.sha256(config).digest()
    assert entry.models[0].model_id == "mixtral-" + hashlib.sha256(config).hexdigest()[:12]
    codes = set()
    for c in v["cases"]:
        stored = bytes.fromhex(c["stored_hex"]) if c["stored_hex"] else None
        value = bytes.fromhex(c["value_hex"])
        if c["code"] is None:
            assert validate_catalogue(c["key"], value, stored, now_ms=c["now_ms"]).encode() == value
        else:
            with pytest.raises(ProtocolError) as info:
                validate_catalogue(c["key"], value, stored, now_ms=c["now_ms"])
            assert info.value.code == c["code"], (c["name"], str(info.value))
            codes.add(c["code"])
    assert codes == {3, 4, 9, 14, 15}
    # the DHT's validator routes catalogue keys to this rule (a current entry: the vectors' clock is in 2023)
    with pytest.raises(ProtocolError) as info:
        validate_any(v["entry_key"], bytes.fromhex(v["entry_hex"]))
    assert info.value.code == 15
