#!/usr/bin/env python3
"""Regenerate the protocol v1 test vectors beside this file, deterministically.

    python protocol_spec/vectors/generate.py           # rewrite the JSON files
    python protocol_spec/vectors/generate.py --check   # exit 1 if any file is out of date

Every value is fixed: the two keys are the RFC 8032 section 7.1 TEST 1 and TEST 2 seeds,
nonces and ids are counting bytes. msgpack values are written as "typed JSON": null, bool,
integer, string, array and object map to nil, bool, int, str, array and map; a bin is
{"$bin": "<hex>"} (the README, section "Test vectors", says more).
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from moeswarm import protocol as p  # noqa: E402
from moeswarm.protocol._wire import unpack  # noqa: E402
from moeswarm.net import catalogue as cat  # noqa: E402

CLIENT_SEED = bytes.fromhex("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60")
SERVER_SEED = bytes.fromhex("4ccd089b28ff96da9db6c346ec114e0f5b8a319f35aba624da8cf6ed4fb8a6fb")
CLIENT_NONCE = bytes(range(0x00, 0x20))
SERVER_NONCE = bytes(range(0x20, 0x40))
CHANNEL_BINDING = hashlib.sha256(b"moeswarm test vector certificate").digest()
REQUEST_ID = bytes(range(0xA0, 0xB0))
MODEL_ID = "example-org/tiny-moe"
NOW_MS = 1_700_000_000_000
CLIENT = p.Identity.from_seed(CLIENT_SEED)
SERVER = p.Identity.from_seed(SERVER_SEED)


# ---------------------------------------------------------------- typed JSON


def to_json(obj: Any) -> Any:
    """msgpack value -> typed JSON (bin becomes {"$bin": hex})."""
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return {"$bin": bytes(obj).hex()}
    if isinstance(obj, dict):
        return {k: to_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_json(v) for v in obj]
    return obj


def from_json(obj: Any) -> Any:
    """Typed JSON -> msgpack value."""
    if isinstance(obj, dict):
        if set(obj) == {"$bin"}:
            return bytes.fromhex(obj["$bin"])
        return {k: from_json(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_json(v) for v in obj]
    return obj


def _frame_hex(body: bytes) -> str:
    return (len(body).to_bytes(4, "big") + body).hex()


def _message_vector(name: str, msg: p.Message, note: str) -> dict[str, Any]:
    body = p.encode(msg)
    return {"name": name, "note": note, "type": msg.TYPE, "wire": to_json(unpack(body)),
            "body_hex": body.hex(), "frame_hex": _frame_hex(body)}


# ---------------------------------------------------------------- the scenario


def _identities() -> list[dict[str, Any]]:
    out = []
    for name, seed, ident in (("client", CLIENT_SEED, CLIENT), ("server", SERVER_SEED, SERVER)):
        out.append({"name": name, "seed_hex": seed.hex(), "public_key_hex": ident.public_key.hex(),
                    "public_key_protobuf_hex": ident.peer_id[2:].hex(),
                    "peer_id_hex": ident.peer_id.hex(), "peer_id_base58": ident.peer_id_str})
    return out


def _handshake(versions: tuple[int, ...] = (1,)) -> tuple[p.Hello, p.HelloAck, p.Auth]:
    """A v1.2 client's handshake (it offers version 1), or with ``versions=(1, 2)`` a v1.3 one's."""
    client = p.ClientHandshake(CLIENT, expected_server=SERVER.peer_id, versions=versions,
                               channel_binding=CHANNEL_BINDING, nonce=CLIENT_NONCE)
    server = p.ServerHandshake(SERVER, channel_binding=CHANNEL_BINDING, nonce=SERVER_NONCE)
    ack = server.receive_hello(client.hello)
    auth = client.receive_ack(ack)
    server.receive_auth(auth)
    return client.hello, ack, auth


def _request() -> p.ExpertRequest:
    hidden = np.array([[1.0, -2.0, 0.5, 0.25], [3.0, -0.125, 0.0, 8.0]], dtype=np.float32)  # (2, 4)
    experts = (p.ExpertRows(1, np.array([0, 1], dtype=np.uint32)),
               p.ExpertRows(6, np.array([1], dtype=np.uint32)))
    return p.ExpertRequest(REQUEST_ID, MODEL_ID, 3, 42, hidden, experts, deadline_ms=250)


def _request_bf16() -> p.ExpertRequest:
    hidden = np.array([[1.0, -1.5, 0.0078125, 3.140625]], dtype=ml_dtypes.bfloat16)  # (1, 4)
    experts = (p.ExpertRows(0, np.array([0], dtype=np.uint32)),)
    return p.ExpertRequest(bytes(range(0xB0, 0xC0)), MODEL_ID, 4, 43, hidden, experts)


def _response(request: p.ExpertRequest) -> p.ExpertResponse:
    outputs = np.array([[0.5, 1.0, -1.0, 2.0], [0.25, 0.0, 4.0, -0.5], [1.5, -2.5, 0.125, 1.0]],
                       dtype=np.float32)  # (3, 4): expert 1 x rows 0, 1; expert 6 x row 1
    receipt = p.make_receipt(SERVER, request, outputs, client=CLIENT.peer_id,
                             expert_flops=3 * 2 * 3 * 4 * 8, time_ms=NOW_MS + 123)
    return p.ExpertResponse(request.request_id, outputs, receipt, compute_us=850, load_permille=125)


def _batch() -> p.ReceiptBatch:
    """v1.3: the receipts of three calls answered without one (expert_response_batched and two
    more), signed together."""
    request = _request()
    outputs = _response(request).outputs
    receipts = []
    for i in range(3):
        call = replace(request, request_id=bytes(range(0xC0 + 16 * i, 0xD0 + 16 * i)), seq=44 + i)
        receipts.append(p.make_receipt(SERVER, call, outputs, client=CLIENT.peer_id, expert_flops=3 * 2 * 3 * 4 * 8,
                                       time_ms=NOW_MS + 200 + i, sign=False))
    return p.sign_batch(SERVER, CLIENT.peer_id, receipts)


def _announcement(**overrides: Any) -> p.Announcement:
    fields: dict[str, Any] = dict(
        model_id=MODEL_ID, layers=(2, 5), experts=(0, 15),
        endpoints=("tcp+tls://203.0.113.7:4443", "relay+wss://relay.example.net:443/"
                   + SERVER.peer_id_str),
        capacity_bytes=8 * 2**30, throughput=12000, load_permille=125, software="moeswarm/0.1.0",
        seq=7, expires_at_ms=NOW_MS + 600_000)
    fields.update(overrides)
    return p.sign_announcement(SERVER, **fields)


def _messages() -> dict[str, dict[str, Any]]:
    hello, ack, auth = _handshake()
    request, request_bf16 = _request(), _request_bf16()
    response = _response(request)
    countersigned = p.countersign(CLIENT, response.receipt)
    hello13, ack13, auth13 = _handshake((1, 2))
    batch = _batch()
    batched = p.countersign_batch(CLIENT, batch)
    first = replace(request, request_id=batch.receipts[0].request_id, seq=batch.receipts[0].seq)
    items: list[tuple[str, p.Message, str]] = [
        ("hello", hello, "client -> server; nonce = 00..1f"),
        ("hello_ack", ack, "server -> client; server nonce = 20..3f; sig over the 'server' "
                           "transcript with channel_binding = SHA-256('moeswarm test vector certificate')"),
        ("auth", auth, "client -> server; sig over the 'client' transcript"),
        ("expert_request", request, "f32 hidden (2, 4); expert 1 takes rows 0, 1 and expert 6 row 1"),
        ("expert_request_bf16", request_bf16, "bf16 hidden (1, 4), no deadline"),
        ("expert_response", response, "answers expert_request: outputs (3, 4) in request order"),
        ("countersigned_receipt", countersigned, "the client's countersignature of that receipt"),
        ("error", p.Error(p.ErrorCode.UNKNOWN_EXPERT, "expert 6 of layer 3 is not served here",
                          REQUEST_ID), "request-level error"),
        ("error_connection", p.Error(p.ErrorCode.AUTH_FAILED, "handshake signature does not verify"),
         "connection-level error, no request_id"),
        ("ping", p.Ping(1_234_567_890), "ts is opaque to the receiver"),
        ("pong", p.Pong(1_234_567_890), "echoes ping.ts"),
        ("ping_probe_up", p.Ping(1_234_567_891, bytes(16)), "link probe: 16 filler bytes to the receiver"),
        ("ping_probe_down", p.Ping(1_234_567_892, want=16), "link probe: asks for 16 filler bytes back"),
        ("pong_probe_down", p.Pong(1_234_567_892, bytes(16)), "answers ping_probe_down"),
        ("weights_request", p.WeightsRequest(REQUEST_ID, "tiny-moe", 3, 6, "gate", 0, 2),
         "rows 0..1 of expert 6's gate in layer 3"),
        ("weights_response", p.WeightsResponse(REQUEST_ID, np.arange(8, dtype="<f2").reshape(2, 4)),
         "answers weights_request: the rows in the holder's storage dtype (f16 here)"),
        ("announcement", _announcement(), "DHT value; also in records.json"),
        ("config_request", p.ConfigRequest(REQUEST_ID, "mixtral-e4bde7c04b4d"),
         "v1.3: the config the holder's model id hashes"),
        ("config_response", p.ConfigResponse(REQUEST_ID, CONFIG_BYTES),
         "answers config_request: the bytes whose SHA-256 the catalogue publishes"),
        ("hello_v1_3", hello13, "v1.3 client -> server: offers versions 1 and 2; nonce = 00..1f"),
        ("hello_ack_v1_3", ack13, "server -> client: version 2 (v1.3, receipts in batches) chosen"),
        ("expert_request_signed", replace(request, signed=True),
         "v1.3: asks for the signed receipt in the response, as in v1.2 (checks and evidence use it)"),
        ("expert_response_batched", replace(response, request_id=first.request_id, receipt=None),
         "v1.3: an answer without a receipt; receipt_batch's receipts[0] is its receipt"),
        ("receipt_batch", batch, "v1.3 server -> client: three receipts (request ids c0.., d0.., e0..), "
                                 "one signature over their statement"),
        ("batched_receipt", batched[1], "v1.3 ledger record: receipts[1] of receipt_batch, its Merkle path "
                                        "and the client's countersignature of the statement"),
    ]
    return {name: _message_vector(name, msg, note) for name, msg, note in items}


# ---------------------------------------------------------------- the other files


def _canonical_cases() -> list[dict[str, Any]]:
    cases: list[tuple[str, Any]] = [
        ("uint boundaries", [0, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1]),
        ("negative int boundaries", [-1, -32, -33, -128, -129, -32768, -32769, -(2**31), -(2**31) - 1]),
        ("bool and nil", [True, False, None]),
        ("str lengths", ["", "a" * 31, "b" * 32, "c" * 256]),
        ("bin lengths", [b"", b"\x00" * 255, b"\x01" * 256]),
        ("float64 always", [1.5, -0.0]),
        ("map keys sorted by UTF-8 bytes", {"b": 1, "a": 2, "aa": 3, "B": 4, "é": 5, "z": 6}),
        ("nested", {"outer": {"y": [1, {"k": b"\xff"}], "x": "text"}}),
        ("array of 16", list(range(16))),
    ]
    return [{"name": n, "value": to_json(v), "canonical_hex": p.canonical(v).hex()} for n, v in cases]


def _tensor_cases() -> list[dict[str, Any]]:
    arrays: list[tuple[str, np.ndarray]] = [
        ("f32", np.array([[1.0, -2.0, 0.5], [3.4028234663852886e38, -0.0, 1.401298464324817e-45]],
                         dtype=np.float32)),
        ("f16", np.array([1.0, -2.0, 65504.0, 6.103515625e-05, 5.960464477539063e-08, 0.333251953125],
                         dtype=np.float16)),
        ("bf16", np.array([[1.0, -1.5], [0.0078125, 3.140625], [3.3895313892515355e38, -0.0]],
                          dtype=ml_dtypes.bfloat16)),
    ]
    out = []
    for name, arr in arrays:
        wire = p.tensor_to_wire(arr)
        out.append({"name": name, "dtype": wire["dtype"], "shape": wire["shape"],
                    "values": [float(v) for v in arr.astype(np.float64).reshape(-1)],
                    "data_hex": bytes(wire["data"]).hex(), "canonical_hex": p.canonical(wire).hex(),
                    "sha256_hex": p.tensor_hash(arr).hex()})
    return out


def _signature_case(name: str, ident: p.Identity, kind: str, body: dict[str, Any],
                    suffix: bytes = b"") -> dict[str, Any]:
    payload = p.canonical(body) + suffix
    return {"name": name, "kind": kind, "signer_seed_hex": ident.seed().hex(),
            "signer_peer_id": ident.peer_id_str, "body": to_json(body),
            "canonical_body_hex": p.canonical(body).hex(), "suffix_hex": suffix.hex(),
            "signed_bytes_hex": p.signing_payload(kind, payload).hex(),
            "signature_hex": ident.sign(kind, payload).hex()}


def _signature_cases() -> list[dict[str, Any]]:
    hello, ack, _ = _handshake()
    request = _request()
    receipt = _response(request).receipt
    common: dict[str, Any] = dict(version=1, client_versions=hello.versions, client_peer=CLIENT.peer_id,
                  server_peer=SERVER.peer_id, client_nonce=CLIENT_NONCE, server_nonce=SERVER_NONCE,
                  channel_binding=CHANNEL_BINDING)
    return [
        _signature_case("auth, server role", SERVER, "auth", p.auth_transcript(role="server", **common)),
        _signature_case("auth, client role", CLIENT, "auth", p.auth_transcript(role="client", **common)),
        _signature_case("receipt", SERVER, "receipt", p.receipt_body(receipt)),
        _signature_case("receipt countersignature", CLIENT, "receipt-countersign",
                        p.receipt_body(receipt), suffix=receipt.sig),
        _signature_case("announcement", SERVER, "announcement", p.announcement_body(_announcement())),
        _signature_case("receipt batch statement (v1.3)", SERVER, "receipt-batch",
                        p.statement_body(_batch().statement)),
        _signature_case("receipt batch countersignature (v1.3)", CLIENT, "receipt-batch-countersign",
                        p.statement_body(_batch().statement), suffix=_batch().statement.sig),
    ]


def _hashes() -> dict[str, Any]:
    request = _request()
    response = _response(request)
    return {"request": "expert_request",
            "input_hash_hex": p.input_hash(request.hidden, request.experts).hex(),
            "input_hash_preimage_hex": p.canonical({
                "experts": [{"expert": e.expert, "rows": e.rows.astype("<u4").tobytes()}
                            for e in request.experts],
                "hidden": p.tensor_to_wire(request.hidden)}).hex(),
            "output_hash_hex": p.output_hash(response.outputs).hex(),
            "output_hash_preimage_hex": p.canonical(p.tensor_to_wire(response.outputs)).hex(),
            "receipt_batch": _batch_hashes()}


def _batch_hashes() -> dict[str, Any]:
    """v1.3: the Merkle tree of receipt_batch's three receipts."""
    batch = _batch()
    bodies = [p.canonical(p.receipt_body(r)) for r in batch.receipts]
    leaves = [p.receipt_leaf(r) for r in batch.receipts]
    return {"batch": "receipt_batch", "leaf_tag": "moeswarm/v1/receipt-leaf\\0",
            "node_tag": "moeswarm/v1/receipt-node\\0",
            "bodies_hex": [b.hex() for b in bodies], "leaves_hex": [h.hex() for h in leaves],
            "root_hex": batch.statement.root.hex(),
            "paths_hex": [[h.hex() for h in b.path] for b in p.countersign_batch(CLIENT, batch)]}


