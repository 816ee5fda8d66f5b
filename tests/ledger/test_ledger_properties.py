"""Hypothesis properties of ingestion and settlement, on SQLite and PostgreSQL.

Each example uses fresh peers and its own epoch of the same ledger, so examples do not interact."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from fractions import Fraction

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moeswarm.ledger import Ledger, PerExpertPrice, StoreConfig, credits, settle_epoch
from moeswarm.protocol import CountersignedReceipt, Identity

from ledger_support import EPOCH_MS, MODEL, SHAPE, T0, Clock, fund, receipt

SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

item = st.fixed_dictionaries({
    "client": st.integers(0, 1), "server": st.integers(0, 2), "seq": st.integers(1, 6),
    "experts": st.lists(st.integers(0, 3), min_size=1, max_size=3, unique=True), "tokens": st.integers(1, 3),
    "kind": st.sampled_from(["ok", "ok", "ok", "inflated", "bad_sig", "duplicate", "replay"]),
})
prices = st.lists(st.fractions(0, 4, max_denominator=7), min_size=4, max_size=4)


def build(plan: list[dict], seed: int, clients: list[Identity] | None = None) -> list[CountersignedReceipt]:
    """Receipts for a plan: honest ones, inflated FLOPs, bad signatures, copies and replays."""
    clients = clients or [Identity.generate() for _ in range(2)]
    servers = [Identity.generate() for _ in range(3)]
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
    clients = [Identity.generate() for _ in range(2)]
    fund(ledger, *clients)
    receipts = build(plan, seed=epoch, clients=clients)
    pricing = ledger.pricing = _pricing(table)
    results = ledger.ingest(receipts[:split]) + ledger.ingest(receipts[split:])  # one or two batches
    clock.ms = (epoch + 1) * EPOCH_MS
    statement = settle_epoch(ledger, epoch)
    accepted = [cr.receipt for cr, r in zip(receipts, results) if r.status == "accepted"]
    assert statement.receipts == len(accepted) == len({r.receipt_id for r in results if r.status == "accepted"})
    per_server: dict[bytes, int] = {}
    for r in accepted:
        per_server[r.server] = per_server.get(r.server, 0) + max(credits(r, pricing), 1)  # min_receipt_credits
    assert {b.server: b.credits for b in statement.balances} == per_server
    assert sum(b.expert_flops for b in statement.balances) == sum(r.expert_flops for r in accepted)
    assert all(r.status in ("accepted", "duplicate", "rejected") for r in results)


_epochs = itertools.count(10)


@given(plan=st.lists(item, min_size=1, max_size=12), order=st.randoms(use_true_random=False), table=prices)
@SETTINGS
def test_ingest_order_of_a_batch_does_not_change_balances(new_db: Callable[[], str], ledger_key: Identity,
                                                          plan: list[dict], order: object,
                                                          table: list[Fraction]) -> None:
    clients = [Identity.generate() for _ in range(2)]
    receipts = build(plan, seed=0, clients=clients)
    shuffled = list(receipts)
    order.shuffle(shuffled)  # type: ignore[attr-defined]
    statements = []
    for batch in (receipts, shuffled):
        clock = Clock(T0 + 1)
        with Ledger(StoreConfig(new_db(), create=True), ledger_key, clock=clock, pricing=_pricing(table)) as led:
            led.register_model(MODEL, SHAPE)
            fund(led, clients[0], amount=2000)  # one client runs short: which receipts it can pay must not
            led.ingest(batch)                   # depend on the order they came in
            clock.ms = T0 + EPOCH_MS
            statements.append(settle_epoch(led, T0 // EPOCH_MS))
    a, b = statements
    assert a.balances == b.balances and a.receipts == b.receipts
    assert a.merkle_root == b.merkle_root  # the chain order is the same too


stream_step = st.one_of(
    st.tuples(st.just("grant"), st.integers(0, 3), st.integers(1, 5000)),
    st.tuples(st.just("call"), st.integers(0, 3), st.integers(0, 3), st.integers(1, 3),
              st.lists(st.integers(0, 3), min_size=1, max_size=3, unique=True)),
    st.tuples(st.just("settle")),
    st.tuples(st.just("evidence"), st.integers(0, 3)),
)


def _books(ledger: Ledger) -> tuple[int, int, int, dict[bytes, int]]:
    """(sum of grants, sum of balances, escrow, balances) read straight from the tables."""
    from sqlalchemy import select

    from moeswarm.ledger._models import Account, Entry, Grant, Settlement

    with ledger.read() as conn:
        grants = sum(conn.execute(select(Grant.amount)).scalars())
        accounts = {bytes(p): b for p, b in conn.execute(select(Account.peer, Account.balance))}
        settled = set(conn.execute(select(Settlement.epoch)).scalars())
        escrow = sum(a for e, a in conn.execute(select(Entry.epoch, Entry.amount)) if e not in settled)
    return grants, sum(accounts.values()), escrow, accounts


@given(steps=st.lists(stream_step, min_size=1, max_size=25), table=prices)
@SETTINGS
def test_credit_is_conserved_over_random_receipt_streams(ledger: Ledger, clock: Clock, steps: list[tuple],
                                                         table: list[Fraction]) -> None:
    """Grants, calls between four keys (some unfunded, some colluding), settlements and audit
    evidence in any order: after every step the balances plus the escrow equal the grants, no
    balance is negative, a call is refused exactly when its client cannot pay, and a key that was
    never granted anything ends with at most what others paid it."""
    from moeswarm.ledger import Reason
    from moeswarm.ledger._models import Evidence

    epoch = T0 // EPOCH_MS + next(_epochs) * 10
    clock.ms = epoch * EPOCH_MS + 1
    ledger.pricing = _pricing(table)
    keys = [Identity.generate() for _ in range(4)]
    seq = itertools.count(1)
    base_grants = _books(ledger)[0]
    granted = dict.fromkeys(range(4), 0)
    received_from_funded = dict.fromkeys(range(4), 0)  # credits paid to a key by calls (upper bound of earnings)
    for step in steps:
        if step[0] == "grant":
            ledger.grant(keys[step[1]].peer_id, step[2])
            granted[step[1]] += step[2]
        elif step[0] == "call":
            _, c, s, tokens, experts = step
            if c == s:
                continue
            before = ledger.balance(keys[c].peer_id)
            cr = receipt(keys[c], keys[s], seq=next(seq), tokens=tokens, experts=tuple(experts), seed=epoch)
            price = max(credits(cr.receipt, ledger.pricing), 1)  # at least min_receipt_credits
            [r] = ledger.ingest([cr])
            if price > before:
                assert (r.status, r.reason) == ("rejected", Reason.INSUFFICIENT_FUNDS)
                assert ledger.balance(keys[c].peer_id) == before
            else:
                assert r.status == "accepted", r
                assert ledger.balance(keys[c].peer_id) == before - price
                received_from_funded[s] += price
        elif step[0] == "evidence":  # an audit failed: this server's receipts of the epoch go back to their clients
            from sqlalchemy import insert

            with ledger.write() as conn:
                conn.execute(insert(Evidence).values(receipt_id=os.urandom(32), server=keys[step[1]].peer_id,
                                                     epoch=clock.ms // EPOCH_MS, record=b"", sample=b"",
                                                     created_ms=clock.ms))
        else:
            clock.ms = (clock.ms // EPOCH_MS + 1) * EPOCH_MS + 1  # end the epoch, settle it, go on in the next
            settle_epoch(ledger, clock.ms // EPOCH_MS - 1)
        grants, total, escrow, accounts = _books(ledger)
        assert grants - base_grants == sum(granted.values())
        assert total + escrow == grants  # conservation, after every step
        assert all(b >= 0 for b in accounts.values())
    for i, k in enumerate(keys):  # nobody ends with more than it was granted plus what calls paid it
        assert ledger.balance(k.peer_id) <= granted[i] + received_from_funded[i]
