"""The GossipSub half of the libp2p glue (``_libp2p_patches`` has the host, ``_libp2p_dht`` the
DHT): a pubsub router for the announcement topics, the first-view stream protocol, and the
workarounds for py-libp2p 0.8.1's GossipSub. Importing it imports libp2p.

* GossipSub's spam guard (``spam_protection_enabled``, on by default) counts every message a
  peer forwards on a topic, our own publications included, and silently stops forwarding past
  10 per second: a model's topic with 1,000 holders refreshing carries more than that through
  every mesh peer. It is off; ``moeswarm.net.gossip_view.TopicGate`` budgets per peer, address
  and signer instead.
* ``install_equivocation_bound``: GossipSub keeps every message it ever forwarded in
  ``equivocation_detection`` (to spot a (from, seqno) reused with other data) and never forgets
  one: memory grew by one message per message, forever. It now keeps the newest
  ``EQUIVOCATION_MEMORY`` of them.
* ``SYNC_PROTOCOL``: a joiner asks a peer of the topic for every record it keeps of a model,
  in one round trip; each record is then checked like a gossiped one.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable
from typing import Any, Final

import trio
from libp2p.abc import IHost
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.pubsub import gossipsub as _gossipsub_module
from libp2p.pubsub.gossipsub import (
    PROTOCOL_ID,
    PROTOCOL_ID_V11,
    PROTOCOL_ID_V12,
    GossipSub,
)
from libp2p.pubsub.pubsub import Pubsub

from moeswarm.errors import ProtocolError
from moeswarm.net.addresses import address_key
from moeswarm.net.gossip_view import SYNC_MAX_MODEL_ID_BYTES, sync_answer, sync_request
from moeswarm.protocol._limits import MAX_RECORD_BYTES

__all__ = ["SYNC_PROTOCOL", "fetch_records", "install_equivocation_bound", "make_pubsub", "serve_records"]

log = logging.getLogger(__name__)

SYNC_PROTOCOL: Final = TProtocol("/moeswarm/announce-sync/1.0.0")
EQUIVOCATION_MEMORY: Final = 4096
"""Messages GossipSub remembers to detect equivocation (about a minute of a busy topic)."""


# ---------------------------------------------------------------- equivocation memory


def install_equivocation_bound() -> None:
    """Keep GossipSub's equivocation memory to the newest ``EQUIVOCATION_MEMORY`` messages
    (idempotent; on the class, so every router of this process)."""
    cls = _gossipsub_module.GossipSub
    if getattr(cls, "_moeswarm_equivocation_bound", False):
        return
    original = cls._check_equivocation

    def bounded(self: Any, msg: Any) -> bool:
        ok = original(self, msg)
        memory: dict[bytes, Any] = self.equivocation_detection
        while len(memory) > EQUIVOCATION_MEMORY:
            del memory[next(iter(memory))]  # insertion order: the oldest first
        return bool(ok)

    cls._check_equivocation = bounded
    cls._moeswarm_equivocation_bound = True
    cls._moeswarm_unbounded_check_equivocation = original  # for the test that shows why


# ---------------------------------------------------------------- the router


def make_pubsub(host: IHost, degree: int, heartbeat_s: int) -> tuple[Pubsub, GossipSub]:
    """A GossipSub router (mesh ``degree``, heartbeat every ``heartbeat_s``) and its pubsub."""
    install_equivocation_bound()
    router = GossipSub(
        protocols=[PROTOCOL_ID_V12, PROTOCOL_ID_V11, PROTOCOL_ID],
        degree=degree, degree_low=max(2, degree * 2 // 3), degree_high=degree * 2,
        heartbeat_initial_delay=0.5, heartbeat_interval=heartbeat_s,
        spam_protection_enabled=False,  # see the module docstring: TopicGate budgets instead
        eclipse_protection_enabled=False,  # needs the peer scorer, which we do not run
    )
    return Pubsub(host, router, strict_signing=True), router


def forwarder_address(host: IHost, peer: ID) -> str | None:
    """The counting key (``address_key``) of the address ``peer`` is connected from."""
    for conn in host.get_network().get_connections(peer):
        try:
            remote = conn.muxed_conn.get_remote_address()  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 -- a transport without addresses
            remote = None
        if remote:
            return address_key(remote)
    return None


# ---------------------------------------------------------------- first view


async def _read_exactly(stream: Any, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = await stream.read(n - len(data))
        if not chunk:
            raise ProtocolError(f"the stream ended {n - len(data)} bytes short")
        data += chunk
    return data


async def _read_frame(stream: Any, limit: int) -> bytes:
    (length,) = struct.unpack(">I", await _read_exactly(stream, 4))
    if length > limit:
        raise ProtocolError(f"frame of {length} bytes exceeds {limit}")
    return await _read_exactly(stream, length) if length else b""


def serve_records(host: IHost, sources: dict[str, Callable[[], list[bytes]]]) -> None:
    """Answer first-view requests: one frame naming a model, then one frame per record kept of
    it (``sources[model]()``) and an empty frame."""

    async def handle(stream: Any) -> None:
        try:
            with trio.move_on_after(10):
                model = (await _read_frame(stream, SYNC_MAX_MODEL_ID_BYTES)).decode("utf-8", "replace")
                source = sources.get(model)
                records = source() if source is not None else []
                await stream.write(sync_answer(records))
        except Exception as exc:  # noqa: BLE001 -- a stranger's broken request: drop it
            log.debug("first-view request: %r", exc)
        finally:
            await stream.close()

    host.set_stream_handler(SYNC_PROTOCOL, handle)


async def fetch_records(host: IHost, peer: str, model_id: str, max_records: int) -> list[bytes]:
    """Every record ``peer`` keeps of ``model_id``, at most ``max_records`` (unchecked bytes)."""
    stream = await host.new_stream(ID.from_base58(peer), [SYNC_PROTOCOL])
    try:
        await stream.write(sync_request(model_id))
        records: list[bytes] = []
        while record := await _read_frame(stream, MAX_RECORD_BYTES):
            if len(records) >= max_records:
                raise ProtocolError(f"peer {peer} sent more than {max_records} records")
            records.append(record)
        return records
    finally:
        await stream.close()
