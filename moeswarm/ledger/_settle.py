"""The pure core of settlement: prices, balances, and the ledger-signed settlement statement.

A receipt earns its server ``floor(expert_flops * multiplier)`` credits, where the pluggable
``Pricing`` gives the multiplier for the receipt's (model, layer, experts, time). Credits are
integers so that sums do not depend on the order receipts are added in. A receipt names its
experts but not how many pairs each got, so a per-expert price is averaged over the receipt's
experts (``PerExpertPrice``); ``FlatPrice`` (1.0) is the price until the market supplies one.

The statement is signed by the ledger key over its canonical msgpack body (everything but
``sig``) under the domain ``"moeswarm/v1/ledger-settlement\\0"``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from fractions import Fraction
from math import floor
from typing import Any, Final, Protocol

from moeswarm.errors import ConfigError, SwarmError
from moeswarm.protocol import (
    Identity,
    Receipt,
    canonical,
    peer_id_from_str,
    peer_id_to_str,
    public_key_from_peer_id,
    verify,
)

SETTLEMENT_KIND: Final = "ledger-settlement"


class Pricing(Protocol):
    """Price multiplier of a receipt's expert-FLOPs."""

    @property
    def name(self) -> str: ...  # recorded in the statement, e.g. "flat" or "market/<epoch>"

    def multiplier(self, model_id: str, layer: int, experts: tuple[int, ...], time_ms: int) -> Fraction | float | int:
        ...


@dataclass(frozen=True)
class FlatPrice:
    """Every expert-FLOP is worth ``value`` credits."""

    value: float = 1.0  # credits per expert-FLOP
    name: str = "flat"

    def multiplier(self, model_id: str, layer: int, experts: tuple[int, ...], time_ms: int) -> float:
        return self.value


@dataclass(frozen=True)
class PerExpertPrice:
    """A per-expert price (from the market), averaged over the receipt's experts."""

    price: Callable[[str, int, int, int], Fraction | float]  # (model_id, layer, expert, time_ms) -> multiplier
    name: str = "per-expert"

    def multiplier(self, model_id: str, layer: int, experts: tuple[int, ...], time_ms: int) -> Fraction:
        total = sum((Fraction(self.price(model_id, layer, e, time_ms)) for e in experts), Fraction(0))
        return total / len(experts)


def credits(receipt: Receipt, pricing: Pricing) -> int:
    """``floor(expert_flops * multiplier)``, computed exactly."""
    m = Fraction(pricing.multiplier(receipt.model_id, receipt.layer, receipt.experts, receipt.time_ms))
    if m < 0:
        raise ConfigError(f"pricing {pricing.name!r} gave a negative multiplier {float(m)}")
    return floor(receipt.expert_flops * m)


@dataclass(frozen=True, order=True)
class Balance:
    """What one server earned in an epoch."""

    server: bytes  # peer ID
    credits: int  # sum of floor(expert_flops x multiplier) over its receipts
    expert_flops: int
    receipts: int

    def to_wire(self) -> list[Any]:
        return [self.server, self.credits, self.expert_flops, self.receipts]

    def to_json(self) -> dict[str, Any]:
        return {"server": peer_id_to_str(self.server), "credits": self.credits,
                "expert_flops": self.expert_flops, "receipts": self.receipts}


def balances(receipts: Iterable[Receipt], pricing: Pricing,
             withheld: frozenset[bytes] = frozenset()) -> tuple[list[Balance], list[Balance]]:
    """(paid, withheld) balances per server, each sorted by peer ID."""
    sums: dict[bytes, list[int]] = {}
    for r in receipts:
        s = sums.setdefault(r.server, [0, 0, 0])
        s[0] += credits(r, pricing)
        s[1] += r.expert_flops
        s[2] += 1
    rows = sorted(Balance(server, *v) for server, v in sums.items())
    return [b for b in rows if b.server not in withheld], [b for b in rows if b.server in withheld]


