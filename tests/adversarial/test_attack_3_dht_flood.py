"""Attack 3 of issue 12: flooding the DHT.

A DHT server keeps 1,000 values here (50,000 in production; the figure is scaled down so the
test takes seconds, the same size is given to the base commit's store). An honest peer stores
its announcement there; then an attacker process, one key, stores 1,300 values at it: 100 keys
under one announcement claiming layers [0, 2^32-1] (valid under every layer key when ranges are
unbounded) and 1,200 announcements of made-up models, more than the store holds. On the base
commit 7895ee0 (this file, attacker and victim copied onto it) all 1,300 were stored, the store
evicted the oldest value, and the test failed on "the honest announcement was evicted".
Now the every-layer record is refused (layers end at 1,023) and the attacker's values are charged
to its key (200 here): its newest push out its oldest, the victim reports at most 200 values
charged to it, and the honest announcement is still found.

Negative control (run by hand; a second victim would double the file's time): the same flood at a store whose per-peer quota
is 1,000,000 fails on "one key holds 999 of 1000 values".
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


def _honest_record(identity: Identity) -> bytes:
    return encode(sign_announcement(
        identity, model_id="honest/model", layers=(0, 3), experts=(0, 7), endpoints=("tcp+tls://127.0.0.1:9",),
        capacity_bytes=1 << 30, throughput=1000, load_permille=0, software="moeswarm/test", seq=1,
        expires_at_ms=int(time.time() * 1000) + 3_600_000))


def flood(per_peer: int) -> None:
    """The honest record stored, then 1,300 writes from one key (100 claiming every layer, 1,200
    valid announcements: more than the store holds); the honest record survives and the
    attacker holds at most its quota."""
    victim = subprocess.Popen([sys.executable, str(VICTIM), "--max-values", "1000", "--per-peer", str(per_peer)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    try:
        assert victim.stdin is not None and victim.stdout is not None
        line = victim.stdout.readline()
        assert line.startswith("READY "), f"victim: {line!r} {victim.stderr.read()[-2000:] if victim.stderr else ''}"
        multiaddr = json.loads(line[6:])["multiaddr"]
        honest = Identity.generate()
        key = announcement_key("honest/model", 2, honest.peer_id)
        record = _honest_record(honest)

        async def store() -> int:
            async with P2PNode(honest, P2PConfig(bootstrap=(multiaddr,), client_mode=True)) as node:
                return await node.put(key, record)

        assert asyncio.run(store()) == 1  # stored at the victim, the only DHT server

        flood = attack("dht-flood", multiaddr, "--writes", "1300", "--every-layer", "100", timeout=600)
        assert flood["writes"] == 1300
        assert flood["stored"] == 1200, flood  # the claims of every layer are refused, the rest stored

        victim.stdin.write(flood["peer_id"] + "\n")
        victim.stdin.flush()
        held = json.loads(victim.stdout.readline())
        assert held["values"] <= 1000, held  # the flood went past capacity: something was evicted
        assert held["held"] <= 200, f"one key holds {held['held']} of {held['values']} values"

        async def read() -> bytes | None:
            async with P2PNode(Identity.generate(), P2PConfig(bootstrap=(multiaddr,), client_mode=True)) as node:
                return await node.get(key)

        assert asyncio.run(read()) == record, f"the honest announcement was evicted ({flood})"
    finally:
        if victim.poll() is None:
            victim.communicate("\n", timeout=30)


def test_one_key_cannot_flood_an_honest_announcement_out() -> None:
    flood(per_peer=200)
