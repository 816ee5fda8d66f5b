"""The port-443 relay: NAT'd devices dial out and hold a session; clients reach them through it.

Operators run ``moeswarm relay`` (``daemon.run_relay``); backbones dial announced
``relay+wss://HOST:PORT/<device peer id>`` endpoints with ``open_relay_stream`` (used by
``ExpertClient.connect``); devices (``moeswarm.mobile_bridge``) speak the session protocol of
``protocol_spec/relay.md``, whose pieces are exported here.
"""

from ._dial import open_relay_stream, parse_relay_endpoint, relay_endpoint
from ._directory import DhtDirectory, Directory, MemoryDirectory, check_publish
from ._envelope import (
    CLIENT_SUBPROTOCOL,
    DEVICE_PATH,
    DEVICE_SUBPROTOCOL,
    RELAY_SCHEME,
    CloseCode,
    GoAway,
    Kind,
    Publish,
    Published,
    UnknownControl,
    Welcome,
    WSClose,
    check_frame,
    close_payload,
    decode_control,
    encode_control,
    pack,
    parse_close,
    unpack,
)
from ._limits import PeerBudget, Quota, RelayLimits, TokenBucket
from ._outbox import Outbox, OutboxClosed
from ._server import RelayConfig, RelayServer
from ._tls import binding_of, client_context, set_relay_ca
from ._transport import FrameTransport, StreamFlow, open_stream

__all__ = [
    # running a relay
    "RelayServer", "RelayConfig", "RelayLimits", "Directory", "DhtDirectory", "MemoryDirectory",
    "check_publish", "TokenBucket", "Quota", "PeerBudget",
    # dialing through one
    "open_relay_stream", "parse_relay_endpoint", "relay_endpoint", "set_relay_ca", "client_context", "binding_of",
    # the session wire format (devices)
    "Kind", "CloseCode", "WSClose", "Welcome", "Publish", "Published", "GoAway", "UnknownControl", "pack", "unpack", "check_frame",
    "encode_control", "decode_control", "close_payload", "parse_close", "DEVICE_PATH", "DEVICE_SUBPROTOCOL",
    "CLIENT_SUBPROTOCOL", "RELAY_SCHEME",
    # plumbing shared with the bridge
    "Outbox", "OutboxClosed", "FrameTransport", "StreamFlow", "open_stream",
]
