"""The minimum price per receipt (issue 32, attack 5): a receipt for no work is refused, and no
receipt is free whatever the price per FLOP, so keys without credit append nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from moeswarm.errors import ConfigError
from moeswarm.ledger import FlatPrice, Ledger, StoreConfig, credits
from moeswarm.protocol import Identity

from ledger_support import MODEL, SHAPE, Clock, Peers, fund, receipt


def _ledger(path: Path, price: float, **config: object) -> Ledger:
    led = Ledger(StoreConfig(str(path), create=True, **config), Identity.generate(), clock=Clock(),  # type: ignore[arg-type]
                 pricing=FlatPrice(price))
    led.register_model(MODEL, SHAPE)
    return led


def test_zero_flops_is_refused_even_from_a_funded_client(tmp_path: Path) -> None:
    with _ledger(tmp_path / "l.db", 1.0) as led:
        peers = Peers().funded(led)
        results = led.ingest([receipt(peers.clients[0], peers.servers[0], seq=1, flops=0)])
        assert [(r.status, r.reason) for r in results] == [("rejected", "zero_flops")]
        assert led.count() == 0


def test_a_receipt_priced_below_one_credit_still_costs_one(tmp_path: Path) -> None:
    """At 1e-9 credits per FLOP a call of 6 x 8 x 16 x 2 FLOPs is worth 0 credits: without the
    minimum a client holding nothing could append it (negative control: the price really is 0)."""
    with _ledger(tmp_path / "l.db", 1e-9) as led:
        broke, rich, server = Identity.generate(), Identity.generate(), Identity.generate()
        free = receipt(broke, server, seq=1)
        assert credits(free.receipt, led.pricing) == 0  # what the price alone would charge
        assert led.price(free.receipt) == 1
        assert [(r.status, r.reason) for r in led.ingest([free])] == [("rejected", "insufficient_funds")]
        fund(led, rich, amount=3)
        results = led.ingest([receipt(rich, server, seq=s) for s in (1, 2, 3, 4)])
        assert [r.status for r in results] == ["accepted"] * 3 + ["rejected"]  # 3 credits buy 3 receipts
        assert led.balance(rich.peer_id) == 0


def test_min_receipt_credits_below_one_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="min_receipt_credits"):
        _ledger(tmp_path / "l.db", 1.0, min_receipt_credits=0)
