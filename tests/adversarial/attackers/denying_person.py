"""Attacker of issue 30: a person who received tokens, acknowledged them, and now denies the charge.

    python denying_person.py LEDGER_URL PERSON_SEED_HEX AUTH_HEX

Its own process, over the ledger's real HTTP route: it signs acknowledgements of fewer tokens (1,
then 0) than it acknowledged before, hoping the ledger takes the newest word as the truth and
gives credit back, and prints one JSON line: each answer.
"""

from __future__ import annotations

import argparse
import json
import urllib.request

import msgpack

from moeswarm.protocol import Identity
from moeswarm.protocol._spending import SpendingAuthorization, acknowledge_usage


def post(url: str, auth: bytes, usage: bytes) -> dict:
    body = msgpack.packb({"authorization": auth, "usage": usage}, use_bin_type=True)
    req = urllib.request.Request(f"{url}/v1/gateway-charges", data=body, method="POST",
                                 headers={"Content-Type": "application/msgpack"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return dict(json.loads(resp.read()))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("person_seed")
    p.add_argument("auth")
    a = p.parse_args()
    me = Identity.from_seed(bytes.fromhex(a.person_seed))
    auth = SpendingAuthorization.decode(bytes.fromhex(a.auth))
    out = {f"ack_{n}": post(a.url, auth.encode(), acknowledge_usage(me, auth, n).encode()) for n in (1, 0)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
