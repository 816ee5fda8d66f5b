"""Gateway charges under spending authorizations (issue 30, point 2), on the real ledger (SQLite and,
where configured, PostgreSQL): the fee is the price the person signed, charges follow the tokens
they acknowledged up to the bound and before expiry, and credit stays conserved with receipts,
grants and settlements around them (``verify`` replays it all)."""

from __future__ import annotations

from ledger_support import EPOCH_MS, Clock, Peers, fund

from moeswarm.ledger import Ledger
from moeswarm.ledger._authorizations import charge
from moeswarm.ledger._verify import verify_chain
from moeswarm.protocol import Identity
from moeswarm.protocol._spending import acknowledge_usage, authorize_spending

MODEL = "mixtral-e4bde7c04b4d"


def _books(ledger: Ledger, peers: list[Identity]) -> int:
    return sum(ledger.balance(p.peer_id) for p in peers)


def test_charges_follow_acknowledged_tokens_at_the_signed_price_and_conserve_credit(ledger: Ledger, clock: Clock) -> None:
    person, gateway, other = Identity.generate(), Identity.generate(), Identity.generate()
    fund(ledger, person, amount=1000)
    auth = authorize_spending(person, gateway.peer_id, MODEL, max_credits=300, price_per_token=3,
                              expires_ms=clock.ms + 60_000)
    steps = [(10, "charged", 30, 30), (10, "duplicate", 0, 30), (4, "duplicate", 0, 30), (50, "charged", 120, 150),
             (100, "charged", 150, 300), (101, "exceeds_authorization", 0, 300)]
    for tokens, status, moved, total in steps:
        result = charge(ledger, auth.encode(), acknowledge_usage(person, auth, tokens).encode())
        assert (result.status, result.moved) == (status, moved), (tokens, result)
        if status != "exceeds_authorization":
            assert result.charged == total
        assert ledger.balance(person.peer_id) == 1000 - total
        assert ledger.balance(gateway.peer_id) == total  # the fee: tokens x the price the person signed
        assert _books(ledger, [person, gateway, other]) == 1000  # one move between two accounts
    # a second authorization is a bound of its own; a person who cannot pay moves nothing
    poor = Identity.generate()
    fund(ledger, poor, amount=5)
    auth2 = authorize_spending(poor, gateway.peer_id, MODEL, max_credits=100, price_per_token=3,
                               expires_ms=clock.ms + 60_000)
    result = charge(ledger, auth2.encode(), acknowledge_usage(poor, auth2, 2).encode())
    assert (result.status, ledger.balance(poor.peer_id)) == ("insufficient_funds", 5)
    # after expiry, by the ledger's clock, nothing more moves
    clock.ms = auth.expires_ms
    auth3 = authorize_spending(person, gateway.peer_id, MODEL, max_credits=100, price_per_token=1,
                               expires_ms=clock.ms)
    assert charge(ledger, auth3.encode(), acknowledge_usage(person, auth3, 1).encode()).status == "authorization_expired"
    assert ledger.balance(person.peer_id) == 700


def test_verify_replays_gateway_charges_among_receipts_and_settlements(ledger: Ledger, clock: Clock) -> None:
    from moeswarm.ledger import settle_epoch

    peers = Peers().funded(ledger, amount=10**9)
    person, gateway = peers.clients[0], peers.servers[0]
    auth = authorize_spending(person, gateway.peer_id, MODEL, max_credits=10**6, price_per_token=7,
                              expires_ms=clock.ms + 10 * EPOCH_MS)
    for i, tokens in enumerate((5, 9, 40)):
        assert [r.status for r in ledger.ingest(peers.receipts(3))] == ["accepted"] * 3
        assert charge(ledger, auth.encode(), acknowledge_usage(person, auth, tokens).encode()).status == "charged"
        if i == 1:
            clock.ms = (clock.ms // EPOCH_MS + 1) * EPOCH_MS + 1
            settle_epoch(ledger, clock.ms // EPOCH_MS - 1)
    report = verify_chain(ledger)
    assert report.ok, report
    # the books catch a charge row edited behind the ledger's back
    from sqlalchemy import update

    from moeswarm.ledger._models import GatewayCharge

    with ledger.write() as conn:
        conn.execute(update(GatewayCharge).values(charged=7 * 41))
    assert not verify_chain(ledger).ok


def test_a_usage_of_another_person_or_authorization_is_refused(ledger: Ledger, clock: Clock) -> None:
    person, gateway, mallory = Identity.generate(), Identity.generate(), Identity.generate()
    fund(ledger, person, amount=100)
    auth = authorize_spending(person, gateway.peer_id, MODEL, max_credits=50, price_per_token=1,
                              expires_ms=clock.ms + 60_000)
    other = authorize_spending(person, gateway.peer_id, MODEL, max_credits=50, price_per_token=1,
                               expires_ms=clock.ms + 60_000)
    forged = acknowledge_usage(mallory, auth, 10)  # signed by another key
    assert charge(ledger, auth.encode(), forged.encode()).status == "bad_signature"
    assert charge(ledger, auth.encode(), acknowledge_usage(person, other, 10).encode()).status == "bad_signature"
    assert charge(ledger, b"\x80", b"\x80").status == "malformed"
    assert ledger.balance(person.peer_id) == 100
