"""The one codec: messages <-> canonical msgpack frame bodies, with full validation on decode.

``decode`` turns any bytes into a message or raises ``ProtocolError`` carrying the spec's
error code; it never raises anything else.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from operator import index
from typing import Any, Final

import numpy as np

from moeswarm.errors import ConfigError, ProtocolError

from ._identity import is_peer_id
from ._limits import (
    EXPERT_TENSORS,
    HASH_SIZE,
    LOAD_SCALE,
    MAX_BATCH_RECEIPTS,
    MAX_BLOCKS,
    MAX_CONFIG_BYTES,
    MAX_ENDPOINT_BYTES,
    MAX_ENDPOINTS,
    MAX_ERROR_MESSAGE_BYTES,
    MAX_EXPERT,
    MAX_EXPERTS_PER_REQUEST,
    MAX_LAYER,
    MAX_MODEL_ID_BYTES,
    MAX_PROBE_BYTES,
    MAX_SOFTWARE_BYTES,
    MAX_VERSIONS,
    NONCE_SIZE,
    PUBLIC_KEY_SIZE,
    REQUEST_ID_SIZE,
    SIGNATURE_SIZE,
    U32_MAX,
    U64_MAX,
    ErrorCode,
)
from ._messages import (
    Announcement,
    Auth,
    BatchedReceipt,
    BatchStatement,
    BlockRanges,
    ConfigRequest,
    ConfigResponse,
    CountersignedReceipt,
    Error,
    ExpertRequest,
    ExpertResponse,
    ExpertRows,
    Hello,
    HelloAck,
    Message,
    Ping,
    Pong,
    Receipt,
    ReceiptBatch,
    WeightsRequest,
    WeightsResponse,
)
from ._merkle import path_length
from ._tensor import tensor_from_wire, tensor_to_wire
from ._wire import DEFAULT_LIMITS, DecodeLimits, Fields, bad, check_text, check_uint, pack, sorted_map, unpack

MODEL_ID_RE: Final = re.compile(r"[A-Za-z0-9._@+-]+(?:/[A-Za-z0-9._@+-]+)*")
ENDPOINT_RE: Final = re.compile(r"[a-z][a-z0-9+.-]*://[\x21-\x7e]+")
SOFTWARE_RE: Final = re.compile(r"[\x20-\x7e]*")
U16_MAX: Final = 2**16 - 1
_U32: Final = np.dtype("<u4")


# ---------------------------------------------------------------- shared field helpers


def _u(value: Any) -> int:
    """An int for the wire: any integer type (not float) within uint64, else ``ConfigError``."""
    v = index(value)
    if not 0 <= v <= U64_MAX:
        raise ConfigError(f"{v} is outside the uint64 range")
    return v


def _peer(f: Fields, name: str) -> bytes:
    value = f.bin(name)
    if not is_peer_id(value):
        bad(f"{name} is not an Ed25519 peer ID")
    return value


def _model_id(f: Fields) -> str:
    return f.text("model_id", max_bytes=MAX_MODEL_ID_BYTES, pattern=MODEL_ID_RE)


def _range(f: Fields, name: str, hi: int = U32_MAX) -> tuple[int, int]:
    items = f.array(name, lo=2, hi=2)
    first = check_uint(items[0], f"{name}[0]", hi=hi)
    last = check_uint(items[1], f"{name}[1]", hi=hi)
    if first > last:
        bad(f"{name} = [{first}, {last}] is empty")
    return first, last


# ---------------------------------------------------------------- handshake, control


def _enc_hello(m: Hello) -> dict[str, Any]:
    return {"nonce": m.nonce, "peer_id": m.peer_id, "public_key": m.public_key,
            "versions": [_u(v) for v in m.versions]}


def _dec_hello(f: Fields) -> Hello:
    raw = f.array("versions", lo=1, hi=MAX_VERSIONS)
    versions = tuple(check_uint(v, "versions[]", lo=1, hi=U16_MAX) for v in raw)
    if any(a >= b for a, b in zip(versions, versions[1:])):
        bad("versions must be strictly ascending")
    return Hello(versions, _peer(f, "peer_id"), f.bin("public_key", size=PUBLIC_KEY_SIZE),
                 f.bin("nonce", size=NONCE_SIZE))


def _enc_hello_ack(m: HelloAck) -> dict[str, Any]:
    return {"nonce": m.nonce, "peer_id": m.peer_id, "public_key": m.public_key, "sig": m.sig,
            "version": _u(m.version)}


def _dec_hello_ack(f: Fields) -> HelloAck:
    return HelloAck(f.uint("version", lo=1, hi=U16_MAX), _peer(f, "peer_id"),
                    f.bin("public_key", size=PUBLIC_KEY_SIZE), f.bin("nonce", size=NONCE_SIZE),
                    f.bin("sig", size=SIGNATURE_SIZE))


def _enc_auth(m: Auth) -> dict[str, Any]:
    return {"sig": m.sig}


def _dec_auth(f: Fields) -> Auth:
    return Auth(f.bin("sig", size=SIGNATURE_SIZE))


def _enc_error(m: Error) -> dict[str, Any]:
    out: dict[str, Any] = {"code": _u(m.code), "message": m.message}
    if m.request_id is not None:
        out["request_id"] = m.request_id
    return out


def _dec_error(f: Fields) -> Error:
    return Error(f.uint("code", hi=U32_MAX), f.text("message", max_bytes=MAX_ERROR_MESSAGE_BYTES),
                 f.opt_bin("request_id", size=REQUEST_ID_SIZE))


def _enc_ping(m: Ping) -> dict[str, Any]:
    out: dict[str, Any] = {"ts": _u(m.ts)}
    if m.pad:  # optional fields are written only when used: a plain ping is the same bytes as ever
        out["pad"] = m.pad
    if m.want:
        out["want"] = _u(m.want)
    return out


def _enc_pong(m: Pong) -> dict[str, Any]:
    out: dict[str, Any] = {"ts": _u(m.ts)}
    if m.pad:
        out["pad"] = m.pad
    return out


def _dec_ping(f: Fields) -> Ping:
    pad = f.bin("pad", max_size=MAX_PROBE_BYTES) if f.has("pad") else b""
    return Ping(f.uint("ts"), pad, f.opt_uint("want", hi=MAX_PROBE_BYTES) or 0)


def _dec_pong(f: Fields) -> Pong:
    return Pong(f.uint("ts"), f.bin("pad", max_size=MAX_PROBE_BYTES) if f.has("pad") else b"")


# ---------------------------------------------------------------- weight fetching


def _enc_weights_request(m: WeightsRequest) -> dict[str, Any]:
    return {"expert": _u(m.expert), "layer": _u(m.layer), "model_id": m.model_id, "request_id": m.request_id,
            "start": _u(m.start), "stop": _u(m.stop), "tensor": m.tensor}


def _dec_weights_request(f: Fields) -> WeightsRequest:
    tensor = f.text("tensor", max_bytes=16)
    if tensor not in EXPERT_TENSORS:
        bad(f"tensor must be one of {list(EXPERT_TENSORS)}")
    start, stop = f.uint("start", hi=U32_MAX), f.uint("stop", lo=1, hi=U32_MAX)
    if stop <= start:
        bad(f"rows [{start}, {stop}) are empty")
    return WeightsRequest(f.bin("request_id", size=REQUEST_ID_SIZE), _model_id(f), f.uint("layer", hi=U32_MAX),
                          f.uint("expert", hi=U32_MAX), tensor, start, stop)


def _enc_weights_response(m: WeightsResponse) -> dict[str, Any]:
    return {"data": tensor_to_wire(m.data), "request_id": m.request_id}


def _dec_weights_response(f: Fields) -> WeightsResponse:
    request_id = f.bin("request_id", size=REQUEST_ID_SIZE)
    data = tensor_from_wire(f.raw("data"), "data", allow_bytes=True)  # u8: quantised weights as stored
    if data.ndim > 2 or data.shape[0] < 1:
        bad("data must be rows of a matrix or of a bias vector", ErrorCode.BAD_TENSOR)
    return WeightsResponse(request_id, data)


# ---------------------------------------------------------------- model configs (v1.3)


def _enc_config_request(m: ConfigRequest) -> dict[str, Any]:
    return {"model_id": m.model_id, "request_id": m.request_id}


def _dec_config_request(f: Fields) -> ConfigRequest:
    return ConfigRequest(f.bin("request_id", size=REQUEST_ID_SIZE), _model_id(f))


def _enc_config_response(m: ConfigResponse) -> dict[str, Any]:
    return {"config": m.config, "request_id": m.request_id}


def _dec_config_response(f: Fields) -> ConfigResponse:
    return ConfigResponse(f.bin("request_id", size=REQUEST_ID_SIZE), f.bin("config", max_size=MAX_CONFIG_BYTES))


# ---------------------------------------------------------------- expert calls


def rows_bytes(rows: np.ndarray) -> bytes:
    if type(rows) is np.ndarray and rows.dtype == _U32 and rows.ndim == 1:  # as decoded or as dispatch makes them
        return rows.tobytes()
    arr = np.asarray(rows)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ConfigError("ExpertRows.rows must be a 1-D integer array")
    return arr.astype("<u4").tobytes()


def _enc_expert_request(m: ExpertRequest) -> dict[str, Any]:
    out: dict[str, Any] = {
        "experts": [{"expert": _u(e.expert), "rows": rows_bytes(e.rows)} for e in m.experts],
        "hidden": tensor_to_wire(m.hidden),
        "layer": _u(m.layer),
        "model_id": m.model_id,
        "request_id": m.request_id,
        "seq": _u(m.seq),
    }
    if m.deadline_ms is not None:
        out["deadline_ms"] = _u(m.deadline_ms)
    if m.signed:  # v1.3; absent (not false) otherwise, so v1.2 encodings are unchanged
        out["signed"] = True
    return out


_ROW0: Final = np.zeros(1, _U32)
_ROW0.setflags(write=False)


def _dec_rows(f: Fields, tokens: int, covered: np.ndarray) -> np.ndarray:
    raw = f.bin("rows")
    if tokens == 1 and raw == b"\0\0\0\0":  # a decode step's one row: the only valid rows there
        covered[0] = True
        return _ROW0
    if not 4 <= len(raw) <= 4 * tokens or len(raw) % 4:
        bad(f"rows must be 1..{tokens} little-endian uint32 values")
    rows = np.frombuffer(raw, dtype="<u4")
    if rows[-1] >= tokens or (rows.size > 1 and not np.all(rows[1:] > rows[:-1])):
        bad(f"rows must be strictly ascending indices below {tokens}")
    covered[rows] = True
    return rows


def _dec_expert_request(f: Fields) -> ExpertRequest:
    request_id = f.bin("request_id", size=REQUEST_ID_SIZE)
    hidden = tensor_from_wire(f.raw("hidden"), "hidden", rank=2)  # (N, H)
    tokens, width = hidden.shape
    if tokens < 1 or width < 1:
        bad("hidden must be at least 1 x 1", ErrorCode.BAD_TENSOR)
    covered = np.zeros(tokens, dtype=bool)
    experts: list[ExpertRows] = []
    seen: set[int] = set()
    for i, item in enumerate(f.array("experts", lo=1, hi=MAX_EXPERTS_PER_REQUEST)):
        g = Fields(item, f"experts[{i}]")
        expert = g.uint("expert", hi=U32_MAX)
        if expert in seen:
            bad(f"expert {expert} appears twice")
        seen.add(expert)
        experts.append(ExpertRows(expert, _dec_rows(g, tokens, covered)))
    if not covered.all():
        bad("every row of hidden must be routed to at least one expert")
    signed = f.raw("signed") if f.has("signed") else False
    if type(signed) is not bool:
        bad("signed is not a boolean")
    return ExpertRequest(request_id, _model_id(f), f.uint("layer", hi=U32_MAX), f.uint("seq"),
                         hidden, tuple(experts), f.opt_uint("deadline_ms", lo=1, hi=U32_MAX), signed)


def receipt_body(r: Receipt) -> dict[str, Any]:
    """The fields of a receipt that both signatures cover (everything but ``sig``), written in
    canonical key order (made on every call by both sides: no sort; tests check the order)."""
    return {
        "client": r.client, "expert_flops": _u(r.expert_flops),
        "experts": [_u(e) for e in r.experts], "input_hash": r.input_hash,
        "layer": _u(r.layer), "model_id": r.model_id, "output_hash": r.output_hash,
        "pairs": _u(r.pairs), "request_id": r.request_id, "seq": _u(r.seq),
        "server": r.server, "time_ms": _u(r.time_ms), "tokens": _u(r.tokens),
    }


def _enc_receipt(r: Receipt) -> dict[str, Any]:
    return sorted_map({**receipt_body(r), "sig": r.sig})


def _dec_receipt(f: Fields, *, signed: bool = True) -> Receipt:
    """A receipt map; ``signed=False``: one of a batch (v1.3), which has no ``sig``."""
    raw = f.array("experts", lo=1, hi=MAX_EXPERTS_PER_REQUEST)
    experts = tuple(check_uint(e, "receipt.experts[]", hi=U32_MAX) for e in raw)
    if len(set(experts)) != len(experts):
        bad("receipt.experts repeats an expert")
    tokens = f.uint("tokens", lo=1, hi=U32_MAX)
    pairs = f.uint("pairs", lo=len(experts), hi=tokens * len(experts))
    return Receipt(
        f.bin("request_id", size=REQUEST_ID_SIZE), _peer(f, "client"), _peer(f, "server"),
        _model_id(f), f.uint("layer", hi=U32_MAX), experts, tokens, pairs, f.uint("expert_flops"),
        f.bin("input_hash", size=HASH_SIZE), f.bin("output_hash", size=HASH_SIZE),
        f.uint("time_ms"), f.uint("seq"), f.bin("sig", size=SIGNATURE_SIZE) if signed else b"",
    )


def _enc_expert_response(m: ExpertResponse) -> dict[str, Any]:
    out = {"compute_us": _u(m.compute_us), "load_permille": _u(m.load_permille),
           "outputs": tensor_to_wire(m.outputs), "request_id": m.request_id}
    if m.receipt is not None:  # v1.3: absent when a receipt_batch will carry it
        out["receipt"] = _enc_receipt(m.receipt)
    return out


def _dec_expert_response(f: Fields) -> ExpertResponse:
    request_id = f.bin("request_id", size=REQUEST_ID_SIZE)
    outputs = tensor_from_wire(f.raw("outputs"), "outputs", rank=2)  # (P, H)
    if outputs.shape[0] < 1 or outputs.shape[1] < 1:
        bad("outputs must be at least 1 x 1", ErrorCode.BAD_TENSOR)
    receipt = _dec_receipt(f.map("receipt")) if f.has("receipt") else None
    if receipt is not None and receipt.request_id != request_id:
        bad("receipt.request_id differs from request_id")
    if receipt is not None and receipt.pairs != outputs.shape[0]:
        bad(f"receipt.pairs = {receipt.pairs} but outputs has {outputs.shape[0]} rows")
    return ExpertResponse(request_id, outputs, receipt, f.uint("compute_us"),
                          f.uint("load_permille", hi=LOAD_SCALE))


def _enc_countersigned(m: CountersignedReceipt) -> dict[str, Any]:
    return {"client_sig": m.client_sig, "receipt": _enc_receipt(m.receipt)}


def _dec_countersigned(f: Fields) -> CountersignedReceipt:
    return CountersignedReceipt(_dec_receipt(f.map("receipt")), f.bin("client_sig", size=SIGNATURE_SIZE))


# ---------------------------------------------------------------- receipt batches (v1.3)


def statement_body(st: BatchStatement) -> dict[str, Any]:
    """The fields of a batch statement both batch signatures cover (everything but ``sig``)."""
    return sorted_map({"client": st.client, "count": _u(st.count), "root": st.root, "server": st.server})


def _enc_statement(st: BatchStatement) -> dict[str, Any]:
    return sorted_map({**statement_body(st), "sig": st.sig})


def _dec_statement(f: Fields) -> BatchStatement:
    return BatchStatement(_peer(f, "client"), _peer(f, "server"), f.uint("count", lo=1, hi=MAX_BATCH_RECEIPTS),
                          f.bin("root", size=HASH_SIZE), f.bin("sig", size=SIGNATURE_SIZE))


def _same_parties(receipt: Receipt, st: BatchStatement, where: str) -> None:
    if receipt.client != st.client or receipt.server != st.server:
        bad(f"{where} names another client or server than the batch statement")


def _enc_receipt_batch(m: ReceiptBatch) -> dict[str, Any]:
    return {"receipts": [receipt_body(r) for r in m.receipts], "statement": _enc_statement(m.statement)}


def _dec_receipt_batch(f: Fields) -> ReceiptBatch:
    st = _dec_statement(f.map("statement"))
    raw = f.array("receipts", lo=1, hi=MAX_BATCH_RECEIPTS)
    if len(raw) != st.count:
        bad(f"the statement counts {st.count} receipts, the batch holds {len(raw)}")
    receipts = tuple(_dec_receipt(Fields(item, f"receipts[{i}]"), signed=False) for i, item in enumerate(raw))
    ids = set()
    for i, r in enumerate(receipts):
        _same_parties(r, st, f"receipts[{i}]")
        ids.add(r.request_id)
    if len(ids) != len(receipts):
        bad("a request id appears twice in one batch")
    return ReceiptBatch(st, receipts)


def _enc_batched(m: BatchedReceipt) -> dict[str, Any]:
    return {"client_sig": m.client_sig, "index": _u(m.index), "path": list(m.path),
            "receipt": receipt_body(m.receipt), "statement": _enc_statement(m.statement)}


def _dec_batched(f: Fields) -> BatchedReceipt:
    st = _dec_statement(f.map("statement"))
    index = f.uint("index", hi=st.count - 1)
    raw = f.array("path", lo=0, hi=64)
    if len(raw) != path_length(index, st.count):
        bad(f"leaf {index} of {st.count} has a path of {path_length(index, st.count)} hashes, not {len(raw)}")
    for i, h in enumerate(raw):
        if type(h) is not bytes or len(h) != HASH_SIZE:
            bad(f"path[{i}] is not {HASH_SIZE} bytes")
    receipt = _dec_receipt(f.map("receipt"), signed=False)
    _same_parties(receipt, st, "receipt")
    return BatchedReceipt(receipt, st, index, tuple(raw), f.bin("client_sig", size=SIGNATURE_SIZE))


# ---------------------------------------------------------------- DHT record


def announcement_body(a: Announcement) -> dict[str, Any]:
    """The fields of an announcement its signature covers: its wire map without ``sig``
    (``more_blocks`` only when there are any, so a one-block record reads as it always did)."""
    more = {"more_blocks": [[_u(L[0]), _u(L[1]), _u(E[0]), _u(E[1])] for L, E in a.more_blocks]} if a.more_blocks else {}
    return sorted_map({**more,
        "capacity_bytes": _u(a.capacity_bytes), "endpoints": list(a.endpoints),
        "experts": [_u(a.experts[0]), _u(a.experts[1])],
        "expires_at_ms": _u(a.expires_at_ms),
        "layers": [_u(a.layers[0]), _u(a.layers[1])],
        "load_permille": _u(a.load_permille), "model_id": a.model_id, "peer_id": a.peer_id,
        "public_key": a.public_key, "seq": _u(a.seq), "software": a.software,
        "throughput": _u(a.throughput), "type": Announcement.TYPE,
    })


def _enc_announcement(a: Announcement) -> dict[str, Any]:
    return {**announcement_body(a), "sig": a.sig}


def _more_blocks(f: Fields) -> BlockRanges:
    if not f.has("more_blocks"):
        return ()
    out = []
    for i, item in enumerate(f.array("more_blocks", lo=1, hi=MAX_BLOCKS - 1)):
        name = f"more_blocks[{i}]"
        if type(item) is not list or len(item) != 4:
            bad(f"{name} is not [first layer, last layer, first expert, last expert]")
        l0, l1 = (check_uint(v, name, hi=MAX_LAYER) for v in item[:2])
        e0, e1 = (check_uint(v, name, hi=MAX_EXPERT) for v in item[2:])
        if l0 > l1 or e0 > e1:
            bad(f"{name} = {item} is empty")
        out.append(((l0, l1), (e0, e1)))
    return tuple(out)


def _disjoint(blocks: BlockRanges) -> None:
    """A record claims each expert once: overlapping blocks would count one holder as several."""
    for i, ((a0, a1), (b0, b1)) in enumerate(blocks):
        for (c0, c1), (d0, d1) in blocks[:i]:
            if a0 <= c1 and c0 <= a1 and b0 <= d1 and d0 <= b1:
                bad(f"announcement block {i} overlaps an earlier one")


def _dec_announcement(f: Fields) -> Announcement:
    raw = f.array("endpoints", lo=1, hi=MAX_ENDPOINTS)
    endpoints = tuple(check_text(e, "endpoints[]", max_bytes=MAX_ENDPOINT_BYTES, pattern=ENDPOINT_RE)
                      for e in raw)
    layers, experts, more = _range(f, "layers", MAX_LAYER), _range(f, "experts", MAX_EXPERT), _more_blocks(f)
    _disjoint(((layers, experts), *more))
    return Announcement(
        _model_id(f), layers, experts, endpoints,
        f.uint("capacity_bytes"), f.uint("throughput"), f.uint("load_permille", hi=LOAD_SCALE),
        f.text("software", max_bytes=MAX_SOFTWARE_BYTES, pattern=SOFTWARE_RE),
        f.uint("seq"), f.uint("expires_at_ms"), _peer(f, "peer_id"),
        f.bin("public_key", size=PUBLIC_KEY_SIZE), f.bin("sig", size=SIGNATURE_SIZE), more,
    )


# ---------------------------------------------------------------- dispatch

_ENCODERS: Final[dict[type, Callable[[Any], dict[str, Any]]]] = {
    Hello: _enc_hello, HelloAck: _enc_hello_ack, Auth: _enc_auth, Error: _enc_error,
    Ping: _enc_ping, Pong: _enc_pong, ExpertRequest: _enc_expert_request,
    WeightsRequest: _enc_weights_request, WeightsResponse: _enc_weights_response,
    ConfigRequest: _enc_config_request, ConfigResponse: _enc_config_response,
    ExpertResponse: _enc_expert_response, CountersignedReceipt: _enc_countersigned,
    ReceiptBatch: _enc_receipt_batch, BatchedReceipt: _enc_batched, Announcement: _enc_announcement,
}
_DECODERS: Final[dict[str, Callable[[Fields], Message]]] = {
    Hello.TYPE: _dec_hello, HelloAck.TYPE: _dec_hello_ack, Auth.TYPE: _dec_auth,
    Error.TYPE: _dec_error, Ping.TYPE: _dec_ping, Pong.TYPE: _dec_pong,
    WeightsRequest.TYPE: _dec_weights_request, WeightsResponse.TYPE: _dec_weights_response,
    ConfigRequest.TYPE: _dec_config_request, ConfigResponse.TYPE: _dec_config_response,
    ExpertRequest.TYPE: _dec_expert_request, ExpertResponse.TYPE: _dec_expert_response,
    CountersignedReceipt.TYPE: _dec_countersigned, Announcement.TYPE: _dec_announcement,
    ReceiptBatch.TYPE: _dec_receipt_batch, BatchedReceipt.TYPE: _dec_batched,
}


def to_wire(msg: Message) -> dict[str, Any]:
    """The wire map of a message, keys in canonical order, ``type`` included."""
    encoder = _ENCODERS.get(type(msg))
    if encoder is None:
        raise ConfigError(f"{type(msg).__name__} is not a protocol message")
    try:
        fields = encoder(msg)
    except (TypeError, IndexError) as exc:
        raise ConfigError(f"cannot encode {type(msg).__name__}: {exc}") from exc
    return sorted_map({**fields, "type": msg.TYPE})


def encode(msg: Message) -> bytes:
    """The canonical msgpack frame body of ``msg`` (no length prefix)."""
    return pack(to_wire(msg))


def decode(body: bytes, limits: DecodeLimits = DEFAULT_LIMITS) -> Message:
    """Parse and validate one frame body; ``ProtocolError`` with the spec's code otherwise.

    ``limits`` bounds what the body may contain (``DecodeLimits``), checked before decoding."""
    obj = unpack(body, limits)
    if type(obj) is not dict:
        raise ProtocolError("a frame body must be a msgpack map", code=ErrorCode.MALFORMED_FRAME)
    kind = obj.get("type")
    if type(kind) is not str:
        raise ProtocolError("frame has no string 'type'", code=ErrorCode.MALFORMED_FRAME)
    decoder = _DECODERS.get(kind)
    if decoder is None:
        raise ProtocolError(f"unknown message type {kind[:64]!r}", code=ErrorCode.UNKNOWN_MESSAGE)
    return decoder(Fields(obj, kind))


def peek_request_id(body: bytes) -> bytes | None:
    """The ``request_id`` of a frame body that failed to decode, if one can be read from it."""
    try:
        obj = unpack(body)
    except ProtocolError:
        return None
    if type(obj) is dict:
        rid = obj.get("request_id")
        if type(rid) is bytes and len(rid) == REQUEST_ID_SIZE:
            return rid
    return None