def _body(wire: dict[str, Any], **changes: Any) -> bytes:
    """A frame body: ``wire`` with fields replaced (value ``...`` deletes), canonical order."""
    out = dict(wire)
    for k, v in changes.items():
        if v is ...:
            del out[k]
        else:
            out[k] = v
    return p.canonical(out)


def _rows(expert: int, rows_hex: str) -> dict[str, Any]:
    return {"expert": expert, "rows": bytes.fromhex(rows_hex)}


def _invalid_cases() -> list[dict[str, Any]]:
    E = p.ErrorCode
    hello = p.to_wire(_handshake()[0])
    req = p.to_wire(_request())
    resp = p.to_wire(_response(_request()))
    batch = p.to_wire(_batch())
    batched = p.to_wire(p.countersign_batch(CLIENT, _batch())[1])
    wreq = p.to_wire(p.WeightsRequest(REQUEST_ID, "tiny-moe", 3, 6, "gate", 0, 2))
    wresp = p.to_wire(p.WeightsResponse(REQUEST_ID, np.zeros((2, 4), "<f2")))
    t = dict(req["hidden"])
    nan32 = np.array([[1.0, np.nan, 0.0, 0.0], [0.0] * 4], dtype=np.float32).tobytes()
    inf16 = np.array([[1.0, 0.0, np.inf, 0.0]] * 2, dtype=np.float16).tobytes()
    nanbf = np.array([[1.0, 0.0, 0.0, np.nan]] * 2, dtype=ml_dtypes.bfloat16).tobytes()
    ping = p.encode(p.Ping(1))
    bodies: list[tuple[str, bytes, int]] = [
        ("empty body", b"", E.MALFORMED_FRAME),
        ("array, not a map", bytes.fromhex("92a474797065a470696e67"), E.MALFORMED_FRAME),
        ("trailing byte after the map", ping + b"\xc0", E.MALFORMED_FRAME),
        ("truncated map", ping[:-1], E.MALFORMED_FRAME),
        ("integer map key", bytes.fromhex("82a474797065a470696e6701c0"), E.MALFORMED_FRAME),
        ("duplicate key", bytes.fromhex("83a2747301a474797065a470696e67a2747302"), E.MALFORMED_FRAME),
        ("ext type in an unknown field", bytes.fromhex("83a178d40100a2747301a474797065a470696e67"),
         E.MALFORMED_FRAME),
        ("timestamp ext", bytes.fromhex("83a178d6ff00000001a2747301a474797065a470696e67"), E.MALFORMED_FRAME),
        ("invalid UTF-8 in a str", bytes.fromhex("82a2747301a474797065a4ffffffff"), E.MALFORMED_FRAME),
        ("no type field", bytes.fromhex("81a2747301"), E.MALFORMED_FRAME),
        ("type is not a str", bytes.fromhex("82a2747301a474797065c403706e67"), E.MALFORMED_FRAME),
        ("unknown type", _body(p.to_wire(p.Ping(1)), type="gossip"), E.UNKNOWN_MESSAGE),
        ("ping.ts missing", _body(p.to_wire(p.Ping(1)), ts=...), E.BAD_FIELD),
        ("ping.ts negative", _body(p.to_wire(p.Ping(1)), ts=-1), E.BAD_FIELD),
        ("ping.ts is a bool", _body(p.to_wire(p.Ping(1)), ts=True), E.BAD_FIELD),
        ("ping.ts is a float", _body(p.to_wire(p.Ping(1)), ts=1.0), E.BAD_FIELD),
        ("ping.want above 8 MiB", _body(p.to_wire(p.Ping(1)), want=8 * 2**20 + 1), E.BAD_FIELD),
        ("ping.pad is a str", _body(p.to_wire(p.Ping(1)), pad="x"), E.BAD_FIELD),
        ("config_request model_id with a space", _body(p.to_wire(p.ConfigRequest(REQUEST_ID, "a")), model_id="a b"),
         E.BAD_FIELD),
        ("config_response config above 256 KiB", _body(p.to_wire(p.ConfigResponse(REQUEST_ID, b"{}")),
                                                       config=bytes(256 * 1024 + 1)), E.BAD_FIELD),
        ("weights_request rows empty", _body(wreq, start=2, stop=2), E.BAD_FIELD),
        ("weights_request unknown tensor", _body(wreq, tensor="router"), E.BAD_FIELD),
        ("weights_request request_id 15 bytes", _body(wreq, request_id=bytes(15)), E.BAD_FIELD),
        ("weights_response data holds NaN", _body(wresp, data={**wresp["data"], "dtype": "f32",
                                                               "data": nan32}), E.NON_FINITE),
        ("hello.nonce missing", _body(hello, nonce=...), E.BAD_FIELD),
        ("hello.nonce is a str", _body(hello, nonce="0" * 32), E.BAD_FIELD),
        ("hello.nonce is 31 bytes", _body(hello, nonce=bytes(31)), E.BAD_FIELD),
        ("hello.versions not ascending", _body(hello, versions=[2, 1]), E.BAD_FIELD),
        ("hello.peer_id not Ed25519", _body(hello, peer_id=b"\x12\x20" + bytes(36)), E.BAD_FIELD),
        ("hidden.dtype f64", _body(req, hidden={**t, "dtype": "f64"}), E.BAD_TENSOR),
        ("hidden.data one byte short", _body(req, hidden={**t, "data": bytes(t["data"])[:-1]}), E.BAD_TENSOR),
        ("hidden rank 1", _body(req, hidden={**t, "shape": [8]}), E.BAD_TENSOR),
        ("hidden rank 9", _body(req, hidden={**t, "shape": [2, 4] + [1] * 7}), E.BAD_TENSOR),
        ("hidden.shape negative", _body(req, hidden={**t, "shape": [-2, -4]}), E.BAD_TENSOR),
        ("hidden is not a map", _body(req, hidden=bytes(t["data"])), E.BAD_TENSOR),
        ("hidden holds NaN (f32)", _body(req, hidden={**t, "data": nan32}), E.NON_FINITE),
        ("hidden holds Inf (f16)", _body(req, hidden={**t, "dtype": "f16", "data": inf16}),
         E.NON_FINITE),
        ("hidden holds NaN (bf16)", _body(req, hidden={**t, "dtype": "bf16", "data": nanbf}),
         E.NON_FINITE),
        ("row index out of range", _body(req, experts=[_rows(1, "0000000002000000")]), E.BAD_FIELD),
        ("rows not ascending", _body(req, experts=[_rows(1, "0100000000000000")]), E.BAD_FIELD),
        ("row 1 routed nowhere", _body(req, experts=[_rows(1, "00000000")]), E.BAD_FIELD),
        ("rows not a multiple of 4 bytes", _body(req, experts=[_rows(1, "0000000000")]), E.BAD_FIELD),
        ("expert twice", _body(req, experts=req["experts"] + [req["experts"][0]]), E.BAD_FIELD),
        ("no experts", _body(req, experts=[]), E.BAD_FIELD),
        ("model_id with a space", _body(req, model_id="tiny moe"), E.BAD_FIELD),
        ("deadline_ms zero", _body(req, deadline_ms=0), E.BAD_FIELD),
        ("receipt.pairs differs from outputs rows", _body(resp, receipt={**resp["receipt"], "pairs": 2}),
         E.BAD_FIELD),
        ("load_permille above 1000", _body(resp, load_permille=1001), E.BAD_FIELD),
        ("v1.3 signed is an integer", _body(req, signed=1), E.BAD_FIELD),
        ("v1.3 batch statement counts 2, holds 3", _body(batch, statement={**batch["statement"], "count": 2}),
         E.BAD_FIELD),
        ("v1.3 batch statement counts 0", _body(batch, statement={**batch["statement"], "count": 0}), E.BAD_FIELD),
        ("v1.3 batch repeats a receipt", _body(batch, receipts=batch["receipts"][:2] + batch["receipts"][:1]),
         E.BAD_FIELD),
        ("v1.3 batch receipt names another client",
         _body(batch, receipts=[{**batch["receipts"][0], "client": SERVER.peer_id}] + batch["receipts"][1:]),
         E.BAD_FIELD),
        ("v1.3 batched receipt path one hash short", _body(batched, path=batched["path"][:-1]), E.BAD_FIELD),
        ("v1.3 batched receipt index beyond count", _body(batched, index=3), E.BAD_FIELD),
    ]
    out: list[dict[str, Any]] = [{"name": n, "body_hex": b.hex(), "code": int(c)} for n, b, c in bodies]
    out += [
        {"name": "zero length prefix", "frame_hex": "00000000", "max_frame": p.DEFAULT_MAX_FRAME,
         "code": int(E.MALFORMED_FRAME)},
        {"name": "length prefix above the receiver's limit (1 MiB + 1); no body follows",
         "frame_hex": (2**20 + 1).to_bytes(4, "big").hex(), "max_frame": 2**20,
         "code": int(E.FRAME_TOO_LARGE)},
    ]
    return out


