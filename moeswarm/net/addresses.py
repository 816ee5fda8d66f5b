"""What per-address limits count: one IPv4 address, or one IPv6 /64.

A subscriber gets a whole IPv6 /64 (2^64 addresses), so a limit per single IPv6 address limits
nothing; every per-address cap of the data plane and the relay counts /64 prefixes instead.
"""

from __future__ import annotations

import ipaddress


def address_key(peer: object) -> str:
    """The counting key of a peer address: ``peername`` tuple or host text -> ``"1.2.3.4"`` or
    ``"2001:db8::/64"`` (an IPv4-mapped IPv6 address counts as its IPv4 address)."""
    host = peer[0] if isinstance(peer, tuple) and peer else str(peer)
    text = str(host).strip("[]").split("%")[0]
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return text
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)
