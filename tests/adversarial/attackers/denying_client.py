"""Attacker of issue 30: a client that takes a priced gateway's tokens and will not acknowledge them.

    python denying_client.py GATEWAY_URL GATEWAY_PEER_ID MODEL_ID PRICE KEY_SEED_HEX

Its own process, real HTTP to the gateway: it signs a real spending authorization (so the gateway
serves it), streams 8 tokens, then asks for more without acknowledging them, then acknowledging
only 1 of the 8, and prints one JSON line: the tokens it got and each later request's status and
error code.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import time
from urllib.parse import urlsplit

from moeswarm.protocol import Identity, peer_id_from_str
from moeswarm.protocol._spending import acknowledge_usage, authorize_spending


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def ask(url: str, headers: dict[str, str], max_tokens: int) -> tuple[int, object]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        body = {"prompt": "And it came to pass", "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "return_token_ids": True}
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json",
                                                                               **headers})
        response = conn.getresponse()
        data = response.read().decode()
        if response.status != 200:
            return response.status, json.loads(data)["error"].get("code")
        ids = [t for line in data.splitlines() if line.startswith("data: {")
               for c in json.loads(line[6:]).get("choices", []) for t in c.get("token_ids") or []]
        return 200, len(ids)
    finally:
        conn.close()


def main() -> None:
    p = argparse.ArgumentParser()
    for name in ("url", "gateway", "model", "price", "seed"):
        p.add_argument(name)
    a = p.parse_args()
    me = Identity.from_seed(bytes.fromhex(a.seed))
    auth = authorize_spending(me, peer_id_from_str(a.gateway), a.model, max_credits=1000, price_per_token=int(a.price),
                              expires_ms=int(time.time() * 1000) + 600_000)
    headers = {"X-Moeswarm-Authorization": b64(auth.encode())}
    out: dict[str, object] = {"first": ask(a.url, headers, 8)}
    out["unacknowledged"] = ask(a.url, headers, 8)
    out["under_acknowledged"] = ask(a.url, {**headers, "X-Moeswarm-Usage": b64(acknowledge_usage(me, auth, 1).encode())}, 8)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
