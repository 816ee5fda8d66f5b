"""The control plane: one libp2p node (py-libp2p 0.8.1, trio) behind a small asyncio API.

``P2PNode`` owns a thread that runs trio, a libp2p host (TCP, Noise only, Yamux) and a
Kademlia DHT whose only namespace is ``/moeswarm/``, validated by
``moeswarm.protocol.validate_record``. Everything libp2p-specific, including the workarounds
for the bugs in ``spikes/libp2p/FINDINGS.md``, is in ``_libp2p_patches``, which is imported in
that thread on first start (``import libp2p`` takes 1-2 s). Every call crosses into trio with
``TrioToken.run_sync_soon`` and comes back through an asyncio future, so nothing blocks the
event loop; each call runs in a nursery the node owns, bounded by ``op_timeout_s``, and is
cancelled in trio when the awaiting asyncio task is cancelled.

    async with P2PNode(identity, P2PConfig(bootstrap=(addr,))) as node:
        await node.put(key, encode(announcement))
        holders = await node.find_providers(provider_key(model, layer))
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, Final, TypeVar

import trio

from moeswarm.errors import ConfigError, NetworkError, SwarmError, Timeout
from moeswarm.protocol import Identity, peer_id_to_str

from .p2p_config import P2PConfig, listen_socket_address

__all__ = ["P2PConfig", "P2PNode", "WORKAROUNDS"]

log = logging.getLogger(__name__)
T = TypeVar("T")

WORKAROUNDS: Final = frozenset({"inbound_slots", "routing_table", "sockets"})
"""The workarounds a node can switch off, for tests that show why each exists."""

MAX_VALUE_KEY_BYTES: Final = 128  # py-libp2p servers reset GET_VALUE for longer keys
MAX_PROVIDER_KEY_BYTES: Final = 80  # ... and ADD_PROVIDER for longer ones


class P2PNode:
    """A libp2p peer in its own trio thread; use as ``async with`` or ``start()``/``stop()``.

    ``peer_id`` is the libp2p peer ID of ``identity`` (the same key signs our records);
    ``multiaddrs`` (listen addresses ending in ``/p2p/<peer_id>``) is filled by ``start()``.
    The node is not tied to an event loop: each call answers on the caller's running loop.
    Errors are ``moeswarm.errors``: ``ConfigError`` for bad keys or addresses,
    ``ProtocolError`` for records the validator refuses, ``Unreachable`` when no bootstrap
    peer answers, ``Timeout`` when an operation outlives ``op_timeout_s``, ``NetworkError``
    for the rest.
    """

    def __init__(self, identity: Identity, config: P2PConfig | None = None, *,
                 _workarounds: frozenset[str] = WORKAROUNDS) -> None:
        if not _workarounds <= WORKAROUNDS:
            raise ConfigError(f"unknown workarounds {sorted(_workarounds - WORKAROUNDS)}")
        self._identity = identity
        self.config = config if config is not None else P2PConfig()
        self._workarounds = _workarounds
        self.peer_id: str = identity.peer_id_str
        self.multiaddrs: list[str] = []
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._main_scope = trio.CancelScope()  # cancelled by stop(); thread-agnostic until entered
        self._lock = threading.Lock()  # orders stop() against the thread publishing its token
        self._stopping = False
        self._ready_sent = False
        self._glue: Any = None  # the _libp2p_patches module, once imported
        self._host: Any = None  # libp2p IHost, touched only in the trio thread
        self._dht: Any = None  # _libp2p_patches.MoeswarmDHT, idem
        self._gossip: Any = None  # the _libp2p_gossip module, when config.gossip
        self._pubsub: Any = None  # libp2p Pubsub (GossipSub router), trio thread only
        self._sync_sources: dict[str, Callable[[], list[bytes]]] = {}  # model -> records for first views

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> P2PNode:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.stop()

    async def start(self) -> None:
        """Listen, dial the bootstrap peers, fill the routing table; then return.

        Raises ``Unreachable`` if no bootstrap peer answers within ``dial_timeout_s``.
        """
        if self._thread is not None:
            raise ConfigError("a P2PNode starts only once")
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[list[str]] = loop.create_future()
        self._thread = threading.Thread(target=self._thread_main, args=(loop, ready),
                                        name=f"p2p-{self.peer_id[-8:]}", daemon=True)
        self._thread.start()
        try:
            self.multiaddrs = await ready
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        """Close every connection, end the trio thread and join it (idempotent, bounded)."""
        if self._thread is None:
            return
        if self._pubsub is not None and self._nursery is not None and not self._stopping:
            # connections first, while pubsub still runs: a stream still reading when pubsub's
            # own tasks are cancelled hands it a message after its nursery has closed (a crash)
            with contextlib.suppress(SwarmError):
                await self._call(self._close_connections)
        with self._lock:
            self._stopping = True
            token = self._token
        if token is not None:
            try:
                token.run_sync_soon(self._main_scope.cancel)
            except trio.RunFinishedError:
                pass
        await asyncio.to_thread(self._thread.join, self.config.stop_timeout_s)
        if self._thread.is_alive():
            raise Timeout(f"libp2p node {self.peer_id} did not stop within "
                          f"{self.config.stop_timeout_s} s")

    def _thread_main(self, loop: asyncio.AbstractEventLoop,
                     ready: asyncio.Future[list[str]]) -> None:
        try:
            _check_port_free(self.config.listen)
            from . import _libp2p_patches as glue  # the slow import, off the event loop

            self._glue = glue
            if self.config.gossip:
                from . import _libp2p_gossip

                self._gossip = _libp2p_gossip
            trio.run(self._trio_main, loop, ready)
            if not self._ready_sent:  # stop() came first
                _deliver(loop, ready, error=NetworkError("the node was stopped while starting"))
        except BaseException as exc:  # noqa: BLE001 -- reported to start() or logged
            error = self._translate(exc)
            if self._ready_sent:
                log.error("libp2p node %s crashed", self.peer_id, exc_info=error)
            else:
                _deliver(loop, ready, error=error)

    async def _trio_main(self, loop: asyncio.AbstractEventLoop,
                         ready: asyncio.Future[list[str]]) -> None:
        glue = self._glue
        with self._lock:
            self._token = trio.lowlevel.current_trio_token()
            if self._stopping:
                return
        self._host = host = glue.make_host(self._identity, self.config,
                                           "inbound_slots" in self._workarounds)
        self._dht = dht = glue.MoeswarmDHT(host, client_mode=self.config.client_mode,
                                           max_values=self.config.max_values,
                                           max_values_per_peer=self.config.max_values_per_peer)
        if "routing_table" in self._workarounds:
            dht.install_hygiene()
        router = None
        if self._gossip is not None:
            self._pubsub, router = self._gossip.make_pubsub(host, self.config.gossip_degree,
                                                            self.config.gossip_heartbeat_s)
            self._gossip.serve_records(host, self._sync_sources)
        async with host.run(listen_addrs=[glue.Multiaddr(self.config.listen)]):
            try:
                with self._main_scope:
                    async with contextlib.AsyncExitStack() as services:
                        await services.enter_async_context(glue.background_trio_service(dht))
                        if router is not None:
                            await services.enter_async_context(glue.background_trio_service(self._pubsub))
                            await services.enter_async_context(glue.background_trio_service(router))
                            await self._pubsub.wait_until_ready()
                        nursery = await services.enter_async_context(trio.open_nursery())
                        if not host.get_addrs():
                            raise ConfigError(f"cannot listen on {self.config.listen}")
                        await glue.bootstrap(host, dht, self.config)
                        self._nursery = nursery
                        self._ready_sent = True
                        _deliver(loop, ready, glue.listen_addrs(host))
                        await trio.sleep_forever()
            finally:  # leaving host.run() does not close connections (finding 2)
                self._nursery = None
                with trio.move_on_after(self.config.stop_timeout_s / 2) as scope:
                    scope.shield = True
                    await glue.close_host(host)
                if "sockets" in self._workarounds:  # what a close left open goes now, not at collection
                    left = glue.close_sockets_left()
                    if left:
                        log.debug("libp2p node %s: closed %d socket(s) its connections left open",
                                  self.peer_id, left)

    async def _close_connections(self) -> None:
        with trio.move_on_after(self.config.stop_timeout_s / 2) as scope:
            scope.shield = True
            await self._glue.close_connections(self._host)

    # ------------------------------------------------------------------ operations

    async def put(self, key: str, value: bytes) -> int:
        """Validate and store ``value`` under ``key`` here and on the closest peers.

        Returns how many remote peers accepted it (0 when alone, or when every peer already
        holds these bytes or a newer record). ``ProtocolError`` if our validator refuses it.
        """
        _check_key(key, MAX_VALUE_KEY_BYTES)
        return await self._call(lambda: self._dht.put_counted(key, bytes(value)))

    async def get(self, key: str) -> bytes | None:
        """The best valid value for ``key`` (highest seq, not expired), or ``None``."""
        _check_key(key, MAX_VALUE_KEY_BYTES)
        return await self._call(lambda: self._dht.get_fresh(key))

    async def provide(self, key: str) -> None:
        """Announce on the closest peers that this node provides ``key`` (48 h lifetime)."""
        _check_key(key, MAX_PROVIDER_KEY_BYTES)
        await self._call(lambda: self._dht.provide_key(key))

    async def find_providers(self, key: str, limit: int = 20) -> list[str]:
        """Peer IDs providing ``key`` (this node included if it does), no duplicates."""
        _check_key(key, MAX_PROVIDER_KEY_BYTES)
        return await self._call(lambda: self._dht.find_providers_fresh(key, limit))

    async def connected_peers(self) -> list[str]:
        """Peer IDs this node holds a connection to."""
        return await self._call(self._connected_peers)

    async def routing_table(self) -> list[str]:
        """Peer IDs in this node's DHT routing table (for diagnostics and tests)."""
        return await self._call(self._routing_table)

    # ------------------------------------------------------------------ gossip (config.gossip)

    async def subscribe(self, topic: str, check: Callable[[str, str | None, bytes], bool | None]) -> None:
        """Join ``topic``'s mesh. ``check(forwarder, address, data)`` runs in the libp2p thread for
        every message not seen before: ``forwarder`` is the peer ID that sent it to us ("self" for
        our own), ``address`` the counting key of its address (``None`` for ours); a message is
        delivered and forwarded only if it returns ``True``; ``False`` refuses it for good (it is
        then remembered as seen: gossip does not fetch it again), ``None`` refuses this copy only.
        It must be quick and must not block."""
        gossip = self._require_gossip()

        async def subscribe() -> None:
            me = self._host.get_id()

            def validator(forwarder: Any, msg: Any) -> bool:
                if forwarder == me:
                    peer, address = "self", None
                else:
                    peer, address = str(forwarder), gossip.forwarder_address(self._host, forwarder)
                try:
                    verdict = check(peer, address, bytes(msg.data))
                except Exception:
                    log.exception("checking a message of %s", topic)
                    return False
                if verdict is False:
                    gossip.remember_refused(self._pubsub, msg)
                return bool(verdict)

            self._pubsub.set_topic_validator(topic, validator, False)
            subscription = await self._pubsub.subscribe(topic)
            if self._nursery is not None:
                self._nursery.start_soon(_drain, subscription)

        await self._call(subscribe)

    async def unsubscribe(self, topic: str) -> None:
        self._require_gossip()

        async def unsubscribe() -> None:
            await self._pubsub.unsubscribe(topic)
            self._pubsub.remove_topic_validator(topic)

        await self._call(unsubscribe)

    async def publish(self, topic: str, data: bytes) -> None:
        """Send ``data`` to ``topic``'s subscribers (our own ``check`` sees it first)."""
        self._require_gossip()
        await self._call(lambda: self._pubsub.publish(topic, bytes(data)))

    async def topic_peers(self, topic: str) -> list[str]:
        """Connected peers that told us they subscribe to ``topic``."""
        self._require_gossip()

        async def peers() -> list[str]:
            return sorted(str(p) for p in self._pubsub.peer_topics.get(topic, ()))

        return await self._call(peers)

    async def serve_records(self, model_id: str, source: Callable[[], list[bytes]] | None) -> None:
        """Answer first-view requests for ``model_id`` with ``source()`` (called in the libp2p
        thread); ``None`` stops answering."""
        self._require_gossip()
        if source is None:
            self._sync_sources.pop(model_id, None)
        else:
            self._sync_sources[model_id] = source

    async def fetch_records(self, peer_id: str, model_id: str, max_records: int) -> list[bytes]:
        """The records ``peer_id`` keeps of ``model_id`` (one round trip; unchecked bytes)."""
        gossip = self._require_gossip()
        return await self._call(lambda: gossip.fetch_records(self._host, peer_id, model_id, max_records))

    async def connect(self, peer_id: str) -> None:
        """Open a connection to ``peer_id`` at the addresses a lookup left in the peerstore."""
        from libp2p.peer.id import ID

        async def connect() -> None:
            info = self._host.get_peerstore().peer_info(ID.from_base58(peer_id))
            await self._host.connect(info)

        await self._call(connect)

    def _require_gossip(self) -> Any:
        if self._gossip is None:
            raise ConfigError("this node runs without gossip (P2PConfig.gossip=False)")
        return self._gossip

    async def _connected_peers(self) -> list[str]:
        return sorted({str(p) for p in self._host.get_connected_peers()})

    async def _routing_table(self) -> list[str]:
        return sorted(str(p) for p in self._dht.routing_table.get_peer_ids())

    async def _call(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Run ``fn()`` in the trio thread and await its result from asyncio."""
        token = self._token
        if token is None or self._nursery is None:
            raise NetworkError(f"libp2p node {self.peer_id} is not running")
        loop = asyncio.get_running_loop()
        result: asyncio.Future[T] = loop.create_future()
        scope = trio.CancelScope()
        try:
            token.run_sync_soon(self._spawn, fn, scope, loop, result)
        except trio.RunFinishedError:
            raise NetworkError(f"libp2p node {self.peer_id} has stopped") from None
        # trio bounds the operation; this bound only matters if libp2p code ever shields itself
        # from that cancellation, and keeps the asyncio caller from waiting for ever
        bound = asyncio.timeout(self.config.op_timeout_s + self.config.stop_timeout_s)
        try:
            async with bound:
                return await result
        except BaseException as e:
            if isinstance(e, (asyncio.CancelledError, TimeoutError)):
                try:
                    token.run_sync_soon(scope.cancel)
                except trio.RunFinishedError:
                    pass
            if isinstance(e, TimeoutError) and bound.expired():
                raise Timeout(f"DHT operation ignored its {self.config.op_timeout_s} s bound") from None
            raise

    def _spawn(self, fn: Callable[[], Awaitable[T]], scope: trio.CancelScope,
               loop: asyncio.AbstractEventLoop, result: asyncio.Future[T]) -> None:
        try:
            if self._nursery is None:
                raise RuntimeError("no nursery")
            self._nursery.start_soon(self._run, fn, scope, loop, result)
        except RuntimeError:  # stopping: the nursery is gone or closed to new arrivals
            _deliver(loop, result, error=NetworkError("the node is stopping"))

    async def _run(self, fn: Callable[[], Awaitable[T]], scope: trio.CancelScope,
                   loop: asyncio.AbstractEventLoop, result: asyncio.Future[T]) -> None:
        error: BaseException = NetworkError("the node is stopping")  # if cancelled by stop()
        answered = False
        try:
            with scope, trio.fail_after(self.config.op_timeout_s):
                _deliver(loop, result, await fn())
                answered = True
        except trio.TooSlowError:
            error = Timeout(f"DHT operation outlived {self.config.op_timeout_s} s")
        except Exception as exc:  # noqa: BLE001 -- translated for the caller
            error = self._translate(exc)
        finally:  # also when cancelled: by the caller (who no longer listens) or by stop()
            if not answered:
                _deliver(loop, result, error=error)

    async def add_local_provider(self, key: str, peer_id: bytes) -> None:
        """List ``peer_id`` (a device behind this relay) as a provider of ``key`` in this node's own store."""
        from libp2p.peer.id import ID
        from libp2p.peer.peerinfo import PeerInfo

        async def add() -> None:
            info = PeerInfo(ID(peer_id), list(self._host.get_addrs()))
            self._dht.provider_store.add_provider(key.encode(), info)

        await self._call(add)

    async def remove_local_provider(self, peer_id: bytes) -> None:
        """Stop listing ``peer_id`` as a provider of anything here."""
        text = peer_id_to_str(peer_id)

        async def remove() -> None:
            providers: dict[bytes, dict[str, Any]] = self._dht.provider_store.providers
            for entries in providers.values():
                entries.pop(text, None)

        await self._call(remove)

    def _translate(self, exc: BaseException) -> BaseException:
        if isinstance(exc, (SwarmError, KeyboardInterrupt, SystemExit)) or self._glue is None:
            return exc
        return self._glue.translate_error(exc)


async def _drain(subscription: Any) -> None:
    """Empty a subscription's queue: accepted messages were handled by the topic's check."""
    with contextlib.suppress(Exception):
        while True:
            await subscription.get()


def _check_port_free(listen: str) -> None:
    """``ConfigError`` if another socket listens on the port: py-libp2p sets SO_REUSEPORT (for
    hole punching), so a second node on a taken port would silently share it with the first."""
    family, address, port = listen_socket_address(listen)
    if port == 0:
        return
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((address, port))
        except OSError as exc:
            raise ConfigError(f"cannot listen on {listen}: {exc.strerror}") from None


def _check_key(key: str, limit: int) -> None:
    if not isinstance(key, str) or not key.startswith("/moeswarm/"):
        raise ConfigError(f"DHT keys live under /moeswarm/, not {key!r:.80}")
    if len(key.encode()) > limit:
        raise ConfigError(f"DHT key of {len(key.encode())} bytes exceeds libp2p's {limit}")


def _deliver(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], value: Any = None,
             *, error: BaseException | None = None) -> None:
    """Settle an asyncio future from another thread, unless it is settled already."""
    if future.done():
        return

    def settle() -> None:
        if future.done():
            return
        if error is None:
            future.set_result(value)
        else:
            future.set_exception(error)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the event loop has closed: nobody is waiting any more
        pass
