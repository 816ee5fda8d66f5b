"""A bounded DHT value store with per-peer quotas (no libp2p import: plain data structures).

py-libp2p keeps up to 50,000 values and, when full, evicts the one received first after a linear
scan: one key could write 50,000 values (an announcement claiming every layer is valid under
every layer's key), push everyone else's out, and then make every further write cost a scan of
the whole store. ``QuotaStore`` replaces that dict:

- every value is charged to the peer its key names (``owner_of``: the signer, proven by the
  record's validation before it is stored), at most ``per_owner`` values each;
- a peer at its quota that writes a new key loses its own oldest value, nobody else's;
- when the store is full, eviction takes from the *writer group* holding the most values: the
  address the value came from (IPv4 address or IPv6 /64, ``source``; values learned by our own
  lookups form one group per owner); within that group, from the owner that joined it last, its
  oldest value. Keys are free, addresses are not (Bitcoin Core's addrman buckets by source
  group for the same reason): 1,000 fresh keys from one address are one heavy group, so a flood
  evicts itself, and an honest holder whose address holds a few records is the last to lose one.
  A flood from the honest holder's own address loses its youngest keys first, not the holder's;
- each write costs O(1): insertion-ordered dicts and groups bucketed by count.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any, Final

DEFAULT_MAX_VALUES: Final = 50_000
"""Values one node stores for the DHT, all peers together (py-libp2p's own figure)."""
DEFAULT_MAX_VALUES_PER_PEER: Final = 2_048
"""Values charged to one peer: one announcement per layer (at most 1,024 per model), a demand
report, settlement roots, with room to spare."""

_LEDGER_KEY = re.compile(rb"/moeswarm/v1/ledger/([1-9A-HJ-NP-Za-km-z]+)/epoch/")


def owner_of(key: bytes) -> str:
    """The peer a ``/moeswarm/`` key names (its last segment; the ledger for settlement roots)."""
    m = _LEDGER_KEY.match(key)
    if m is not None:
        return m.group(1).decode()
    return key.rsplit(b"/", 1)[-1].decode("utf-8", "replace")[:64]


class _Buckets:
    """Names bucketed by a count, with the largest count found in O(1) amortised."""

    def __init__(self) -> None:
        self.count: dict[str, int] = {}
        self._with: dict[int, dict[str, None]] = {}  # n -> names holding exactly n, first come first
        self._top = 0

    def add(self, name: str, delta: int) -> None:
        before = self.count.get(name, 0)
        after = before + delta
        if before:
            bucket = self._with[before]
            del bucket[name]
            if not bucket:
                del self._with[before]
        if after:
            self.count[name] = after
            self._with.setdefault(after, {})[name] = None
            self._top = max(self._top, after)
        else:
            self.count.pop(name, None)
        while self._top and self._top not in self._with:
            self._top -= 1

    def heaviest(self) -> str:
        return next(iter(self._with[self._top]))

    def clear(self) -> None:
        self.count.clear()
        self._with.clear()
        self._top = 0


class QuotaStore(dict):  # type: ignore[type-arg]
    """A ``dict`` (key -> stored entry) that evicts by quota when a new key arrives.

    ``source()`` names the writer group of the value being stored (the DHT sets it to the
    sender's address while it handles a PUT_VALUE); ``None`` means "our own lookup", charged to
    a group of its own per owner.
    """

    def __init__(self, capacity: int = DEFAULT_MAX_VALUES, per_owner: int = DEFAULT_MAX_VALUES_PER_PEER,
                 owner: Callable[[bytes], str] = owner_of, source: Callable[[], str | None] = lambda: None) -> None:
        super().__init__()
        if capacity < 1 or per_owner < 1:
            raise ValueError("capacity and per_owner must be at least 1")
        self.capacity, self.per_owner, self._owner_fn, self._source = capacity, per_owner, owner, source
        self._by_owner: dict[str, dict[bytes, None]] = {}  # owner -> its keys, oldest first
        self._owner: dict[bytes, str] = {}  # key -> owner
        self._group: dict[bytes, str] = {}  # key -> writer group it is charged to
        self._members: dict[str, dict[str, dict[bytes, None]]] = {}  # group -> owner (first come first) -> keys
        self._groups = _Buckets()  # values held per group
        self.evicted = 0  # values pushed out so far (by quota or by capacity)

    # ---------------------------------------------------------------- dict interface

    def __setitem__(self, key: bytes, value: Any) -> None:
        if key in self:
            super().__setitem__(key, value)
            owner, group = self._owner[key], self._group[key]
            for keys in (self._by_owner[owner], self._members[group][owner]):
                del keys[key]
                keys[key] = None  # a refreshed value is young again (it stays charged to its first writer)
            return
        owner = self._owner_fn(key)
        group = self._source() or f"key:{owner}"
        if len(self._by_owner.get(owner, ())) >= self.per_owner:
            del self[next(iter(self._by_owner[owner]))]
            self.evicted += 1
        elif len(self) >= self.capacity:
            self._evict_from(self._groups.heaviest())
        super().__setitem__(key, value)
        self._owner[key], self._group[key] = owner, group
        self._by_owner.setdefault(owner, {})[key] = None
        self._members.setdefault(group, {}).setdefault(owner, {})[key] = None
        self._groups.add(group, +1)

    def __delitem__(self, key: bytes) -> None:
        super().__delitem__(key)
        owner, group = self._owner.pop(key), self._group.pop(key)
        for table, name in ((self._by_owner, owner), (self._members[group], owner)):
            keys = table[name]
            del keys[key]
            if not keys:
                del table[name]
        if not self._members[group]:
            del self._members[group]
        self._groups.add(group, -1)

    def pop(self, key: bytes, *default: Any) -> Any:
        if key in self:
            value = super().__getitem__(key)
            del self[key]
            return value
        if default:
            return default[0]
        raise KeyError(key)

    def popitem(self) -> tuple[bytes, Any]:
        key = next(iter(self))
        return key, self.pop(key)

    def setdefault(self, key: bytes, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def clear(self) -> None:
        super().clear()
        self._by_owner.clear()
        self._owner.clear()
        self._group.clear()
        self._members.clear()
        self._groups.clear()

    # ---------------------------------------------------------------- accounting

    def held_by(self, owner: str) -> int:
        return len(self._by_owner.get(owner, ()))

    def held_from(self, group: str) -> int:
        """Values charged to a writer group (an address, or ``key:OWNER`` for our own lookups)."""
        return self._groups.count.get(group, 0)

    def groups(self) -> Iterator[str]:
        return iter(self._members)

    def _evict_from(self, group: str) -> None:
        """The youngest owner of the group loses its oldest value there."""
        owner = next(reversed(self._members[group]))
        del self[next(iter(self._members[group][owner]))]
        self.evicted += 1
