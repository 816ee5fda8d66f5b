"""A liar in the swarm's catalogue, run as its own process against a swarm's DHT.

    python catalogue_liar.py BOOTSTRAP_MULTIADDR CONFIG_JSON

Joins the DHT as a peer with a fresh key, serves a data plane (TLS, the real handshake) and signs a
catalogue entry, stored and provided exactly as a node does, that lists two models:

- ``swapped``: an id derived from CONFIG_JSON with ``"name": "swapped"`` added (the digest in the
  entry is that file's, the id's 12 hex digits agree), but a ``config_request`` for it is answered
  with other bytes: the same config claiming 64 experts per layer, as if the liar wanted readers to
  believe a bigger model;
- ``misnamed``: the id ``mixtral-000000000000`` with that same digest (id and digest disagree).

Prints one JSON line (peer_id, endpoint, the two model ids) and waits until stdin closes.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
import time
from pathlib import Path

from moeswarm.errors import ProtocolError
from moeswarm.net.catalogue import (
    CATALOGUE_PROVIDER_KEY,
    CatalogueModel,
    catalogue_key,
    sign_catalogue_entry,
)
from moeswarm.net.dataplane import DataPlaneServer
from moeswarm.net.p2p import P2PConfig, P2PNode
from moeswarm.protocol import ErrorCode, Identity


async def refuse(client: bytes, request: object) -> object:
    raise ProtocolError("no experts here", code=ErrorCode.UNKNOWN_EXPERT)


async def main() -> None:
    boot, config_path = sys.argv[1], sys.argv[2]
    raw = json.loads(Path(config_path).read_text())
    published = json.dumps({**raw, "name": "swapped"}, indent=2).encode()
    served = json.dumps({**raw, "name": "swapped", "num_local_experts": 64}, indent=2).encode()
    digest = hashlib.sha256(published).digest()
    swapped = f"{raw['model_type']}-{digest.hex()[:12]}"
    misnamed = f"{raw['model_type']}-000000000000"
    ident = Identity.generate()
    async with DataPlaneServer(ident, refuse, configs={swapped: served, misnamed: published}) as plane, \
            P2PNode(ident, P2PConfig(bootstrap=(boot,))) as node:
        entry = sign_catalogue_entry(ident, [CatalogueModel(swapped, digest, "swapped"),
                                             CatalogueModel(misnamed, digest, "misnamed")],
                                     [plane.endpoint], seq=1, expires_at_ms=int(time.time() * 1000) + 600_000)
        await node.put(catalogue_key(ident.peer_id), entry.encode())
        await node.provide(CATALOGUE_PROVIDER_KEY)
        print(json.dumps({"peer_id": ident.peer_id_str, "endpoint": plane.endpoint, "swapped": swapped,
                          "misnamed": misnamed}), flush=True)
        await asyncio.to_thread(sys.stdin.read)  # until the test closes our stdin


if __name__ == "__main__":
    asyncio.run(main())