@dataclass(frozen=True)
class Statement:
    """A ledger-signed settlement of one epoch."""

    ledger: bytes  # the ledger's peer ID (its key verifies ``sig``)
    epoch: int  # epoch number: entries received in [epoch * epoch_ms, (epoch + 1) * epoch_ms)
    epoch_ms: int  # epoch length, milliseconds
    pricing: str  # Pricing.name
    receipts: int  # leaves of the Merkle tree: every receipt of the epoch, withheld ones included
    first_position: int  # chain positions the epoch spans (0, 0 when empty)
    last_position: int
    chain_hash: bytes  # entry hash at last_position (GENESIS-like zeros when empty)
    merkle_root: bytes  # over the epoch's records, see _merkle
    balances: tuple[Balance, ...]  # paid
    withheld: tuple[Balance, ...]  # servers with audit evidence in this epoch: not paid
    settled_ms: int  # when the ledger signed it
    sig: bytes = field(default=b"", compare=False)

    def body(self) -> dict[str, Any]:
        return {"balances": [b.to_wire() for b in self.balances], "chain_hash": self.chain_hash,
                "epoch": self.epoch, "epoch_ms": self.epoch_ms, "first_position": self.first_position,
                "last_position": self.last_position, "ledger": self.ledger, "merkle_root": self.merkle_root,
                "pricing": self.pricing, "receipts": self.receipts, "settled_ms": self.settled_ms,
                "type": "settlement", "withheld": [b.to_wire() for b in self.withheld]}

    def signed(self, identity: Identity) -> Statement:
        if identity.peer_id != self.ledger:
            raise ConfigError("only the ledger's own key signs its statements")
        return replace(self, sig=identity.sign(SETTLEMENT_KIND, canonical(self.body())))

    def verifies(self) -> bool:
        """Whether ``sig`` is the ledger's signature of this statement."""
        try:
            key = public_key_from_peer_id(self.ledger)
        except SwarmError:  # not a peer ID: does not verify
            return False
        return verify(key, SETTLEMENT_KIND, canonical(self.body()), self.sig)

    def encode(self) -> bytes:
        """Canonical msgpack of the body plus ``sig``: the stored form."""
        return canonical({**self.body(), "sig": self.sig})

    def to_json(self) -> dict[str, Any]:
        return {"type": "settlement", "ledger": peer_id_to_str(self.ledger), "epoch": self.epoch,
                "epoch_ms": self.epoch_ms, "pricing": self.pricing, "receipts": self.receipts,
                "first_position": self.first_position, "last_position": self.last_position,
                "chain_hash": self.chain_hash.hex(), "merkle_root": self.merkle_root.hex(),
                "balances": [b.to_json() for b in self.balances],
                "withheld": [b.to_json() for b in self.withheld], "settled_ms": self.settled_ms,
                "sig": self.sig.hex()}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Statement:
        """Inverse of ``to_json``; ``ConfigError`` if it does not parse."""
        try:
            def bal(items: list[dict[str, Any]]) -> tuple[Balance, ...]:
                return tuple(Balance(peer_id_from_str(b["server"]), int(b["credits"]), int(b["expert_flops"]),
                                     int(b["receipts"])) for b in items)
            return cls(peer_id_from_str(d["ledger"]), int(d["epoch"]), int(d["epoch_ms"]), str(d["pricing"]),
                       int(d["receipts"]), int(d["first_position"]), int(d["last_position"]),
                       bytes.fromhex(d["chain_hash"]), bytes.fromhex(d["merkle_root"]), bal(d["balances"]),
                       bal(d["withheld"]), int(d["settled_ms"]), bytes.fromhex(d["sig"]))
        except (KeyError, TypeError, ValueError, SwarmError) as e:  # SwarmError: a bad peer ID
            raise ConfigError(f"not a settlement statement: {e}") from None

    @classmethod
    def decode(cls, data: bytes) -> Statement:
        """Inverse of ``encode`` (for bytes this ledger stored)."""
        import msgpack

        d = msgpack.unpackb(data, raw=False)

        def bal(items: list[list[Any]]) -> tuple[Balance, ...]:
            return tuple(Balance(bytes(s), int(c), int(f), int(n)) for s, c, f, n in items)

        return cls(d["ledger"], d["epoch"], d["epoch_ms"], d["pricing"], d["receipts"], d["first_position"],
                   d["last_position"], d["chain_hash"], d["merkle_root"], bal(d["balances"]), bal(d["withheld"]),
                   d["settled_ms"], d["sig"])
