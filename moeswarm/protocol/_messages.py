"""The typed messages of protocol v1 (see ``protocol_spec/README.md`` for each field).

Byte fields are ``bytes``; peer IDs are the 38 raw bytes (``peer_id_to_str`` for text).
Messages that hold numpy arrays compare by identity (``eq=False``): compare encodings.
Construction does not validate; ``decode`` does, and ``encode`` writes what it is given.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, TypeAlias

import numpy as np

BlockRanges: TypeAlias = tuple[tuple[tuple[int, int], tuple[int, int]], ...]
"""Blocks as announced: ``((first layer, last layer), (first expert, last expert))`` each, inclusive."""


@dataclass(frozen=True, slots=True)
class Hello:
    """Client -> server, first frame of a data-plane connection."""

    TYPE: ClassVar[str] = "hello"
    versions: tuple[int, ...]  # protocol versions the client speaks, strictly ascending
    peer_id: bytes  # client's peer ID (38 bytes)
    public_key: bytes  # client's Ed25519 public key (32 bytes)
    nonce: bytes  # 32 fresh random bytes


@dataclass(frozen=True, slots=True)
class HelloAck:
    """Server -> client: chosen version, server identity, and the server's transcript signature."""

    TYPE: ClassVar[str] = "hello_ack"
    version: int  # the highest version both sides speak
    peer_id: bytes  # server's peer ID (38 bytes)
    public_key: bytes  # server's Ed25519 public key (32 bytes)
    nonce: bytes  # 32 fresh random bytes
    sig: bytes  # server's signature over the auth transcript (64 bytes)


@dataclass(frozen=True, slots=True)
class Auth:
    """Client -> server: the client's signature over the auth transcript."""

    TYPE: ClassVar[str] = "auth"
    sig: bytes  # 64 bytes


@dataclass(frozen=True, slots=True, eq=False)
class ExpertRows:
    """One expert of a request and the hidden rows routed to it."""

    expert: int  # expert index within the layer
    rows: np.ndarray  # (n,) uint32, strictly ascending indices into ExpertRequest.hidden


@dataclass(frozen=True, slots=True, eq=False)
class ExpertRequest:
    """Client -> server: all tokens and experts of one MoE layer that this server holds."""

    TYPE: ClassVar[str] = "expert_request"
    request_id: bytes  # 16 bytes, unique per client
    model_id: str
    layer: int  # MoE layer index (the model's layer numbering)
    seq: int  # per (client, server) pair, never reused; copied into the receipt
    hidden: np.ndarray  # (N, H) f32/f16/bf16, the distinct token rows
    experts: tuple[ExpertRows, ...]  # distinct experts, in the order outputs come back
    deadline_ms: int | None = None  # budget from arrival to start of compute, milliseconds
    signed: bool = False  # v1.3: ask for a signed receipt in the response, not in a later receipt_batch
    pairs: int = field(init=False, repr=False)  # P, the (expert, token) pairs = rows of the response

    def __post_init__(self) -> None:
        object.__setattr__(self, "pairs", sum(len(e.rows) for e in self.experts))  # read ~5 times a call


@dataclass(frozen=True, slots=True)
class Receipt:
    """Server-signed statement of one served request (nested in ``ExpertResponse``)."""

    request_id: bytes  # 16 bytes
    client: bytes  # client's peer ID, as authenticated by the handshake
    server: bytes  # server's peer ID; its key verifies ``sig``
    model_id: str
    layer: int
    experts: tuple[int, ...]  # expert ids in request order
    tokens: int  # N, rows of hidden
    pairs: int  # P, rows of outputs
    expert_flops: int  # floating-point operations spent in expert FFNs (2 per multiply-add)
    input_hash: bytes  # SHA-256, see ``input_hash``
    output_hash: bytes  # SHA-256 of the canonical outputs tensor map
    time_ms: int  # unix time the response was produced, milliseconds
    seq: int  # the request's seq
    sig: bytes = b""  # server's signature (64 bytes)


@dataclass(frozen=True, slots=True)
class CountersignedReceipt:
    """A receipt the client checked and countersigned, as submitted to the ledger."""

    TYPE: ClassVar[str] = "countersigned_receipt"
    receipt: Receipt
    client_sig: bytes  # client's signature over the receipt body + server sig (64 bytes)


@dataclass(frozen=True, slots=True, eq=False)
class ExpertResponse:
    """Server -> client: unweighted expert outputs, one row per (expert, token) pair."""

    TYPE: ClassVar[str] = "expert_response"
    request_id: bytes
    outputs: np.ndarray  # (P, H), same dtype as the request's hidden
    receipt: Receipt | None  # the signed receipt; None (v1.3): it comes in a later ``ReceiptBatch``
    compute_us: int  # server's measured compute time for this request, microseconds
    load_permille: int  # server's current load, 0 (idle) .. 1000 (saturated)


@dataclass(frozen=True, slots=True)
class BatchStatement:
    """What a server signs for a batch of receipts (v1.3): ``count`` receipts of calls from
    ``client`` to ``server``, whose Merkle root (``protocol.receipt_root``) is ``root``."""

    client: bytes  # the client's peer ID: every receipt of the batch names it
    server: bytes  # the server's peer ID: every receipt names it, its key verifies ``sig``
    count: int  # receipts in the batch, 1 .. MAX_BATCH_RECEIPTS
    root: bytes  # 32 bytes
    sig: bytes = b""  # the server's signature (64 bytes)


