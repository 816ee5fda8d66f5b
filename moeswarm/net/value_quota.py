"""A bounded DHT value store with per-peer quotas (no libp2p import: plain data structures).

py-libp2p keeps up to 50,000 values and, when full, evicts the one received first after a linear
scan: one key could write 50,000 values (an announcement claiming every layer is valid under
every layer's key), push everyone else's out, and then make every further write cost a scan of
the whole store. ``QuotaStore`` replaces that dict:

- every value is charged to the peer its key names (``owner_of``: the signer, proven by the
  record's validation before it is stored), at most ``per_owner`` values each;
- a peer at its quota that writes a new key loses its own oldest value, nobody else's;
- when the store is full, the peer holding the most values loses its oldest one;
- each write costs O(1): per-peer insertion-ordered dicts and owners bucketed by count.
"""

from __future__ import annotations

import re
from collections.abc import Callable
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


class QuotaStore(dict):  # type: ignore[type-arg]
    """A ``dict`` (key -> stored entry) that evicts by quota when a new key arrives."""

    def __init__(self, capacity: int = DEFAULT_MAX_VALUES, per_owner: int = DEFAULT_MAX_VALUES_PER_PEER,
                 owner: Callable[[bytes], str] = owner_of) -> None:
        super().__init__()
        if capacity < 1 or per_owner < 1:
            raise ValueError("capacity and per_owner must be at least 1")
        self.capacity, self.per_owner, self._owner_fn = capacity, per_owner, owner
        self._by_owner: dict[str, dict[bytes, None]] = {}  # owner -> its keys, oldest first
        self._owner: dict[bytes, str] = {}  # key -> owner
        self._with_count: dict[int, set[str]] = {}  # n -> owners holding exactly n values
        self._top = 0  # the largest n with owners
        self.evicted = 0  # values pushed out so far (by quota or by capacity)

    # ---------------------------------------------------------------- dict interface

    def __setitem__(self, key: bytes, value: Any) -> None:
        if key in self:
            super().__setitem__(key, value)
            keys = self._by_owner[self._owner[key]]
            del keys[key]
            keys[key] = None  # a refreshed value is young again
            return
        owner = self._owner_fn(key)
        held = len(self._by_owner.get(owner, ()))
        if held >= self.per_owner:
            self._evict_oldest(owner)
        elif len(self) >= self.capacity:
            self._evict_oldest(self._heaviest())
        super().__setitem__(key, value)
        self._owner[key] = owner
        keys = self._by_owner.setdefault(owner, {})
        keys[key] = None
        self._moved(owner, len(keys) - 1, +1)

    def __delitem__(self, key: bytes) -> None:
        super().__delitem__(key)
        owner = self._owner.pop(key)
        keys = self._by_owner[owner]
        del keys[key]
        self._moved(owner, len(keys) + 1, -1)
        if not keys:
            del self._by_owner[owner]

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
        self._with_count.clear()
        self._top = 0

    # ---------------------------------------------------------------- accounting

    def held_by(self, owner: str) -> int:
        return len(self._by_owner.get(owner, ()))

    def _moved(self, owner: str, before: int, delta: int) -> None:
        after = before + delta
        if before:
            bucket = self._with_count[before]
            bucket.discard(owner)
            if not bucket:
                del self._with_count[before]
        if after:
            self._with_count.setdefault(after, set()).add(owner)
            self._top = max(self._top, after)
        while self._top and self._top not in self._with_count:
            self._top -= 1

    def _heaviest(self) -> str:
        return next(iter(self._with_count[self._top]))

    def _evict_oldest(self, owner: str) -> None:
        oldest = next(iter(self._by_owner[owner]))
        del self[oldest]
        self.evicted += 1
