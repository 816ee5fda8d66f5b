"""``QuotaStore``: the DHT value store's per-peer quotas, checked against a plain model of the rules."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from moeswarm.net.addresses import address_key
from moeswarm.net.value_quota import QuotaStore, owner_of

ops = st.lists(st.tuples(st.booleans(), st.integers(0, 5), st.integers(0, 15)), max_size=300)


@settings(max_examples=200, deadline=None)
@given(ops, st.integers(1, 20), st.integers(1, 6))
def test_quota_store_keeps_each_peer_within_quota_and_evicts_the_heaviest(
        steps: list[tuple[bool, int, int]], capacity: int, per_owner: int) -> None:
    store = QuotaStore(capacity, per_owner, owner=lambda key: key.split(b"/")[0].decode())
    model: dict[str, list[bytes]] = {}  # owner -> keys, oldest first
    for delete, owner, n in steps:
        key = f"{owner}/{n}".encode()
        keys = model.setdefault(str(owner), [])
        if delete:
            if key in keys:
                keys.remove(key)
                del store[key]
            continue
        if key in keys:  # a refreshed value is young again
            keys.remove(key)
        elif len(keys) >= per_owner:
            keys.pop(0)
        elif sum(map(len, model.values())) >= capacity:
            heaviest = max(len(v) for v in model.values())
            assert any(len(model[o]) == heaviest and store.held_by(o) == heaviest for o in model)
            before = {k for v in model.values() for k in v}
            store[key] = n
            gone = before - set(store)  # the store picks one of the heaviest peers: its oldest goes
            assert len(gone) == 1
            (lost,) = gone
            owner_lost = lost.split(b"/")[0].decode()
            assert len(model[owner_lost]) == heaviest and model[owner_lost][0] == lost
            model[owner_lost].pop(0)
            keys.append(key)
            assert set(store) == {k for v in model.values() for k in v}
            continue
        keys.append(key)
        store[key] = n
        assert set(store) == {k for v in model.values() for k in v}
        assert len(store) <= capacity
        assert all(store.held_by(o) == len(v) <= per_owner for o, v in model.items())


def test_owner_is_the_peer_the_key_names() -> None:
    assert owner_of(b"/moeswarm/v1/org/model/L3/12D3KooWAbc") == "12D3KooWAbc"
    assert owner_of(b"/moeswarm/v1/org/model/demand/12D3KooWAbc") == "12D3KooWAbc"
    assert owner_of(b"/moeswarm/v1/ledger/12D3KooWLedger/epoch/7") == "12D3KooWLedger"


def test_per_address_limits_count_ipv6_slash_64s() -> None:
    assert address_key(("2001:db8:1:2:aaaa::1", 4001, 0, 0)) == address_key(("2001:db8:1:2:ffff::9", 1, 0, 0))
    assert address_key(("2001:db8:1:3::1", 4001, 0, 0)) != address_key(("2001:db8:1:2::1", 4001, 0, 0))
    assert address_key(("::ffff:192.0.2.7", 80)) == address_key(("192.0.2.7", 80)) == "192.0.2.7"
