"""Attacker for attack 1 (credit from nothing), run as its own process against a ledger's HTTP API.

    python forge_credit.py LEDGER_URL MODEL_ID HIDDEN FFN

Two fresh keys sign and countersign receipts for work never done and POST them: one claiming
2**32 - 1 tokens of every expert, then three within any per-call limit (8192 tokens, 8 experts,
every pair), each at the FLOPs bound of the real shape. It also tries to register the model's
shape (and a new model's) over HTTP as 1 x 1. Prints one JSON line: what the ledger answered.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.request
from dataclasses import replace

import msgpack

from moeswarm.protocol import (
    Identity,
    Receipt,
    SignatureKind,
    canonical,
    countersign,
    encode,
    receipt_body,
)


def forged(client: Identity, server: Identity, model_id: str, hidden: int, ffn: int, *, tokens: int,
           experts: int, seq: int) -> bytes:
    pairs = tokens * experts
    r = Receipt(request_id=os.urandom(16), client=client.peer_id, server=server.peer_id, model_id=model_id,
                layer=0, experts=tuple(range(experts)), tokens=tokens, pairs=pairs,
                expert_flops=min(6 * hidden * ffn * pairs, 2**63 - 1), input_hash=os.urandom(32), output_hash=os.urandom(32),
                time_ms=int(time.time() * 1000), seq=seq)
    r = replace(r, sig=server.sign(SignatureKind.RECEIPT, canonical(receipt_body(r))))
    return encode(countersign(client, r))


def http(method: str, url: str, body: bytes, content_type: str) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body, method=method, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def main() -> None:
    url, model_id, hidden, ffn = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    client, server = Identity.generate(), Identity.generate()
    batch = [forged(client, server, model_id, hidden, ffn, tokens=2**32 - 1, experts=8, seq=1)]
    batch += [forged(client, server, model_id, hidden, ffn, tokens=8192, experts=8, seq=2 + i) for i in range(3)]
    status, body = http("POST", f"{url}/v1/receipts", msgpack.packb({"receipts": batch}, use_bin_type=True),
                        "application/msgpack")
    shape = json.dumps({"hidden": 1, "ffn": 1}).encode()
    squat, _ = http("PUT", f"{url}/v1/models/{model_id}", shape, "application/json")
    fresh, _ = http("PUT", f"{url}/v1/models/squatter/model", shape, "application/json")
    print(json.dumps({"server": server.peer_id_str, "client": client.peer_id_str, "status": status,
                      "results": json.loads(body)["results"] if status == 200 else body.decode(errors="replace"),
                      "register_existing": squat, "register_new": fresh}))


if __name__ == "__main__":
    main()
