"""A DHT server holding at most ``--max-values`` values (``--per-peer`` each), for test_attack_3.

Prints ``READY {"multiaddr": ...}`` and serves until stdin closes or sends an empty line. A line
naming a peer ID is answered with ``{"values": ..., "held": ...}``: the values this store holds, all
peers together, and those charged to that peer (the last segment of their keys). On a commit without per-peer
quotas (the base 7895ee0) the same store size is set by patching py-libp2p's constant, so the
attack meets the same store there.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from moeswarm.net.p2p import P2PConfig, P2PNode
from moeswarm.protocol import Identity


def owner_of(key: bytes) -> str:
    return key.rsplit(b"/", 1)[-1].decode("utf-8", "replace")


async def main(max_values: int, per_peer: int) -> None:
    try:
        config = P2PConfig(max_values=max_values, max_values_per_peer=per_peer)  # type: ignore[call-arg]
    except TypeError:  # a commit without quotas: give py-libp2p's store the same size
        import libp2p.kad_dht.value_store as value_store

        value_store.MAX_VALUE_STORE_SIZE = max_values
        config = P2PConfig()
    async with P2PNode(Identity.generate(), config) as node:
        print("READY " + json.dumps({"multiaddr": node.multiaddrs[0], "peer_id": node.peer_id}), flush=True)
        while peer := (await asyncio.to_thread(sys.stdin.readline)).strip():
            store = dict(node._dht.value_store.store)  # a copy: libp2p's thread keeps serving
            held = sum(owner_of(key) == peer for key in store)
            print(json.dumps({"values": len(store), "held": held}), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-values", type=int, default=1000)
    parser.add_argument("--per-peer", type=int, default=200)
    args = parser.parse_args()
    asyncio.run(main(args.max_values, args.per_peer))
