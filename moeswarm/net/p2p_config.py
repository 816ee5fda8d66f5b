"""How a node joins the control plane (``P2PConfig``): plain data, no libp2p or trio import, so
``_libp2p_patches`` and ``p2p`` can both name it."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from moeswarm.errors import ConfigError


@dataclass(frozen=True)
class P2PConfig:
    """How a node joins the control plane. Times are seconds."""

    listen: str = "/ip4/127.0.0.1/tcp/0"  # multiaddr to listen on (tcp/0: any free port)
    bootstrap: tuple[str, ...] = ()  # full multiaddrs ending in /p2p/<peer id>; () = first node
    client_mode: bool = False  # NAT'd node: DHT client, never in others' routing tables
    max_connections: int = 64  # hard cap on connections; prune above 3/4 of it (finding 9)
    dial_timeout_s: float = 10.0  # bound on one dial, bootstrap dials included
    op_timeout_s: float = 30.0  # bound on one DHT operation, and on the bootstrap lookup
    stop_timeout_s: float = 10.0  # bound on stop(): close connections, end the thread
    max_values: int = 50_000  # DHT values stored here for the swarm, all peers together
    max_values_per_peer: int = 2_048  # ... charged to the peer each key names; over it, its own oldest goes
    bootstrap_lookup: bool = True  # after the bootstrap dials, look ourselves up to fill the routing table
    # (seconds of CPU in py-libp2p per node; a node announcing on a topic only may skip it)
    gossip: bool = True  # run GossipSub: announcement topics and first-view answers (moeswarm.net.gossip)
    gossip_degree: int = 6  # GossipSub mesh degree D per topic (D_low = 2D/3, D_high = 2D)
    gossip_heartbeat_s: int = 1  # GossipSub heartbeat: mesh repair, IHAVE gossip (whole seconds)

    def __post_init__(self) -> None:
        listen_socket_address(self.listen)  # ConfigError unless /ip4|ip6/<address>/tcp/<port>
        for addr in self.bootstrap:
            if "/p2p/" not in addr:
                raise ConfigError(f"bootstrap address {addr!r} lacks /p2p/<peer id>")
        if self.max_values < 1 or self.max_values_per_peer < 1:
            raise ConfigError("max_values and max_values_per_peer must be at least 1")
        if self.gossip_degree < 2 or self.gossip_heartbeat_s < 1:
            raise ConfigError("gossip_degree must be at least 2 and gossip_heartbeat_s at least 1")
        if self.max_connections < 4:
            raise ConfigError(f"max_connections must be at least 4, not {self.max_connections}")
        for name in ("dial_timeout_s", "op_timeout_s", "stop_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive")


def listen_socket_address(listen: str) -> tuple[socket.AddressFamily, str, int]:
    parts = listen.split("/")
    if len(parts) != 5 or parts[0] or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp" \
            or not parts[4].isdigit() or int(parts[4]) > 65535:
        raise ConfigError(f"listen must look like /ip4/<address>/tcp/<port>, not {listen!r}")
    family = socket.AF_INET if parts[1] == "ip4" else socket.AF_INET6
    return family, parts[2], int(parts[4])
