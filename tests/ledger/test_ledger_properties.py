"""Hypothesis properties of ingestion and settlement, on SQLite and PostgreSQL.

Each example uses fresh peers and its own epoch of the same ledger, so examples do not interact."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from fractions import Fraction

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moeswarm.ledger import Ledger, PerExpertPrice, StoreConfig, credits, settle_epoch
from moeswarm.protocol import CountersignedReceipt, Identity

from ledger_support import EPOCH_MS, MODEL, SHAPE, T0, Clock, receipt

SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

item = st.fixed_dictionaries({
    "client": st.integers(0, 1), "server": st.integers(0, 2), "seq": st.integers(1, 6),
    "experts": st.lists(st.integers(0, 3), min_size=1, max_size=3, unique=True), "tokens": st.integers(1, 3),
    "kind": st.sampled_from(["ok", "ok", "ok", "inflated", "bad_sig", "duplicate", "replay"]),
})
prices = st.lists(st.fractions(0, 4, max_denominator=7), min_size=4, max_size=4)


def build(plan: list[dict], seed: int) -> list[CountersignedReceipt]:
    """Receipts for a plan: honest ones, inflated FLOPs, bad signatures, copies and replays."""
    clients, servers = [Identity.generate() for _ in range(2)], [Identity.generate() for _ in range(3)]
    out: list[CountersignedReceipt] = []
    for i, p in enumerate(plan):
        c, s = clients[p["client"]], servers[p["server"]]
        kw = dict(seq=p["seq"], experts=tuple(p["experts"]), tokens=p["tokens"], seed=seed + i)
        if p["kind"] == "duplicate" and out:
            out.append(out[-1])
        elif p["kind"] == "replay" and out:
            out.append(receipt(clients[0], servers[0], request_id=out[0].receipt.request_id, **kw))
        elif p["kind"] == "inflated":
            out.append(receipt(c, s, flops=6 * 8 * 16 * p["tokens"] * len(p["experts"]) + 1, **kw))
        elif p["kind"] == "bad_sig":
            cr = receipt(c, s, **kw)
            out.append(CountersignedReceipt(cr.receipt, bytes(64)))
        else:
            out.append(receipt(c, s, **kw))
    return out


def _pricing(table: list[Fraction]) -> PerExpertPrice:
    return PerExpertPrice(lambda model, layer, expert, t: table[expert])


@given(plan=st.lists(item, min_size=1, max_size=12), split=st.integers(0, 12), table=prices)
@SETTINGS
def test_settlement_totals_equal_the_sum_of_accepted_receipts(ledger: Ledger, clock: Clock, plan: list[dict],
                                                              split: int, table: list[Fraction]) -> None:
    epoch = T0 // EPOCH_MS + next(_epochs)
    clock.ms = epoch * EPOCH_MS + 1
    receipts = build(plan, seed=epoch)
    results = ledger.ingest(receipts[:split]) + ledger.ingest(receipts[split:])  # one or two batches
    clock.ms = (epoch + 1) * EPOCH_MS
    pricing = _pricing(table)
    statement = settle_epoch(ledger, epoch, pricing)
    accepted = [cr.receipt for cr, r in zip(receipts, results) if r.status == "accepted"]
    assert statement.receipts == len(accepted) == len({r.receipt_id for r in results if r.status == "accepted"})
    per_server: dict[bytes, int] = {}
    for r in accepted:
        per_server[r.server] = per_server.get(r.server, 0) + credits(r, pricing)
    assert {b.server: b.credits for b in statement.balances} == per_server
    assert sum(b.expert_flops for b in statement.balances) == sum(r.expert_flops for r in accepted)
    assert all(r.status in ("accepted", "duplicate", "rejected") for r in results)


_epochs = itertools.count(10)


@given(plan=st.lists(item, min_size=1, max_size=12), order=st.randoms(use_true_random=False), table=prices)
@SETTINGS
def test_ingest_order_of_a_batch_does_not_change_balances(new_db: Callable[[], str], ledger_key: Identity,
                                                          plan: list[dict], order: object,
                                                          table: list[Fraction]) -> None:
    receipts = build(plan, seed=0)
    shuffled = list(receipts)
    order.shuffle(shuffled)  # type: ignore[attr-defined]
    statements = []
    for batch in (receipts, shuffled):
        clock = Clock(T0 + 1)
        with Ledger(StoreConfig(new_db(), create=True), ledger_key, clock=clock) as led:
            led.register_model(MODEL, SHAPE)
            led.ingest(batch)
            clock.ms = T0 + EPOCH_MS
            statements.append(settle_epoch(led, T0 // EPOCH_MS, _pricing(table)))
    a, b = statements
    assert a.balances == b.balances and a.receipts == b.receipts
    assert a.merkle_root == b.merkle_root  # the chain order is the same too
