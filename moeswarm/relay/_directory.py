"""Publishing devices in the DHT: their own signed announcements, stored by the relay.

A device signs its announcement (endpoint ``relay+wss://HOST:PORT/<its peer id>``) and hands
it to the relay, which checks it and ``put``s it under the device's announcement keys; the DHT
validator accepts it because the *device's* signature verifies, whoever stores it.

Provider records are different: libp2p only accepts ADD_PROVIDER from the provider itself, so
the relay cannot advertise a device on other peers. It adds the device to its *own* provider
store instead, which answers every GET_PROVIDERS lookup that reaches the relay. Lookups query
the k=20 peers closest to the key, so in a swarm of up to 20 DHT servers every lookup sees the
relay's devices; beyond that a lookup finds them when the relay is among the closest peers
(``protocol_spec/relay.md``, "Discovery", says what a later revision changes).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from ..errors import ProtocolError
from ..protocol import (
    Announcement,
    ErrorCode,
    announcement_key,
    decode,
    peer_id_to_str,
    provider_key,
    validate_record,
)

if TYPE_CHECKING:
    from ..net.p2p import P2PNode  # imports trio: only the relay daemon creates one

log = logging.getLogger(__name__)


class Directory(Protocol):
    """Where the relay stores what its devices announce."""

    async def publish(self, record: Announcement, value: bytes, layers: Sequence[int]) -> int:
        """Store ``value`` (the record's canonical encoding) under each layer's key; keys written."""
        ...

    async def forget(self, peer_id: bytes) -> None:
        """The device is gone: stop advertising it (its records expire by themselves)."""
        ...


def check_publish(record_value: bytes, layers: Sequence[int], device: bytes, endpoint: str,
                  now_ms: int | None = None) -> Announcement:
    """Validate a device's publish request; ``ProtocolError`` (4 or 9, or the record's own code).

    The record must pass the DHT validation rule for every key, be the device's own, and name
    the endpoint this relay gave the device (so a relay never advertises a device elsewhere).
    """
    if not layers:
        raise ProtocolError("relay_publish.layers is empty", code=ErrorCode.BAD_FIELD)
    candidate = decode(record_value)
    if not isinstance(candidate, Announcement):
        raise ProtocolError("relay_publish.record is not an announcement", code=ErrorCode.BAD_FIELD)
    if candidate.peer_id != device:
        raise ProtocolError("a device may only publish its own announcement", code=ErrorCode.AUTH_FAILED)
    if endpoint not in candidate.endpoints:
        raise ProtocolError(f"the announcement must list {endpoint}", code=ErrorCode.BAD_FIELD)
    for layer in layers:  # the DHT's own rule, for every key it will be stored under
        validate_record(announcement_key(candidate.model_id, layer, device), record_value, now_ms=now_ms)
    return candidate


class MemoryDirectory:
    """A directory that only remembers (tests, and relays run without a DHT)."""

    def __init__(self) -> None:
        self.records: dict[str, bytes] = {}
        self.forgotten: list[bytes] = []

    async def publish(self, record: Announcement, value: bytes, layers: Sequence[int]) -> int:
        for layer in layers:
            self.records[announcement_key(record.model_id, layer, record.peer_id)] = value
        return len(layers)

    async def forget(self, peer_id: bytes) -> None:
        self.forgotten.append(peer_id)


class DhtDirectory:
    """Stores device records in the DHT and lists the devices as providers on this relay."""

    def __init__(self, node: "P2PNode") -> None:
        self.node = node

    async def publish(self, record: Announcement, value: bytes, layers: Sequence[int]) -> int:
        t0 = time.monotonic()
        for layer in layers:
            await self.node.put(announcement_key(record.model_id, layer, record.peer_id), value)
            await self.node.add_local_provider(provider_key(record.model_id, layer), record.peer_id)
        log.info("published %s for %d layers in %.2fs", peer_id_to_str(record.peer_id), len(layers),
                 time.monotonic() - t0)
        return len(layers)

    async def forget(self, peer_id: bytes) -> None:
        await self.node.remove_local_provider(peer_id)
