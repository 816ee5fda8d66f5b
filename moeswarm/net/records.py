"""Every kind of record the swarm keeps in the DHT, behind one validator.

``/moeswarm/v1/<model>/L<layer>/<peer>``: expert announcements (``moeswarm.protocol``);
``/moeswarm/v1/<model>/demand/<peer>``: backbones' signed demand reports (``moeswarm.market``);
``/moeswarm/v1/ledger/<ledger peer>/epoch/<n>``: a ledger's signed settlement root (``LedgerRoot``);
``/moeswarm/v1/<model>/evidence/<accused peer>``: a backbone's signed proof that a holder returned
wrong outputs (``moeswarm.net.evidence``), never replaced once valid;
``/moeswarm/v1/catalogue/<peer>``: the models a peer serves (``moeswarm.net.catalogue``);
``/moeswarm/v1/gateway/<peer>``: a gateway's API, models, load and price (``moeswarm.net.gateways``).
Each is accepted only when signed by the peer its key names; a stored record is replaced only
by a newer one from the same peer, and a settlement root never (an epoch is settled once).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

from ..errors import ProtocolError, SwarmError
from ..market import decode_report, validate_demand_record
from ..protocol import (
    ErrorCode,
    Identity,
    canonical,
    is_peer_id,
    peer_id_from_str,
    peer_id_to_str,
    public_key_from_peer_id,
    select_record,
    validate_record,
    verify,
)
from ..protocol._limits import MAX_RECORD_BYTES
from ..protocol._wire import Fields, bad, unpack  # the protocol's defensive decoder
from .catalogue import is_catalogue_key, select_catalogue, validate_catalogue
from .evidence import is_evidence_key, select_evidence, validate_evidence
from .gateways import is_gateway_key, select_gateway, validate_gateway

_DEMAND = re.compile(r"/moeswarm/v1/.+/demand/[1-9A-HJ-NP-Za-km-z]+")


def is_demand_key(key: str) -> bool:
    return _DEMAND.fullmatch(key) is not None


def validate_any(key: str, value: bytes, stored: bytes | None = None) -> None:
    """Raise ``ProtocolError`` unless ``value`` may be stored under ``key`` (replacing ``stored``)."""
    if is_ledger_root_key(key):
        validate_ledger_root(key, value, stored)
        return
    if is_catalogue_key(key):
        validate_catalogue(key, value, stored)
        return
    if is_evidence_key(key):
        validate_evidence(key, value, stored)
        return
    if is_gateway_key(key):
        validate_gateway(key, value, stored)
        return
    if not is_demand_key(key):
        validate_record(key, value, stored)
        return
    report = validate_demand_record(key, value)
    if stored is not None:
        try:
            old = decode_report(stored)
        except ProtocolError:
            return
        if old.seq >= report.seq:
            raise ProtocolError(f"demand report seq {report.seq} is not above stored {old.seq}", code=ErrorCode.STALE)


def select_any(key: str, values: Sequence[bytes]) -> int:
    """Index of the best valid value (highest seq; for settlement roots, the first signed)."""
    if is_ledger_root_key(key):
        return select_ledger_root(key, values)
    if is_catalogue_key(key):
        return select_catalogue(key, values)
    if is_evidence_key(key):
        return select_evidence(key, values)
    if is_gateway_key(key):
        return select_gateway(key, values)
    if not is_demand_key(key):
        return select_record(key, values)
    best, best_seq, error = -1, -1, None
    for i, value in enumerate(values):
        try:
            seq = validate_demand_record(key, value).seq
        except ProtocolError as e:
            error = e
            continue
        if seq > best_seq:
            best, best_seq = i, seq
    if best < 0:
        raise error or ProtocolError("no valid demand report", code=ErrorCode.BAD_FIELD)
    return best


# ------------------------------------------------------------------ ledger settlement roots

LEDGER_ROOT_KIND: Final = "ledger-root"
"""Signature domain of settlement roots (after the protocol's ``moeswarm/v1/`` prefix)."""
_LEDGER_ROOT = re.compile(r"/moeswarm/v1/ledger/([1-9A-HJ-NP-Za-km-z]+)/epoch/(0|[1-9][0-9]{0,17})")


@dataclass(frozen=True)
class LedgerRoot:
    """A ledger's signed settlement root of one epoch: what a volunteer checks an inclusion proof
    against. Compact (a statement lists every server's balance; this fits any DHT value limit) and
    bound to the full statement by its hash. Signed by the ledger key over canonical(body)."""

    ledger: bytes  # the ledger's peer ID; its key signs
    epoch: int
    merkle_root: bytes  # 32 bytes: root over the epoch's receipts (moeswarm.ledger)
    receipts: int  # leaves of that tree
    chain_hash: bytes  # 32 bytes: entry hash at the epoch's last chain position (zeros when empty)
    statement_hash: bytes  # 32 bytes: SHA-256 of the signed settlement statement's canonical bytes
    settled_ms: int  # unix ms at which the ledger signed the statement
    sig: bytes = b""

    def body(self) -> dict[str, Any]:
        return {"chain_hash": self.chain_hash, "epoch": self.epoch, "ledger": self.ledger,
                "merkle_root": self.merkle_root, "receipts": self.receipts, "settled_ms": self.settled_ms,
                "statement_hash": self.statement_hash, "type": "ledger_root"}

    def signed(self, identity: Identity) -> LedgerRoot:
        return replace(self, sig=identity.sign(LEDGER_ROOT_KIND, canonical(self.body())))

    def verifies(self) -> bool:
        try:
            return verify(public_key_from_peer_id(self.ledger), LEDGER_ROOT_KIND, canonical(self.body()), self.sig)
        except SwarmError:
            return False

    def encode(self) -> bytes:
        return canonical({**self.body(), "sig": self.sig})

    @classmethod
    def decode(cls, data: bytes) -> LedgerRoot:
        """``ProtocolError`` for anything that is not a well-formed root (the signature is not checked)."""
        if len(data) > MAX_RECORD_BYTES:
            bad(f"record of {len(data)} bytes exceeds {MAX_RECORD_BYTES}", code=ErrorCode.FRAME_TOO_LARGE)
        f = Fields(unpack(data), "ledger_root")
        if f.raw("type") != "ledger_root":
            bad("not a ledger root")
        ledger = f.bin("ledger")
        if not is_peer_id(ledger):
            bad("ledger_root.ledger is not an Ed25519 peer ID")
        return cls(ledger, f.uint("epoch"), f.bin("merkle_root", size=32), f.uint("receipts"),
                   f.bin("chain_hash", size=32), f.bin("statement_hash", size=32), f.uint("settled_ms"),
                   f.bin("sig", size=64))

    def to_json(self) -> dict[str, Any]:
        return {"type": "ledger_root", "ledger": peer_id_to_str(self.ledger), "epoch": self.epoch,
                "merkle_root": self.merkle_root.hex(), "receipts": self.receipts, "chain_hash": self.chain_hash.hex(),
                "statement_hash": self.statement_hash.hex(), "settled_ms": self.settled_ms, "sig": self.sig.hex()}


def ledger_root_key(ledger: bytes, epoch: int) -> str:
    return f"/moeswarm/v1/ledger/{peer_id_to_str(ledger)}/epoch/{epoch}"


def is_ledger_root_key(key: str) -> bool:
    return _LEDGER_ROOT.fullmatch(key) is not None


def validate_ledger_root(key: str, value: bytes, stored: bytes | None = None) -> LedgerRoot:
    """Accept a settlement root for ``key``, or raise ``ProtocolError``: it must be the epoch the key
    names, signed by the ledger the key names (9), and no other valid root may be ``stored`` (14)."""
    m = _LEDGER_ROOT.fullmatch(key)
    if m is None:
        bad(f"not a ledger root key: {key!r:.100}")
    root = LedgerRoot.decode(value)
    try:
        named = peer_id_from_str(m.group(1))
    except SwarmError:
        bad("the key does not name a peer ID")
    if root.ledger != named:
        raise ProtocolError("the root is not the ledger's the key names", code=ErrorCode.AUTH_FAILED)
    if root.epoch != int(m.group(2)):
        bad(f"the root is of epoch {root.epoch}, the key names epoch {m.group(2)}")
    if not root.verifies():
        raise ProtocolError("ledger root signature does not verify", code=ErrorCode.AUTH_FAILED)
    if stored is not None and stored != value:
        try:
            validate_ledger_root(key, stored)
        except ProtocolError:
            return root  # what is stored is void: replace it
        raise ProtocolError(f"epoch {root.epoch} of this ledger already has a root; roots are immutable",
                            code=ErrorCode.STALE)
    return root


def select_ledger_root(key: str, values: Sequence[bytes]) -> int:
    """Index of the valid root signed first (a ledger that signed two has equivocated: every
    reader still picks the same one)."""
    best: tuple[int, bytes] | None = None
    index, error = -1, None
    for i, value in enumerate(values):
        try:
            root = validate_ledger_root(key, value)
        except ProtocolError as e:
            error = e
            continue
        if best is None or (root.settled_ms, value) < best:
            best, index = (root.settled_ms, value), i
    if index < 0:
        raise error or ProtocolError("no valid ledger root", code=ErrorCode.BAD_FIELD)
    return index
