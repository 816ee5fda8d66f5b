"""Attacker of issue 30: a gateway that wants more than it was authorized, run as its own process.

    python greedy_gateway.py LEDGER_URL GATEWAY_SEED_HEX AUTH_HEX ACK_HEX OVER_ACK_HEX LATE_AUTH_HEX LATE_ACK_HEX

It holds what a person really gave it: an authorization (``AUTH_HEX``) with one acknowledgement
of tokens it streamed (``ACK_HEX``), an acknowledgement beyond the bound (``OVER_ACK_HEX``: the
person's client acknowledged tokens the gateway streamed past the bound), and a short-lived
authorization with its acknowledgement (``LATE_*``). It POSTs to the ledger, over its real HTTP
route, every charge a greedy gateway would try, and prints one JSON line: each attempt's answer.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.request
from dataclasses import replace

import msgpack

from moeswarm.protocol import Identity, canonical
from moeswarm.protocol._spending import (
    AUTHORIZATION_KIND,
    USAGE_KIND,
    SpendingAuthorization,
    UsageAck,
)


def post(url: str, auth: bytes, usage: bytes) -> dict:
    body = msgpack.packb({"authorization": auth, "usage": usage}, use_bin_type=True)
    req = urllib.request.Request(f"{url}/v1/gateway-charges", data=body, method="POST",
                                 headers={"Content-Type": "application/msgpack"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return dict(json.loads(resp.read()))


def main() -> None:
    p = argparse.ArgumentParser()
    for name in ("url", "gateway_seed", "auth", "ack", "over_ack", "late_auth", "late_ack"):
        p.add_argument(name)
    a = p.parse_args()
    me = Identity.from_seed(bytes.fromhex(a.gateway_seed))
    auth, ack = bytes.fromhex(a.auth), bytes.fromhex(a.ack)
    real = SpendingAuthorization.decode(auth)
    out: dict[str, object] = {}

    # 1. tokens never streamed: raise the count in the person's acknowledgement, or sign one itself
    inflated = replace(UsageAck.decode(ack), tokens=10**6)
    out["inflated_ack"] = post(a.url, auth, inflated.encode())
    own = UsageAck(real.id, 5)
    own = replace(own, sig=me.sign(USAGE_KIND, canonical(own.body())))
    out["self_signed_ack"] = post(a.url, auth, own.encode())

    # 2. past the bound: raise max_credits (the signature no longer fits; re-signed by itself),
    #    or present the person's real acknowledgement of tokens beyond the bound
    raised = replace(real, max_credits=10**9)
    out["raised_bound"] = post(a.url, raised.encode(), ack)
    resigned = replace(raised, sig=me.sign(AUTHORIZATION_KIND, canonical(raised.body())))
    out["raised_bound_resigned"] = post(a.url, resigned.encode(), ack)
    out["over_bound_ack"] = post(a.url, auth, bytes.fromhex(a.over_ack))

    # 3. replay: the one real charge, five times at once, then again later
    answers: list[dict] = []
    threads = [threading.Thread(target=lambda: answers.append(post(a.url, auth, ack))) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    out["replays"] = sorted(r["status"] for r in answers)
    out["replay_later"] = post(a.url, auth, ack)

    # 4. after expiry: wait for the short authorization to expire, then charge it
    late = SpendingAuthorization.decode(bytes.fromhex(a.late_auth))
    time.sleep(max(0.0, late.expires_ms / 1000 - time.time()) + 0.2)
    out["after_expiry"] = post(a.url, bytes.fromhex(a.late_auth), bytes.fromhex(a.late_ack))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
