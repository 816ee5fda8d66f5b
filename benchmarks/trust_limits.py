"""What the bounds of issue 12 cost, and what they save: run ``python benchmarks/trust_limits.py``.

1. DHT value store under a flood from one key: py-libp2p's ``ValueStore`` (evicts the oldest
   value after a linear scan) against ``moeswarm.net.value_quota.QuotaStore`` (per-peer quota,
   O(1)). Each takes one honest announcement, then 50,000 writes from one flooding key (which
   fill py-libp2p's store), then more flooding writes; per-write time (median of 5 rounds of 4) and
   whether the honest value survived.
2. Decoding: ``moeswarm.protocol.unpack`` (bounded: scan, then msgpack with limits) against
   plain ``msgpack.unpackb`` on an honest 8-expert request with 4 MiB of hidden states, on the
   largest legal request (65,536 experts), and on a body of more objects than the limit (refused).
3. Validating one announcement (what every DHT write costs before it is stored).

Times are medians of alternating runs on one thread; nothing here is asserted.
"""

from __future__ import annotations

import os
import statistics
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import msgpack  # noqa: E402

from moeswarm.errors import ProtocolError  # noqa: E402
from moeswarm.net.value_quota import QuotaStore  # noqa: E402
from moeswarm.protocol import Identity, announcement_key, encode, sign_announcement, unpack, validate_record  # noqa: E402

N_VALUES = 50_000


def _record(key: bytes, value: bytes) -> object:
    from libp2p.kad_dht.common import format_time_rfc3339
    from libp2p.kad_dht.pb.kademlia_pb2 import Record

    r = Record()
    r.key, r.value = key, value
    r.timeReceived = format_time_rfc3339()
    return r


def store_flood() -> None:
    from libp2p.kad_dht.value_store import ValueStore

    honest_key = b"/moeswarm/v1/m/L0/12D3KooWHonest"
    value = b"x" * 356
    rows = []
    for name in ("py-libp2p ValueStore", "QuotaStore"):
        store = ValueStore(host=None, local_peer_id=None)  # type: ignore[arg-type]
        if name == "QuotaStore":
            store.store = QuotaStore()
            store._evict_if_full = lambda: None  # type: ignore[method-assign]
        store.put_record(honest_key, _record(honest_key, value))
        i = 0
        t0 = time.perf_counter()
        while i < N_VALUES:  # 50,000 writes from one key (a quota keeps only its newest 2,048)
            key = f"/moeswarm/v1/flood{i}/L0/12D3KooWAttacker".encode()
            store.put_record(key, _record(key, value))
            i += 1
        fill_s = time.perf_counter() - t0
        rounds = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(4):
                key = f"/moeswarm/v1/flood{i}/L0/12D3KooWAttacker".encode()
                store.put_record(key, _record(key, value))
                i += 1
            rounds.append((time.perf_counter() - t0) / 4)
        rows.append((name, fill_s, statistics.median(rounds), honest_key in store.store, len(store.store)))
        print(f"   ({name} done)", flush=True)
    print(f"1. one honest value, then {N_VALUES:,} + 20 writes from one flooding key")
    print(f"   {'store':24} {'fill (s)':>9} {'per write at capacity':>22} {'honest kept':>12} {'values':>8}")
    for name, fill_s, per_write, kept, n in rows:
        print(f"   {name:24} {fill_s:9.2f} {per_write * 1e6:19.1f} us {str(kept):>12} {n:8,}")


def decoding() -> None:
    import numpy as np

    from moeswarm.protocol import ExpertRequest, ExpertRows

    def request(experts: int, tokens: int, width: int) -> bytes:
        rows = np.arange(tokens, dtype=np.uint32)
        hidden = np.zeros((tokens, width), dtype=np.float32)
        if experts >= tokens:  # one row per expert (every row used once)
            routed = tuple(ExpertRows(e, rows[e:e + 1]) for e in range(experts))
        else:  # every row to every expert
            routed = tuple(ExpertRows(e, rows) for e in range(experts))
        return encode(ExpertRequest(b"r" * 16, "m", 0, 1, hidden, routed))

    cases = {
        "honest request, 8 experts, 4 MiB": request(8, 256, 4096),
        "largest request, 65,536 experts": request(65_536, 65_536, 8),
        "over the object limit: 8 x 65,535 []": b"\xdc\x00\x08" + (b"\xdc\xff\xff" + b"\x90" * 65_535) * 8,
    }
    print("2. decoding one body (median of 5, alternating)")
    print(f"   {'body':42} {'bytes':>11} {'msgpack.unpackb':>16} {'bounded unpack':>15}")
    for name, body in cases.items():
        plain, bounded = [], []
        for _ in range(5):
            t0 = time.perf_counter()
            msgpack.unpackb(body, raw=False)
            plain.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            try:
                unpack(body)
            except ProtocolError:
                pass
            bounded.append(time.perf_counter() - t0)
        print(f"   {name:42} {len(body):11,} {statistics.median(plain) * 1e3:13.1f} ms "
              f"{statistics.median(bounded) * 1e3:12.1f} ms")
    bomb = b"\xdd" + (8 << 20).to_bytes(4, "big") + b"\x90" * (8 << 20)
    t0 = time.perf_counter()
    try:
        unpack(bomb)
    except ProtocolError as e:
        print(f"   8 MiB array of empty arrays: refused in {(time.perf_counter() - t0) * 1e6:.0f} us ({e})")


def validation() -> None:
    identity = Identity.generate()
    value = encode(sign_announcement(identity, model_id="m", layers=(0, 3), experts=(0, 7),
                                     endpoints=("tcp+tls://127.0.0.1:1",), capacity_bytes=1, throughput=1,
                                     load_permille=0, software="bench", seq=1,
                                     expires_at_ms=int(time.time() * 1000) + 600_000))
    key = announcement_key("m", 1, identity.peer_id)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(200):
            validate_record(key, value)
        times.append((time.perf_counter() - t0) / 200)
    print(f"3. validating one announcement ({len(value)} bytes): {statistics.median(times) * 1e6:.0f} us")


if __name__ == "__main__":
    import sys

    parts = sys.argv[1:] or ["store", "decoding", "validation"]
    for part, fn in (("store", store_flood), ("decoding", decoding), ("validation", validation)):
        if part in parts:
            fn()