def _forward_compat() -> list[dict[str, Any]]:
    ping = p.to_wire(p.Ping(7))
    req = p.to_wire(_request())
    cases: list[tuple[str, dict[str, Any], Any]] = [
        ("unknown top-level field", {**ping, "zz_future": [1, {"a": b"\x00"}]}, p.Ping(7)),
        ("unknown nested fields", {**req, "priority": 3, "hidden": {**req["hidden"], "layout": "rows"},
                                   "experts": [{**e, "weight_hint": 1} for e in req["experts"]]}, _request()),
        ("optional field sent as nil", {**req, "deadline_ms": None}, None),
    ]
    out = []
    for name, wire, msg in cases:
        expected = p.encode(msg) if msg is not None else _body(req, deadline_ms=...)
        out.append({"name": name, "body_hex": p.canonical(wire).hex(), "reencoded_hex": expected.hex()})
    return out


def _records() -> dict[str, Any]:
    E = p.ErrorCode
    good = _announcement()
    key = p.announcement_key(MODEL_ID, 3, SERVER.peer_id)
    value = p.encode(good)
    forged = p.encode(replace(good, public_key=CLIENT.public_key))
    unsigned = replace(good, peer_id=CLIENT.peer_id, public_key=CLIENT.public_key, sig=b"")
    wrong_signer = p.encode(replace(unsigned, sig=SERVER.sign("announcement",
                                                              p.canonical(p.announcement_body(unsigned)))))
    client_key = p.announcement_key(MODEL_ID, 3, CLIENT.peer_id)
    flipped = bytearray(value)
    flipped[value.index(good.sig)] ^= 0x01
    several = p.encode(_announcement(more_blocks=[((9, 10), (2, 2))]))  # layers 2-5 x experts 0-15, and 9-10 x expert 2
    overlapping = p.encode(_announcement(more_blocks=[((5, 6), (7, 7))]))
    cases: list[tuple[str, str, bytes, bytes | None, int, int | None]] = [
        ("valid", key, value, None, NOW_MS, None),
        ("valid, newer than stored seq 6", key, value, p.encode(_announcement(seq=6)), NOW_MS, None),
        ("valid under the key of the last layer held", p.announcement_key(MODEL_ID, 5, SERVER.peer_id),
         value, None, NOW_MS, None),
        ("stored record has the same seq", key, value, value, NOW_MS, E.STALE),
        ("replay of an older seq", key, value, p.encode(_announcement(seq=8)), NOW_MS, E.STALE),
        ("stored newer record has expired: accepted", key, value,
         p.encode(_announcement(seq=9, expires_at_ms=NOW_MS + 1)), NOW_MS + 1, None),
        ("expired at now", key, value, None, NOW_MS + 600_000, E.EXPIRED),
        ("expires more than 24 h + 5 min ahead", key,
         p.encode(_announcement(expires_at_ms=NOW_MS + 86_700_001)), None, NOW_MS, E.BAD_FIELD),
        ("signature byte flipped", key, bytes(flipped), None, NOW_MS, E.AUTH_FAILED),
        ("public key does not match peer_id", key, forged, None, NOW_MS, E.AUTH_FAILED),
        ("signed by a key other than the record's", client_key, wrong_signer, None, NOW_MS,
         E.AUTH_FAILED),
        ("key names another peer", client_key, value, None, NOW_MS, E.AUTH_FAILED),
        ("key layer outside the record", p.announcement_key(MODEL_ID, 6, SERVER.peer_id), value, None,
         NOW_MS, E.BAD_FIELD),
        ("key for another model", p.announcement_key("example-org/other", 3, SERVER.peer_id), value,
         None, NOW_MS, E.BAD_FIELD),
        ("malformed key", "/moeswarm/v1/" + MODEL_ID + "/3/" + SERVER.peer_id_str, value, None, NOW_MS,
         E.BAD_FIELD),
        ("not an announcement", key, p.encode(p.Ping(1)), None, NOW_MS, E.BAD_FIELD),
        ("larger than 8192 bytes", key, value + bytes(8192), None, NOW_MS, E.FRAME_TOO_LARGE),
        ("several blocks: valid under a layer of a further block", p.announcement_key(MODEL_ID, 9, SERVER.peer_id),
         several, None, NOW_MS, None),
        ("several blocks: key layer between the blocks", p.announcement_key(MODEL_ID, 7, SERVER.peer_id),
         several, None, NOW_MS, E.BAD_FIELD),
        ("several blocks that overlap", key, overlapping, None, NOW_MS, E.BAD_FIELD),
    ]
    return {
        "provider_key": p.provider_key(MODEL_ID, 3),
        "announcement_key": key,
        "record_hex": value.hex(),
        "cases": [{"name": n, "key": k, "value_hex": v.hex(), "stored_hex": s.hex() if s else None,
                   "now_ms": t, "code": None if c is None else int(c)} for n, k, v, s, t, c in cases],
    }


