"""The relay process: DHT node + relay server; one ``READY {json}`` line once it serves.

SIGTERM/SIGINT drain gracefully (devices are told to reconnect); SIGHUP reloads the TLS
certificate files (after a certbot renewal).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from ..daemon import DRAIN_GRACE_S, listen_problem, load_identity, ready, say, stop_event
from ..errors import ConfigError
from ..net.p2p import P2PConfig, P2PNode
from ._directory import DhtDirectory, Directory, MemoryDirectory
from ._server import RelayConfig, RelayServer


@dataclass(frozen=True)
class RelayDaemonConfig:
    relay: RelayConfig = field(default_factory=RelayConfig)
    bootstrap: tuple[str, ...] = ()  # multiaddrs ending in /p2p/<peer id>; none: this relay bootstraps
    p2p_listen: str | None = None  # libp2p listen multiaddr; default: loopback:any for a loopback relay,
    #                                else /ip4/0.0.0.0/tcp/4001
    identity_file: str | None = None  # the relay's Ed25519 key (created if missing); default: fresh each run
    dht: bool = True  # False: do not join the DHT (devices' announcements are accepted, not stored)


def default_p2p_listen(host: str) -> str:
    if host.startswith("127.") or host in ("localhost", "::1"):
        return "/ip4/127.0.0.1/tcp/0"
    return "/ip4/0.0.0.0/tcp/4001"


@contextlib.asynccontextmanager
async def _directory(config: RelayDaemonConfig, identity: Any) -> AsyncIterator[tuple[Directory, list[str]]]:
    if not config.dht:
        yield MemoryDirectory(), []
        return
    listen = config.p2p_listen or default_p2p_listen(config.relay.host)
    say(f"joining the swarm through {', '.join(config.bootstrap)}..." if config.bootstrap
        else f"starting the DHT on {listen}: this relay is a bootstrap peer...")
    node = P2PNode(identity, P2PConfig(listen=listen, bootstrap=config.bootstrap))
    await node.start()
    try:
        yield DhtDirectory(node), node.multiaddrs
    finally:
        await node.stop()


async def run_relay(config: RelayDaemonConfig, on_ready: Callable[[dict[str, Any]], None] = ready,
                    stop: asyncio.Event | None = None) -> None:
    identity = load_identity(config.identity_file)
    stop = stop or stop_event(max(DRAIN_GRACE_S, config.relay.limits.drain_timeout_s + 1))  # --drain-timeout
    async with _directory(config, identity) as (directory, multiaddrs):
        server = RelayServer(identity, config.relay, directory)
        try:
            await server.start()
        except OSError as e:
            raise ConfigError(f"--listen {config.relay.host}:{config.relay.port}: {listen_problem(e)}") from None
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signal.SIGHUP, server.reload_tls)
        try:
            http = server.url.replace("wss://", "https://").replace("ws://", "http://")
            on_ready({"url": server.url, "peer_id": identity.peer_id_str, "multiaddrs": multiaddrs,
                      "port": server.port, "healthz": f"{http}/healthz", "metrics": f"{http}/metrics"})
            say(f"relaying for devices at {server.url}/device, health at {http}/healthz (Ctrl-C to stop)")
            await stop.wait()
            say("telling devices to reconnect elsewhere, draining streams in flight...")
        finally:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(signal.SIGHUP)
            await server.aclose(graceful=True)
