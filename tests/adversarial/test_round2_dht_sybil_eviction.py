"""Issue 32, point 4: Sybils evicting an honest holder from a DHT node's store.

A DHT server keeps 1,000 values (50,000 in production; scaled down so the test takes seconds).
An honest peer (from 127.0.0.1) stores its announcement under each of its 4 layer keys; then an
attacker process, from one other address (127.0.0.2) and one connection, stores one announcement
under each of 1,000 fresh keys: the store is full. On main 52de96c eviction took from the
heaviest *key*, and the honest peer (4 values) was heavier than any Sybil (1 each); there this
test printed ``AssertionError: the flood evicted 3 of the honest peer's 4 values`` (layers 0, 1
and 2 gone). Now eviction takes from the heaviest *address* (writer group) first, the youngest
key of it first: the flood evicts itself and the honest peer keeps all 4.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from adversarial_support import attack

from moeswarm.net.p2p import P2PConfig, P2PNode
from moeswarm.protocol import Identity, announcement_key, encode, sign_announcement

VICTIM = Path(__file__).with_name("dht_victim.py")
MODEL = "honest/model"
LAYERS = 4


def test_a_thousand_fresh_keys_from_one_address_do_not_evict_an_honest_holder() -> None:
    victim = subprocess.Popen([sys.executable, str(VICTIM), "--max-values", "1000", "--per-peer", "200"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    try:
        assert victim.stdout is not None
        line = victim.stdout.readline()
        assert line.startswith("READY "), f"victim: {line!r} {victim.stderr.read()[-2000:] if victim.stderr else ''}"
        multiaddr = json.loads(line[6:])["multiaddr"]
        honest = Identity.generate()
        record = encode(sign_announcement(
            honest, model_id=MODEL, layers=(0, LAYERS - 1), experts=(0, 7), endpoints=("tcp+tls://127.0.0.1:9",),
            capacity_bytes=1 << 30, throughput=1000, load_permille=0, software="moeswarm/test", seq=1,
            expires_at_ms=int(time.time() * 1000) + 3_600_000))
        keys = [announcement_key(MODEL, layer, honest.peer_id) for layer in range(LAYERS)]

        async def store() -> list[int]:
            async with P2PNode(honest, P2PConfig(bootstrap=(multiaddr,), client_mode=True)) as node:
                return [await node.put(key, record) for key in keys]

        assert asyncio.run(store()) == [1] * LAYERS  # stored at the victim, the only DHT server

        flood = attack("dht-sybils", multiaddr, "--keys", "1000", "--model", MODEL, "--source", "127.0.0.2",
                       timeout=600)
        assert flood["stored"] == 1000, flood  # every Sybil record was valid and acknowledged

        async def read() -> list[bool]:
            async with P2PNode(Identity.generate(), P2PConfig(bootstrap=(multiaddr,), client_mode=True)) as node:
                return [await node.get(key) == record for key in keys]

        kept = asyncio.run(read())
        assert all(kept), f"the flood evicted {kept.count(False)} of the honest peer's {LAYERS} values ({flood})"
    finally:
        if victim.poll() is None:
            victim.communicate("\n", timeout=30)
