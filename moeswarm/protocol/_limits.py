"""Constants of protocol v1: versions, error codes, size limits, signature domains.

Every number here is normative: it is written down in ``protocol_spec/README.md``.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Final

PROTOCOL_VERSION: Final = 2
"""The highest version this module speaks: 2 is revision v1.3 of the spec (receipts signed in
batches, off the response path); 1 is v1.0-v1.2 (a signed receipt in every response)."""

SUPPORTED_VERSIONS: Final[tuple[int, ...]] = (1, 2)
"""Versions offered in ``Hello``, ascending."""

BATCHED_RECEIPTS_VERSION: Final = 2
"""The first handshake version whose responses may leave their receipt to a ``receipt_batch``."""

MAX_BATCH_RECEIPTS: Final = 1024
"""Receipts one ``receipt_batch`` may carry (about 250 bytes each: a quarter of the minimum frame limit)."""

DEFAULT_MAX_FRAME: Final = 64 * 1024 * 1024
"""Default largest frame body a receiver accepts, in bytes (configurable per receiver)."""

MIN_MAX_FRAME: Final = 1024 * 1024
"""A receiver must accept frame bodies of at least this many bytes."""

MAX_HANDSHAKE_FRAME: Final = 8192
"""Largest frame body a receiver reads before the peer has authenticated (``hello``, ``auth``,
``error``): a ``hello`` is under 200 bytes and an ``error`` under 4.2 KiB, so nothing a
stranger sends costs more than this."""

FRAME_HEADER_SIZE: Final = 4
"""The length prefix: unsigned 32-bit big-endian."""

U32_MAX: Final = 2**32 - 1
U64_MAX: Final = 2**64 - 1

PEER_ID_SIZE: Final = 38
PUBLIC_KEY_SIZE: Final = 32
SIGNATURE_SIZE: Final = 64
NONCE_SIZE: Final = 32
REQUEST_ID_SIZE: Final = 16
HASH_SIZE: Final = 32

MAX_VERSIONS: Final = 16
MAX_MODEL_ID_BYTES: Final = 128
MAX_EXPERTS_PER_REQUEST: Final = 65536
MAX_TENSOR_RANK: Final = 8
MAX_ERROR_MESSAGE_BYTES: Final = 4096
MAX_CHANNEL_BINDING_BYTES: Final = 64
MAX_ENDPOINTS: Final = 8
MAX_ENDPOINT_BYTES: Final = 256
MAX_SOFTWARE_BYTES: Final = 64
MAX_RECORD_BYTES: Final = 8192
MAX_BLOCKS: Final = 64
"""Blocks (layer range x expert range) one announcement may claim: the first and 63 more."""
MAX_RECORD_TTL_MS: Final = 24 * 3600 * 1000
"""An announcement may not expire more than this far in the future."""
CLOCK_SKEW_MS: Final = 5 * 60 * 1000
"""Tolerance added to ``MAX_RECORD_TTL_MS`` for clocks that disagree."""
MAX_PROBE_BYTES: Final = 8 * 1024 * 1024
"""Largest ``ping.pad`` and ``ping.want``: link probes stay well inside the minimum frame limit's 8x."""
MAX_CONFIG_BYTES: Final = 256 * 1024
"""Largest ``config_response.config``: a model's config.json (the largest known are under 16 KiB)."""
MAX_DECODE_DEPTH: Final = 8
"""Nesting of arrays and maps in one decoded body (v1 messages nest at most 4 deep)."""
MAX_DECODE_OBJECTS: Final = 1 << 19
"""msgpack objects (every value, key and container) in one decoded body: 65,536 expert entries of
five objects each fit; a body of tiny objects cannot cost more than this many Python objects."""
MAX_DECODE_MAP: Final = 64
"""Entries in one map (no v1 map has more than 14 fields; unknown fields stay possible)."""
MAX_DECODE_STR: Final = 64 * 1024
"""Bytes of one ``str`` (the longest v1 text is an error message of 4,096 bytes)."""
MAX_LAYER: Final = 1023
"""Highest MoE layer index an announcement may claim (no known model has more than 128 layers);
one record is therefore valid under at most 1,024 keys of one model."""
MAX_EXPERT: Final = MAX_EXPERTS_PER_REQUEST - 1
"""Highest expert index an announcement may claim."""
# weights_request tensors: an expert's matrices and biases, and (v1.2) the scales of quantised matrices
EXPERT_TENSORS: Final = ("gate", "up", "down", "gate_bias", "up_bias", "down_bias", "gate_scale", "up_scale",
                         "down_scale")
"""The tensor names of one routed expert, as ``weights_request.tensor`` names them."""
LOAD_SCALE: Final = 1000
"""``load_permille`` runs from 0 (idle) to 1000 (saturated)."""

DOMAIN_PREFIX: Final = b"moeswarm/v1/"
"""Signatures are over ``DOMAIN_PREFIX + kind + b"\\0" + payload``."""


class SignatureKind:
    """The ``kind`` part of each signature's domain-separation prefix."""

    AUTH: Final = "auth"
    RECEIPT: Final = "receipt"
    RECEIPT_COUNTERSIGN: Final = "receipt-countersign"
    RECEIPT_BATCH: Final = "receipt-batch"  # v1.3: the server's signature over a batch statement
    RECEIPT_BATCH_COUNTERSIGN: Final = "receipt-batch-countersign"  # v1.3: the client's, over statement + server sig
    ANNOUNCEMENT: Final = "announcement"


class ErrorCode(IntEnum):
    """The ``code`` of an ``Error`` message and of every ``ProtocolError`` raised here."""

    MALFORMED_FRAME = 1  # not one msgpack map with string keys; truncated; ext types
    UNSUPPORTED_VERSION = 2  # no protocol version in common
    FRAME_TOO_LARGE = 3  # length prefix above the receiver's limit
    BAD_FIELD = 4  # required field missing, mistyped, out of range, inconsistent
    BAD_TENSOR = 5  # tensor map wrong: dtype, rank, shape, data length
    NON_FINITE = 6  # tensor holds NaN or +-Inf
    UNKNOWN_EXPERT = 7  # model, layer or expert not served here
    OVERLOADED = 8  # server busy: retry later or elsewhere
    AUTH_FAILED = 9  # a signature or identity check failed
    INTERNAL = 10  # the sender of the error failed; not the receiver's fault
    UNKNOWN_MESSAGE = 11  # message type not understood
    UNEXPECTED_MESSAGE = 12  # valid message in the wrong state (e.g. request before Auth)
    DEADLINE_EXCEEDED = 13  # request's deadline_ms passed before compute could start
    STALE = 14  # replayed sequence number, or a record not newer than the stored one
    EXPIRED = 15  # a record whose expires_at_ms is in the past


FATAL_CODES: Final = frozenset(
    {
        ErrorCode.MALFORMED_FRAME,
        ErrorCode.UNSUPPORTED_VERSION,
        ErrorCode.FRAME_TOO_LARGE,
        ErrorCode.AUTH_FAILED,
        ErrorCode.UNEXPECTED_MESSAGE,
    }
)
"""Codes after which the sender of the ``Error`` closes the connection."""
