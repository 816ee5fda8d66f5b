"""Wire protocol v1 of moeswarm: the Python binding of ``protocol_spec/README.md``.

Messages are frozen dataclasses; ``encode``/``decode`` convert them to and from canonical
msgpack frame bodies; ``decode`` validates everything and raises ``ProtocolError`` (with an
``ErrorCode``) for anything else. No networking here: the data plane and the libp2p adapter
build on these pieces.
"""

from ._codec import decode, encode, peek_request_id, receipt_body, statement_body, announcement_body, to_wire
from ._framing import frame, frame_body, parse_frame_header, read_frame, read_message, write_message
from ._handshake import ClientHandshake, ServerHandshake, auth_transcript
from ._identity import (
    Identity,
    b58decode,
    b58encode,
    is_peer_id,
    peer_id_from_public_key,
    peer_id_from_str,
    peer_id_to_str,
    public_key_from_peer_id,
    signing_payload,
    verify,
    verify_body,
)
from ._limits import (
    BATCHED_RECEIPTS_VERSION,
    DEFAULT_MAX_FRAME,
    MAX_BATCH_RECEIPTS,
    MAX_BLOCKS,
    MAX_CONFIG_BYTES,
    EXPERT_TENSORS,
    FATAL_CODES,
    MAX_EXPERT,
    MAX_HANDSHAKE_FRAME,
    MAX_LAYER,
    MAX_PROBE_BYTES,
    PROTOCOL_VERSION,
    SUPPORTED_VERSIONS,
    ErrorCode,
    SignatureKind,
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
from ._receipts import (
    batch_proof_holds,
    batched_problem,
    check_outputs,
    check_receipt,
    check_response,
    countersign,
    countersign_batch,
    receipt_leaf,
    sign_batch,
    statement_problem,
    input_hash,
    expert_call_flops,
    make_receipt,
    output_hash,
    verify_countersigned,
    verify_receipt,
    verify_record,
)
from ._records import (
    DHT_NAMESPACE,
    announcement_key,
    parse_announcement_key,
    provider_key,
    DHT,
    read_announcements,
    select_record,
    sign_announcement,
    validate_record,
    verify_announcement,
)
from ._tensor import WIRE_DTYPES, tensor_from_wire, tensor_hash, tensor_to_wire
from ._wire import DecodeLimits, canonical, scan, unpack

__all__ = [
    # constants
    "PROTOCOL_VERSION", "SUPPORTED_VERSIONS", "BATCHED_RECEIPTS_VERSION", "MAX_BATCH_RECEIPTS", "DEFAULT_MAX_FRAME", "ErrorCode", "FATAL_CODES",
    "MAX_PROBE_BYTES", "MAX_BLOCKS", "MAX_CONFIG_BYTES", "EXPERT_TENSORS", "MAX_HANDSHAKE_FRAME", "MAX_LAYER", "MAX_EXPERT",
    "SignatureKind", "WIRE_DTYPES", "DHT_NAMESPACE",
    # messages
    "Message", "Hello", "HelloAck", "Auth", "ExpertRows", "ExpertRequest", "ExpertResponse",
    "Receipt", "CountersignedReceipt", "BatchStatement", "ReceiptBatch", "BatchedReceipt", "Error", "Ping", "Pong", "Announcement", "BlockRanges",
    "WeightsRequest", "WeightsResponse", "ConfigRequest", "ConfigResponse",
    # codec and framing
    "encode", "decode", "to_wire", "DecodeLimits", "unpack", "scan", "peek_request_id", "canonical", "receipt_body", "statement_body",
    "announcement_body", "frame", "frame_body", "parse_frame_header", "read_frame",
    "read_message", "write_message",
    # tensors
    "tensor_to_wire", "tensor_from_wire", "tensor_hash",
    # identity and signatures
    "Identity", "peer_id_from_public_key", "public_key_from_peer_id", "peer_id_to_str",
    "peer_id_from_str", "is_peer_id", "b58encode", "b58decode", "signing_payload", "verify",
    "verify_body",
    # handshake
    "ClientHandshake", "ServerHandshake", "auth_transcript",
    # receipts
    "expert_call_flops", "make_receipt", "verify_receipt", "countersign", "verify_countersigned", "check_response",
    "input_hash", "output_hash", "check_outputs", "check_receipt", "receipt_leaf", "sign_batch",
    "statement_problem", "countersign_batch", "batched_problem", "batch_proof_holds", "verify_record",
    # DHT records
    "provider_key", "announcement_key", "parse_announcement_key", "sign_announcement",
    "verify_announcement", "validate_record", "select_record", "DHT", "read_announcements",
]
