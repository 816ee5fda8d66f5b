"""Use a moeswarm swarm from Python.

    from moeswarm.sdk import Client
    client = Client("http://127.0.0.1:8000")     # a backbone's HTTP API
    print(client.generate("And it came to pass", max_new_tokens=20))
    for piece in client.chat([{"role": "user", "content": "Hi"}], stream=True): ...

Without a backbone, through the swarm's gateways (``moeswarm.sdk.gateway``)::

    from moeswarm.sdk import GatewayClient, find_gateways
    client = GatewayClient(find_gateways(["/ip4/.../p2p/12D3Koo..."], "mixtral-e4bde7c04b4d"))
    for text, token_ids in client.stream("And it came to pass", max_new_tokens=20): ...

Errors are moeswarm's own (re-exported here): ``Unreachable``, ``Timeout``, ``ConfigError``,
``BadResponse``, all ``SwarmError``.
"""

from __future__ import annotations

from ..errors import BadResponse, ConfigError, NetworkError, SwarmError, Timeout, Unreachable
from .client import Client

__all__ = ["BadResponse", "Client", "ConfigError", "GatewayClient", "NetworkError", "SwarmError", "Timeout",
           "Unreachable", "find_gateways"]


def __getattr__(name: str) -> object:
    """``GatewayClient`` and ``find_gateways`` load the protocol's codecs (numpy): only when used."""
    if name in ("GatewayClient", "find_gateways"):
        from . import gateway

        return getattr(gateway, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
