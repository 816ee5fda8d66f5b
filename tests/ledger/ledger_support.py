"""Helpers for the ledger tests: receipts signed by real keys, a settable clock, raw SQL tampering."""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from moeswarm.ledger import Ledger, ModelShape
from moeswarm.model import ExpertWeights
from moeswarm.node.expert_server import ExpertServer
from moeswarm.protocol import (
    CountersignedReceipt,
    ExpertRequest,
    ExpertRows,
    Identity,
    countersign,
    make_receipt,
)

H, F = 8, 16
MODEL = "test/tiny-moe"
SHAPE = ModelShape(H, F)
GRANT = 10**15  # credits a test grants each client: far more than its calls cost at one credit per FLOP
T0 = 1_800_000_000_000  # a round unix time in ms; epochs of 3600 s start at multiples of 3_600_000
EPOCH_MS = 3_600_000


class Clock:
    """A settable millisecond clock for ``Ledger(clock=...)``."""

    def __init__(self, ms: int = T0 + 1000) -> None:
        self.ms = ms

    def __call__(self) -> int:
        return self.ms


def call(client: Identity, server: Identity, *, seq: int, experts: Sequence[int] = (1,), tokens: int = 2,
         flops: int | None = None, model: str = MODEL, layer: int = 0, time_ms: int = T0,
         request_id: bytes | None = None, seed: int = 0) -> tuple[ExpertRequest, np.ndarray, CountersignedReceipt]:
    """A served call: request, outputs and its countersigned receipt (every expert gets every row)."""
    rng = np.random.default_rng(seed + seq)
    hidden = rng.standard_normal((tokens, H)).astype(np.float32)  # (N, H)
    rows = np.arange(tokens, dtype=np.uint32)
    request = ExpertRequest(request_id or os.urandom(16), model, layer, seq, hidden,
                            tuple(ExpertRows(e, rows) for e in experts))
    outputs = rng.standard_normal((request.pairs, H)).astype(np.float32)  # (P, H)
    flops = 6 * H * F * request.pairs if flops is None else flops
    receipt = make_receipt(server, request, outputs, client=client.peer_id, expert_flops=flops, time_ms=time_ms)
    return request, outputs, countersign(client, receipt)


def fund(ledger: Ledger, *clients: Identity, amount: int = GRANT) -> None:
    """Grant each client ``amount`` credits (the operator's signed grant): what it pays its servers with."""
    for c in clients:
        ledger.grant(c.peer_id, amount)


def receipt(client: Identity, server: Identity, **kw: object) -> CountersignedReceipt:
    return call(client, server, **kw)[2]  # type: ignore[arg-type]


@dataclass
class Peers:
    """A few clients and servers with per-pair sequence numbers."""

    clients: list[Identity] = field(default_factory=lambda: [Identity.generate() for _ in range(2)])
    servers: list[Identity] = field(default_factory=lambda: [Identity.generate() for _ in range(3)])
    _seq: itertools.count = field(default_factory=lambda: itertools.count(1))

    def funded(self, ledger: Ledger, amount: int = GRANT) -> Peers:
        """These peers with every client granted ``amount`` credits in ``ledger``."""
        fund(ledger, *self.clients, amount=amount)
        return self

    def receipts(self, n: int, **kw: object) -> list[CountersignedReceipt]:
        out = []
        for i in range(n):
            c, s = self.clients[i % len(self.clients)], self.servers[i % len(self.servers)]
            out.append(receipt(c, s, seq=next(self._seq), **kw))  # type: ignore[arg-type]
        return out


class LyingServer(ExpertServer):
    """Computes every expert with its down projection scaled by 1.05 and signs the result: every
    signature checks, only re-execution catches it."""

    def _experts(self, layer: int) -> dict[int, ExpertWeights]:
        cache = self.__dict__.setdefault("_lies", {})
        if layer not in cache:
            cache[layer] = {e: replace(w, down=(w.down.astype(np.float32) * 1.05))
                            for e, w in super()._experts(layer).items()}
        return cache[layer]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


