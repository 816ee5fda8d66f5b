"""Standing (``Ledger.standing``, ``top_payers``): credit paid out and not got back, bounded by the
lifetime figure, so passing credit round a circle of keys buys none (issue 32, security.md "Standing")."""

from __future__ import annotations

from ledger_support import EPOCH_MS, H, T0, F, Clock, fund, receipt

from moeswarm.ledger import Ledger
from moeswarm.ledger._settlement import settle_epoch
from moeswarm.protocol import Identity

PRICE = 6 * H * F * 2  # one call: one expert, two tokens


def test_circular_credit_buys_no_standing_and_a_cluster_holds_at_most_its_grants(ledger: Ledger, clock: Clock) -> None:
    a, s1, s2, s3, client, server = (Identity.generate() for _ in range(6))
    fund(ledger, a, amount=3 * PRICE)
    fund(ledger, client)
    pay = [(a, s1), (a, s2), (client, server), (client, server)]
    assert [r.status for r in ledger.ingest([receipt(c, s, seq=i + 1, time_ms=clock.ms)
                                             for i, (c, s) in enumerate(pay)])] == ["accepted"] * 4
    clock.ms = T0 + EPOCH_MS + 1000  # the next epoch: the first settles, its servers can spend
    settle_epoch(ledger, T0 // EPOCH_MS)
    second = clock.ms
    back = [(s1, a), (s2, s3)]  # s1 pays a back; s2 passes it on to s3
    assert [r.status for r in ledger.ingest([receipt(c, s, seq=1, time_ms=clock.ms) for c, s in back])] == \
        ["accepted"] * 2

    everything = ledger.standing([p.peer_id for p in (a, s1, s2, s3, client, server)], 0)
    got = {p: everything[p.peer_id].standing for p in (a, s1, s2, s3, client, server)}
    assert got == {a: PRICE, s1: 0, s2: 0, s3: 0, client: 2 * PRICE, server: 0}
    assert everything[s1.peer_id].paid == PRICE and everything[s1.peer_id].earned == PRICE  # paid, and got it back
    assert sum(got[p] for p in (a, s1, s2, s3)) <= 3 * PRICE  # the cluster's grants

    # in the second epoch alone s2 paid and earned nothing: the window says PRICE, its lifetime 0
    late = ledger.standing([s2.peer_id, a.peer_id], second)
    assert late[s2.peer_id].paid - late[s2.peer_id].earned == PRICE and late[s2.peer_id].standing == 0
    assert late[a.peer_id].standing == 0  # earned back what it paid in this window

    assert ledger.top_payers(0, 10) == [client.peer_id, a.peer_id]  # only positive net payers, most first
