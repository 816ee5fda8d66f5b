"""``QuotaStore``: the DHT value store's per-peer quotas, checked against a plain model of the rules."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from moeswarm.net.addresses import address_key
from moeswarm.net.value_quota import QuotaStore, owner_of

ops = st.lists(st.tuples(st.booleans(), st.integers(0, 5), st.integers(0, 15), st.integers(0, 2)), max_size=300)


@settings(max_examples=200, deadline=None)
@given(ops, st.integers(1, 20), st.integers(1, 6))
def test_quota_store_keeps_each_peer_within_quota_and_evicts_from_the_heaviest_writer_group(
        steps: list[tuple[bool, int, int, int]], capacity: int, per_owner: int) -> None:
    """The model: per-owner quotas (own oldest goes); when full, the writer group (address) holding
    the most values loses a value of the owner that joined it last, that owner's oldest there."""
    writer: list[str | None] = [None]
    store = QuotaStore(capacity, per_owner, owner=lambda key: key.split(b"/")[0].decode(), source=lambda: writer[0])
    model: dict[str, list[bytes]] = {}  # owner -> keys, oldest first
    group_of: dict[bytes, str] = {}
    joined: dict[str, list[str]] = {}  # group -> owners, in the order they (re)joined it
    for delete, owner, n, address in steps:
        key = f"{owner}/{n}".encode()
        keys = model.setdefault(str(owner), [])
        writer[0] = None if address == 0 else f"10.0.0.{address}"

        def forget(k: bytes) -> None:
            o, g = k.split(b"/")[0].decode(), group_of.pop(k)
            model[o].remove(k)
            if not any(group_of[x] == g for x in model[o] if x in group_of):
                joined[g].remove(o)

        if delete:
            if key in keys:
                forget(key)
                del store[key]
            continue
        if key in keys:  # a refreshed value is young again, charged to its first writer
            keys.remove(key)
            keys.append(key)
            store[key] = n
            continue
        if len(keys) >= per_owner:
            forget(keys[0])
        elif len(group_of) >= capacity:
            sizes = {g: sum(1 for x in group_of.values() if x == g) for g in set(group_of.values())}
            top = max(sizes.values())
            candidates = {model[joined[g][-1]][[group_of.get(x) for x in model[joined[g][-1]]].index(g)]
                          for g, size in sizes.items() if size == top}
            before = set(store)
            store[key] = n
            gone = before - set(store) - {key}
            assert len(gone) == 1 and gone <= candidates, (gone, candidates)
            forget(gone.pop())
            group_of[key] = writer[0] or f"key:{owner}"
            joined.setdefault(group_of[key], [])
            if str(owner) not in joined[group_of[key]]:
                joined[group_of[key]].append(str(owner))
            keys.append(key)
            assert set(store) == set(group_of)
            continue
        group = writer[0] or f"key:{owner}"
        group_of[key] = group
        joined.setdefault(group, [])
        if str(owner) not in joined[group]:
            joined[group].append(str(owner))
        keys.append(key)
        store[key] = n
        assert set(store) == set(group_of)
        assert len(store) <= capacity
        assert all(store.held_by(o) == len(v) <= per_owner for o, v in model.items())
        assert all(store.held_from(g) == sum(1 for x in group_of.values() if x == g) for g in joined)


def test_a_flood_of_fresh_keys_from_one_address_evicts_itself_not_the_honest_holder() -> None:
    writer: list[str | None] = ["10.0.0.1"]
    store = QuotaStore(100, 50, source=lambda: writer[0])
    honest = [f"/moeswarm/v1/m/L{i}/Honest".encode() for i in range(4)]
    for key in honest:
        store[key] = "h"
    for address in ("10.0.0.2", "10.0.0.1"):  # from another address, then from the honest one's own
        writer[0] = address
        for i in range(1000):
            store[f"/moeswarm/v1/m/L0/Sybil{address}-{i}".encode()] = "s"
        assert all(key in store for key in honest) and len(store) == 100


def test_owner_is_the_peer_the_key_names() -> None:
    assert owner_of(b"/moeswarm/v1/org/model/L3/12D3KooWAbc") == "12D3KooWAbc"
    assert owner_of(b"/moeswarm/v1/org/model/demand/12D3KooWAbc") == "12D3KooWAbc"
    assert owner_of(b"/moeswarm/v1/ledger/12D3KooWLedger/epoch/7") == "12D3KooWLedger"


def test_per_address_limits_count_ipv6_slash_64s() -> None:
    assert address_key(("2001:db8:1:2:aaaa::1", 4001, 0, 0)) == address_key(("2001:db8:1:2:ffff::9", 1, 0, 0))
    assert address_key(("2001:db8:1:3::1", 4001, 0, 0)) != address_key(("2001:db8:1:2::1", 4001, 0, 0))
    assert address_key(("::ffff:192.0.2.7", 80)) == address_key(("192.0.2.7", 80)) == "192.0.2.7"
