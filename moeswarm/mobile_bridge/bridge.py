"""``moeswarm bridge``: an edge device serving ONNX expert shards through a relay.

The bridge never listens. It dials the relay, proves its identity, signs its own announcement
(endpoint ``relay+wss://HOST:PORT/<its peer id>``) and hands it to the relay to store in the
DHT, then answers the expert calls the relay forwards, with ``OnnxExpertServer``.

Which experts it serves: by default everything its shard folder holds, narrowed by
``--layers``/``--experts``, or as an ``AssignmentHook`` (a coroutine that, given the shards on
disk, returns the assignment to serve) decides. With ``--experts auto`` the market chooses
before any shard exists: ``auto.market_shards`` exports its block and the bridge serves all of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from .._tasks import cancel_and_wait
from ..daemon import load_identity, parse_range, ready, say, span, stop_event
from ..errors import SwarmError, Timeout
from ..net.dataplane import DataPlaneServer, ServerConfig
from ..net.expert_service import ExpertServerConfig
from ..protocol import Identity, encode, peer_id_from_str, sign_announcement
from ..relay import Welcome
from ._manifest import Manifest
from .link import LinkConfig, RelayLink
from .server import OnnxExpertServer
from .shards import OnnxShards, RuntimeConfig

log = logging.getLogger(__name__)
T = TypeVar("T")
SOFTWARE = "moeswarm-bridge/0.1.0"


@dataclass(frozen=True)
class Assignment:
    """What this device serves: inclusive layer and expert ranges within its shards."""

    layers: tuple[int, int]
    experts: tuple[int, int]


AssignmentHook = Callable[[Manifest], Awaitable[Assignment]]
"""Given the exported shards, decide what of them to serve (for embedders; the CLI narrows by range)."""


@dataclass(frozen=True)
class BridgeConfig:
    relay_url: str  # wss://HOST:PORT
    shards_dir: str  # an export-onnx output folder
    ca_file: str | None = None  # trust this CA for the relay (default: the system store)
    identity_file: str | None = None  # the device's Ed25519 key (created if missing)
    relay_peer: str | None = None  # pin the relay's peer ID
    layers: str | None = None  # serve only these layers of the shards (inclusive range)
    experts: str | None = None  # ... and only these experts
    threads: int = 1  # onnxruntime intra-op threads
    mmap: bool = False  # memory-map the weights (prepacking off)
    announce_interval_s: float = 240.0  # re-publish the announcement this often
    record_ttl_s: float = 600.0  # announcements expire this long after publishing
    max_backoff_s: float = 30.0  # reconnect backoff cap


def command_line_assignment(config: BridgeConfig) -> AssignmentHook:
    async def assign(manifest: Manifest) -> Assignment:
        layers = manifest.layers if config.layers is None else parse_range(config.layers, manifest.layers[1] + 1, "layers")
        experts = manifest.experts if config.experts is None else parse_range(config.experts, manifest.experts[1] + 1,
                                                                              "experts")
        return Assignment(layers, experts)

    return assign


class RelayAnnouncer:
    """Signs the device's announcement and has the relay publish it: at every new session and on a period."""

    def __init__(self, link: RelayLink, identity: Identity, server: OnnxExpertServer, assignment: Assignment,
                 config: BridgeConfig) -> None:
        self.link, self.identity, self.server = link, identity, server
        self.assignment, self.config = assignment, config
        self._seq = int(time.time() * 1000)
        self._endpoint: str | None = None
        self._wake = asyncio.Event()
        self.published = asyncio.Event()  # set once the relay confirmed a publish
        self._task: asyncio.Task[None] | None = None

    def on_session(self, welcome: Welcome) -> None:
        self._endpoint = welcome.endpoint
        self._wake.set()

    async def __aenter__(self) -> "RelayAnnouncer":
        self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)

    async def _loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.announce_interval_s):
                    await self._wake.wait()
            self._wake.clear()
            if self._endpoint is None:
                continue
            try:
                await self.publish_once(self._endpoint)
            except (SwarmError, asyncio.TimeoutError) as e:
                log.warning("announcement not published: %s", e)
                await asyncio.sleep(5)
                self._wake.set()

    async def publish_once(self, endpoint: str) -> None:
        self._seq += 1
        shards = self.server.shards
        record = sign_announcement(
            self.identity, model_id=self.server.config.model_id, layers=self.assignment.layers,
            experts=self.assignment.experts, endpoints=(endpoint,), capacity_bytes=shards.file_bytes,
            throughput=self.server.throughput, load_permille=self.server.load_permille, software=SOFTWARE,
            seq=self._seq, expires_at_ms=int((time.time() + self.config.record_ttl_s) * 1000),
        )
        published = await self.link.publish(encode(record), shards.moe_layers)
        log.info("announcement seq %d stored under %d keys", published.seq, published.keys)
        self.published.set()


