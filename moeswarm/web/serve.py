"""``moeswarm bridge --web``: serve the volunteer page for a private swarm, pointing at a relay.

The phones of a private swarm open ``https://THIS-HOST:PORT/volunteer/``; the page downloads the
shards from here and dials the relay itself. The page needs the relay's channel binding (a
browser cannot read the certificate of its WebSocket's TLS session): this server reads it once
from a TLS connection to the relay, verified against ``--ca`` (or the system store), and hands it
to the page with its config.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

from ..daemon import listen_problem, ready, say, stop_event
from ..errors import ConfigError, Unreachable
from ..relay import binding_of, client_context
from .volunteer import VolunteerSite, add_volunteer_routes


@dataclass(frozen=True)
class WebConfig:
    host: str
    port: int  # 0: any free port
    relay_url: str  # wss://HOST:PORT of the relay the page dials
    shards_dir: str  # the export-onnx folder the page downloads
    ca_file: str | None = None  # trust this CA for the relay (default: the system store)
    cert_file: str | None = None  # serve the page over TLS (a phone's browser needs https: WebCrypto)
    key_file: str | None = None


async def relay_binding(relay_url: str, ca_file: str | None, timeout_s: float = 15.0) -> bytes:
    """SHA-256 of the certificate the relay presents (verified); empty for a ws:// relay."""
    parts = urlsplit(relay_url)
    if parts.scheme == "ws":
        return b""
    if parts.scheme != "wss" or not parts.hostname:
        raise ConfigError(f"--relay takes wss://HOST[:PORT], not {relay_url!r}")
    try:
        async with asyncio.timeout(timeout_s):
            _, writer = await asyncio.open_connection(parts.hostname, parts.port or 443, ssl=client_context(ca_file),
                                                      server_hostname=parts.hostname)
    except (OSError, ssl.SSLError, TimeoutError) as e:
        raise Unreachable(f"cannot read the certificate of relay {relay_url}: {e}") from None
    ssl_object = writer.get_extra_info("ssl_object")
    der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
    writer.close()
    return binding_of(der)


async def serve_web(config: WebConfig, on_ready: Callable[[dict[str, Any]], None] = ready,
                    stop: asyncio.Event | None = None) -> None:
    """Serve until ``stop`` (default: SIGINT/SIGTERM); prints READY with the page's URL."""
    if (config.cert_file is None) != (config.key_file is None):
        raise ConfigError("--web-cert and --web-key go together")
    stop = stop or stop_event()
    binding = await relay_binding(config.relay_url, config.ca_file)
    app = web.Application()
    add_volunteer_routes(app, VolunteerSite(lambda: config.relay_url.rstrip("/"), lambda: binding, config.shards_dir))
    tls = None
    if config.cert_file and config.key_file:
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            tls.load_cert_chain(config.cert_file, config.key_file)
        except (OSError, ssl.SSLError) as e:
            raise ConfigError(f"cannot load --web-cert {config.cert_file} / --web-key {config.key_file}: {e}") from None
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    try:
        site = web.TCPSite(runner, config.host, config.port, ssl_context=tls)
        try:
            await site.start()
        except OSError as e:
            raise ConfigError(f"--web {config.host}:{config.port}: {listen_problem(e)}") from None
        port = int(runner.addresses[0][1])
        url = f"{'https' if tls else 'http'}://{config.host}:{port}/volunteer/"
        on_ready({"url": url, "relay": config.relay_url, "port": port})
        say(f"serving the volunteer page at {url} for relay {config.relay_url} (Ctrl-C to stop)")
        await stop.wait()
    finally:
        await runner.cleanup()
