#!/usr/bin/env python3
"""Regenerate protocol_spec/vectors/gateway.json (protocol_spec/gateway.md), deterministically.

    python protocol_spec/vectors/gateway_generate.py           # rewrite gateway.json
    python protocol_spec/vectors/gateway_generate.py --check   # exit 1 if it is out of date

The keys are generate.py's (RFC 8032 section 7.1 TEST 1 = the person, TEST 2 = the gateway); the
nonce is counting bytes; times are fixed. Hex strings are the exact bytes.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from moeswarm import protocol as p  # noqa: E402
from moeswarm.net import gateways as gw  # noqa: E402
from moeswarm.protocol import _spending as sp  # noqa: E402

PERSON = p.Identity.from_seed(bytes.fromhex("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60"))
GATEWAY = p.Identity.from_seed(bytes.fromhex("4ccd089b28ff96da9db6c346ec114e0f5b8a319f35aba624da8cf6ed4fb8a6fb"))
NOW_MS = 1_700_000_000_000
MODEL_ID = "mixtral-7e3ec67ea59a"
NONCE = bytes(range(0x10, 0x20))


def build() -> dict[str, Any]:
    record = gw.sign_gateway(GATEWAY, "https://gw.example.org:8443", [MODEL_ID], free_slots=13, max_batch=16,
                             price_per_token=2, rtt_us=1500, seq=7, expires_at_ms=NOW_MS + 60_000)
    key = gw.gateway_key(GATEWAY.peer_id)
    other_key = gw.gateway_key(PERSON.peer_id)
    tampered = replace(record, price_per_token=1)  # signature of the price 2 record
    newer = replace(record, seq=8, free_slots=12).signed(GATEWAY)
    cases = [
        {"name": "valid", "key": key, "value_hex": record.encode().hex(), "stored_hex": None, "now_ms": NOW_MS, "code": None},
        {"name": "newer seq replaces", "key": key, "value_hex": newer.encode().hex(), "stored_hex": record.encode().hex(),
         "now_ms": NOW_MS, "code": None},
        {"name": "same seq does not replace", "key": key, "value_hex": record.encode().hex(),
         "stored_hex": newer.encode().hex(), "now_ms": NOW_MS, "code": 14},
        {"name": "key names another peer", "key": other_key, "value_hex": record.encode().hex(), "stored_hex": None,
         "now_ms": NOW_MS, "code": 9},
        {"name": "price changed after signing", "key": key, "value_hex": tampered.encode().hex(), "stored_hex": None,
         "now_ms": NOW_MS, "code": 9},
        {"name": "expired", "key": key, "value_hex": record.encode().hex(), "stored_hex": None,
         "now_ms": NOW_MS + 60_000, "code": 15},
        {"name": "free_slots above max_batch", "key": key, "stored_hex": None, "now_ms": NOW_MS, "code": 4,
         "value_hex": replace(record, free_slots=17).signed(GATEWAY).encode().hex()},
    ]
    auth = sp.authorize_spending(PERSON, GATEWAY.peer_id, MODEL_ID, max_credits=200, price_per_token=2,
                                 expires_ms=NOW_MS + 3_600_000, nonce=NONCE)
    ack = sp.acknowledge_usage(PERSON, auth, 37)
    return {
        "person_peer_id": PERSON.peer_id_str,
        "gateway_peer_id": GATEWAY.peer_id_str,
        "gateway_record": {
            "provider_key": gw.GATEWAY_PROVIDER_KEY, "key": key,
            "signed_payload_hex": (b"moeswarm/v1/gateway\x00" + p.canonical(record.body())).hex(),
            "sig_hex": record.sig.hex(), "value_hex": record.encode().hex(), "cases": cases,
        },
        "spending_authorization": {
            "body_hex": p.canonical(auth.body()).hex(),
            "signed_payload_hex": (b"moeswarm/v1/spending-authorization\x00" + p.canonical(auth.body())).hex(),
            "sig_hex": auth.sig.hex(), "encoded_hex": auth.encode().hex(), "id_hex": auth.id.hex(),
        },
        "gateway_usage": {
            "tokens": 37, "credits": 74,
            "signed_payload_hex": (b"moeswarm/v1/gateway-usage\x00" + p.canonical(ack.body())).hex(),
            "sig_hex": ack.sig.hex(), "encoded_hex": ack.encode().hex(),
        },
        "charge_request_hex": p.canonical({"authorization": auth.encode(), "usage": ack.encode()}).hex(),
    }


def main() -> int:
    text = json.dumps(build(), indent=1) + "\n"
    path = HERE / "gateway.json"
    if "--check" in sys.argv:
        if not path.exists() or path.read_text() != text:
            print(f"{path} is out of date: run {Path(__file__).name}")
            return 1
        return 0
    path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