async def run_bridge(config: BridgeConfig, on_ready: Callable[[dict[str, Any]], None] = ready,
                     stop: asyncio.Event | None = None, assignment_hook: AssignmentHook | None = None) -> None:
    """Serve until ``stop`` (default: SIGINT/SIGTERM); prints READY once the relay published us."""
    identity = load_identity(config.identity_file)
    stop = stop or stop_event()
    manifest = Manifest.read(config.shards_dir)
    assignment = await (assignment_hook or command_line_assignment(config))(manifest)
    shards = await asyncio.to_thread(OnnxShards, config.shards_dir, RuntimeConfig(config.threads, config.mmap),
                                     layers=assignment.layers, experts=assignment.experts)
    server = OnnxExpertServer(shards, identity, ExpertServerConfig(manifest.model_id, assignment.layers,
                                                                   assignment.experts))
    dataplane = DataPlaneServer(identity, server.handle, ServerConfig(tls=False))  # never listens: streams
    link_config = LinkConfig(config.relay_url, config.ca_file,  # come from the relay
                             peer_id_from_str(config.relay_peer) if config.relay_peer else None,
                             max_backoff_s=config.max_backoff_s)
    await server.start()
    try:
        link = RelayLink(identity, link_config, dataplane._on_connection)
        announcer = RelayAnnouncer(link, identity, server, assignment, config)
        link.on_session = announcer.on_session
        say(f"dialling relay {config.relay_url}...")
        async with link, announcer:
            welcome = await _unless_stopped(stop, link.first_session())  # the relay may be down: keep
            if welcome is None or await _unless_stopped(stop, announcer.published.wait()) is None:  # listening
                return
            on_ready({"peer_id": identity.peer_id_str, "endpoint": welcome.endpoint, "relay": config.relay_url,
                      "model_id": manifest.model_id, "layers": list(assignment.layers),
                      "experts": list(assignment.experts), "moe_layers": list(shards.moe_layers)})
            say(f"serving layers {span(assignment.layers)} x experts {span(assignment.experts)} through "
                f"{config.relay_url} as {welcome.endpoint} (Ctrl-C to stop)")
            await stop.wait()
    finally:
        await dataplane.aclose()
        await server.aclose()


async def _unless_stopped(stop: asyncio.Event, waiting: Awaitable[T]) -> T | None:
    """``await waiting``, unless ``stop`` is set first (then ``None``): a bridge whose relay is down
    goes on retrying inside ``waiting`` and must still stop when asked."""
    task, stopped = asyncio.ensure_future(waiting), asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await cancel_and_wait(stopped)
        if not task.done():
            await cancel_and_wait(task)
    return None if task.cancelled() else task.result()


@contextlib.asynccontextmanager
async def running_bridge(config: BridgeConfig, assignment_hook: AssignmentHook | None = None,
                         ready_timeout_s: float = 60.0) -> AsyncIterator[dict[str, Any]]:
    """A bridge inside this process, for embedding and tests: yields its READY information."""
    stop, ready = asyncio.Event(), asyncio.Event()
    info: dict[str, Any] = {}

    def on_ready(values: dict[str, Any]) -> None:
        info.update(values)
        ready.set()

    task = asyncio.create_task(run_bridge(config, on_ready, stop, assignment_hook))
    try:
        waiter = asyncio.create_task(ready.wait())
        await asyncio.wait({task, waiter}, timeout=ready_timeout_s, return_when=asyncio.FIRST_COMPLETED)
        await cancel_and_wait(waiter)
        if task.done():
            task.result()  # raises why the bridge could not start
        if not ready.is_set():
            raise Timeout(f"the bridge was not published within {ready_timeout_s:.0f}s")
        yield info
    finally:
        stop.set()
        if not task.done():
            async with asyncio.timeout(15):
                await task