CONFIG_BYTES = b'{"model_type": "mixtral", "name": "tiny"}'


def _catalogue_entry(**overrides: Any) -> cat.CatalogueEntry:
    fields: dict[str, Any] = dict(
        models=[cat.CatalogueModel("mixtral-" + hashlib.sha256(CONFIG_BYTES).hexdigest()[:12],
                                   hashlib.sha256(CONFIG_BYTES).digest(), "tiny")],
        endpoints=["tcp+tls://203.0.113.7:4443"], seq=7, expires_at_ms=NOW_MS + 600_000)
    fields.update(overrides)
    return cat.sign_catalogue_entry(SERVER, **fields)


def _catalogue() -> dict[str, Any]:
    E = p.ErrorCode
    good = _catalogue_entry()
    key = cat.catalogue_key(SERVER.peer_id)
    value = good.encode()
    flipped = bytearray(value)
    flipped[value.index(good.sig)] ^= 0x01
    two = cat.CatalogueModel("custom-id", bytes(32), "")
    cases: list[tuple[str, str, bytes, bytes | None, int, int | None]] = [
        ("valid", key, value, None, NOW_MS, None),
        ("valid, newer than stored seq 6", key, value, _catalogue_entry(seq=6).encode(), NOW_MS, None),
        ("valid with a second model of a chosen id", key, _catalogue_entry(models=[*good.models, two]).encode(),
         None, NOW_MS, None),
        ("stored entry has the same seq", key, value, value, NOW_MS, E.STALE),
        ("expired at now", key, value, None, NOW_MS + 600_000, E.EXPIRED),
        ("expires more than 24 h + 5 min ahead", key, _catalogue_entry(expires_at_ms=NOW_MS + 86_700_001).encode(),
         None, NOW_MS, E.BAD_FIELD),
        ("signature byte flipped", key, bytes(flipped), None, NOW_MS, E.AUTH_FAILED),
        ("key names another peer", cat.catalogue_key(CLIENT.peer_id), value, None, NOW_MS, E.AUTH_FAILED),
        ("no models", key, _catalogue_entry(models=[]).encode(), None, NOW_MS, E.BAD_FIELD),
        ("nine models", key, _catalogue_entry(models=[cat.CatalogueModel(f"m{i}", bytes(32)) for i in range(9)])
         .encode(), None, NOW_MS, E.BAD_FIELD),
        ("a model named twice", key, _catalogue_entry(models=[two, two]).encode(), None, NOW_MS, E.BAD_FIELD),
        ("digest of 31 bytes", key, _catalogue_entry(models=[cat.CatalogueModel("m", bytes(31))]).encode(),
         None, NOW_MS, E.BAD_FIELD),
        ("name with a control character", key, _catalogue_entry(models=[cat.CatalogueModel("m", bytes(32), "a\nb")])
         .encode(), None, NOW_MS, E.BAD_FIELD),
        ("larger than 8192 bytes", key, value + bytes(8192), None, NOW_MS, E.FRAME_TOO_LARGE),
    ]
    return {
        "provider_key": cat.CATALOGUE_PROVIDER_KEY,
        "entry_key": key,
        "entry_hex": value.hex(),
        "config_hex": CONFIG_BYTES.hex(),
        "cases": [{"name": n, "key": k, "value_hex": v.hex(), "stored_hex": s.hex() if s else None,
                   "now_ms": t, "code": None if c is None else int(c)} for n, k, v, s, t, c in cases],
    }


def build() -> dict[str, Any]:
    """File name -> JSON content of every vector file."""
    files: dict[str, Any] = {
        "identity.json": _identities(),
        "canonical.json": _canonical_cases(),
        "tensors.json": _tensor_cases(),
        "signatures.json": _signature_cases(),
        "hashes.json": _hashes(),
        "invalid.json": _invalid_cases(),
        "forward_compat.json": _forward_compat(),
        "records.json": _records(),
        "catalogue.json": _catalogue(),
    }
    for name, vector in _messages().items():
        files[f"messages/{name}.json"] = vector
    return files


def render(content: Any) -> str:
    return json.dumps(content, indent=1, ensure_ascii=False) + "\n"


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = []
    for name, content in build().items():
        path = HERE / name
        text = render(content)
        if check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(name)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
    if stale:
        print("out of date: " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