@dataclass(frozen=True, slots=True)
class ReceiptBatch:
    """Server -> client (v1.3): the receipts of calls answered without one, signed together once."""

    TYPE: ClassVar[str] = "receipt_batch"
    statement: BatchStatement
    receipts: tuple[Receipt, ...]  # ``sig`` empty: the statement's signature covers them all


@dataclass(frozen=True, slots=True)
class BatchedReceipt:
    """One receipt of a countersigned batch, as submitted to the ledger (v1.3): the receipt, the
    signed statement, where the receipt sits in it and the Merkle path that proves it."""

    TYPE: ClassVar[str] = "batched_receipt"
    receipt: Receipt  # ``sig`` empty
    statement: BatchStatement
    index: int  # the receipt's leaf, 0 .. count - 1
    path: tuple[bytes, ...]  # sibling hashes, leaf level first
    client_sig: bytes  # the client's countersignature of the statement (64 bytes)


@dataclass(frozen=True, slots=True)
class Error:
    """Either direction: a failure with a code from ``ErrorCode``."""

    TYPE: ClassVar[str] = "error"
    code: int
    message: str
    request_id: bytes | None = None  # the request it answers, when it answers one


@dataclass(frozen=True, slots=True)
class Ping:
    """Either direction: keepalive and link probe (RTT; with ``pad``/``want``, bandwidth each way)."""

    TYPE: ClassVar[str] = "ping"
    ts: int  # opaque to the receiver; the sender's clock, e.g. monotonic microseconds
    pad: bytes = b""  # filler carried to the receiver: times the sender -> receiver direction
    want: int = 0  # filler bytes asked back in the Pong: times the receiver -> sender direction


@dataclass(frozen=True, slots=True)
class Pong:
    """Answer to ``Ping``, echoing its ``ts`` (and carrying the ``want`` bytes of filler asked for)."""

    TYPE: ClassVar[str] = "pong"
    ts: int
    pad: bytes = b""


@dataclass(frozen=True, slots=True)
class WeightsRequest:
    """Client -> server: rows ``[start, stop)`` of one tensor of one expert the server holds."""

    TYPE: ClassVar[str] = "weights_request"
    request_id: bytes  # 16 random bytes
    model_id: str
    layer: int
    expert: int
    tensor: str  # "gate", "up", "down", or "gate_bias", "up_bias", "down_bias" where the model has them
    start: int  # first row
    stop: int  # one past the last row; stop > start


@dataclass(frozen=True, slots=True, eq=False)
class WeightsResponse:
    """Server -> client: the rows asked for, in the server's storage dtype (quantised ones as f32)."""

    TYPE: ClassVar[str] = "weights_response"
    request_id: bytes
    data: np.ndarray  # (stop - start, columns), or (stop - start,) for a bias


@dataclass(frozen=True, slots=True)
class ConfigRequest:
    """Client -> server: the config.json of a model the server holds (v1.3; the swarm catalogue)."""

    TYPE: ClassVar[str] = "config_request"
    request_id: bytes  # 16 random bytes
    model_id: str


@dataclass(frozen=True, slots=True)
class ConfigResponse:
    """Server -> client: the bytes the model id hashes (its config.json), at most ``MAX_CONFIG_BYTES``."""

    TYPE: ClassVar[str] = "config_response"
    request_id: bytes
    config: bytes


@dataclass(frozen=True, slots=True)
class Announcement:
    """Signed DHT record: this peer serves these experts at these endpoints."""

    TYPE: ClassVar[str] = "announcement"
    model_id: str
    layers: tuple[int, int]  # first, last MoE layer held, inclusive
    experts: tuple[int, int]  # first, last expert held in each of those layers, inclusive
    endpoints: tuple[str, ...]  # data-plane URLs, preferred first
    capacity_bytes: int  # memory offered for expert weights in total, bytes
    throughput: int  # measured (expert, token) pairs per second
    load_permille: int  # 0 (idle) .. 1000 (saturated)
    software: str  # implementation name and version, e.g. "moeswarm/0.1.0"
    seq: int  # increases with every new record from this peer
    expires_at_ms: int  # unix milliseconds after which the record is void
    peer_id: bytes
    public_key: bytes
    sig: bytes = b""
    more_blocks: BlockRanges = ()  # further (layers, experts)
    # blocks one node process serves beside the first (``layers`` x ``experts``); at most
    # ``MAX_BLOCKS - 1``, each a rectangle like the first; absent on the wire when empty

    def blocks(self) -> BlockRanges:
        """Every (layers, experts) block this record claims, the first one first."""
        return ((self.layers, self.experts), *self.more_blocks)

    def covers_layer(self, layer: int) -> bool:
        return any(lo <= layer <= hi for (lo, hi), _ in self.blocks())


Message = (
    Hello
    | HelloAck
    | Auth
    | ExpertRequest
    | ExpertResponse
    | Error
    | Ping
    | Pong
    | WeightsRequest
    | WeightsResponse
    | ConfigRequest
    | ConfigResponse
    | CountersignedReceipt
    | ReceiptBatch
    | BatchedReceipt
    | Announcement
)
"""Every top-level object ``encode`` and ``decode`` handle."""
