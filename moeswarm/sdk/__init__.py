"""Use a moeswarm swarm from Python.

    from moeswarm.sdk import Client
    client = Client("http://127.0.0.1:8000")     # a backbone's HTTP API
    print(client.generate("And it came to pass", max_new_tokens=20))
    for piece in client.chat([{"role": "user", "content": "Hi"}], stream=True): ...

Errors are moeswarm's own (re-exported here): ``Unreachable``, ``Timeout``, ``ConfigError``,
``BadResponse``, all ``SwarmError``.
"""

from __future__ import annotations

from ..errors import BadResponse, ConfigError, NetworkError, SwarmError, Timeout, Unreachable
from .client import Client

__all__ = ["BadResponse", "Client", "ConfigError", "NetworkError", "SwarmError", "Timeout", "Unreachable"]
