"""Process plumbing every moeswarm daemon shares (node, backbone, relay, bridge, monitor): range
parsing, identity files, the ``READY {json}`` line, SIGINT/SIGTERM, and joining the control plane.

Importing this module loads neither libp2p nor trio: ``p2p_node`` imports them when a daemon
actually joins the DHT.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ._keys import load_key_file
from .errors import ConfigError
from .protocol import Identity


def parse_range(text: str | None, upper: int, what: str) -> tuple[int, int]:
    """``"A-B"`` (inclusive, as a person writes it) or ``"A"``; ``None`` means all of ``0..upper-1``."""
    if text is None or text == "all":
        return 0, upper - 1
    try:
        a, _, b = text.partition("-")
        first, last = int(a), int(b) if b else int(a)
    except ValueError:
        raise ConfigError(f"--{what} takes an inclusive range like 0-31, not {text!r}") from None
    if not 0 <= first <= last < upper:
        raise ConfigError(f"--{what} {text} is outside 0-{upper - 1}")
    return first, last


def load_identity(path: str | None) -> Identity:
    """The node's Ed25519 key from ``path`` (created, mode 0600, if missing), or a fresh one."""
    return Identity.generate() if path is None else load_key_file(path, create=True, what="identity file")


def public_multiaddrs(multiaddrs: list[str], cfg: "SwarmConfig") -> list[str]:
    """Listen addresses as others should dial them (``--announce-host`` replaces the bound host)."""
    if not cfg.announce_host:
        return list(multiaddrs)
    return [m.replace(f"/ip4/{cfg.host}/", f"/ip4/{cfg.announce_host}/", 1) for m in multiaddrs]


def ready(info: dict[str, Any]) -> None:
    sys.stdout.write("READY " + json.dumps(info, sort_keys=True) + "\n")
    sys.stdout.flush()


@dataclass(frozen=True)
class SwarmConfig:
    """What every swarm process shares: where the model is and how to reach the DHT."""

    model_dir: str
    bootstrap: tuple[str, ...] = ()  # multiaddrs with /p2p/<peer id>; none = this is a bootstrap peer
    host: str = "127.0.0.1"  # address to listen on (libp2p and data plane)
    announce_host: str | None = None  # address others should dial, if not ``host``
    p2p_port: int = 0  # 0 picks a free port
    client_mode: bool = False  # behind NAT: DHT client mode
    model_id: str | None = None  # default: derived from the checkpoint (model_id_for)
    identity_file: str | None = None


@contextlib.asynccontextmanager
async def p2p_node(identity: Identity, cfg: SwarmConfig) -> AsyncIterator[Any]:
    from .net.p2p import (  # imports libp2p (1-2 s): only when a daemon starts
        P2PConfig,
        P2PNode,
    )

    node = P2PNode(identity, P2PConfig(listen=f"/ip4/{cfg.host}/tcp/{cfg.p2p_port}", bootstrap=cfg.bootstrap,
                                       client_mode=cfg.client_mode))
    await node.start()
    try:
        yield node
    finally:
        await node.stop()


def stop_event() -> asyncio.Event:
    event = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, event.set)
    return event
