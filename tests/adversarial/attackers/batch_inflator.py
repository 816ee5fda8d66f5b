"""Attacker of the v1.3 batched receipts (issue 29): a server that wants more than its batch says,
run as its own process.

    python batch_inflator.py LEDGER_URL RECORDS_FILE SERVER_SEED_FILE

``RECORDS_FILE`` holds the honest ``batched_receipt`` records of one batch (msgpack list of bin),
as anyone reads them from the ledger; ``SERVER_SEED_FILE`` the key of the batch's server, which
the attacker is. It POSTs, each as the ledger's clients do:

1. ``inflated``: each receipt with 4x the tokens, pairs and FLOPs (within one call of the model),
   under the batch's signed statement and the client's countersignature, paths unchanged;
2. ``forged``: receipts of calls never made (fresh request ids and seqs, the FLOPs bound), each
   with the path of a real leaf;
3. ``resigned``: a new statement the server signs over the batch plus those calls (count + 4, a
   new root), carrying the client's countersignature of the honest statement;
4. ``recounted``: the honest records with the statement's count raised by one;
5. ``replayed``: the honest records again (a duplicated batch), twice in one POST.

Prints one JSON line: for each attack the HTTP status and the status/reason of every receipt.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.request
from collections import Counter
from dataclasses import replace
from pathlib import Path

import msgpack

from moeswarm.protocol import BatchedReceipt, Identity, decode, encode, receipt_leaf, sign_batch


def post(url: str, records: list[bytes]) -> dict[str, object]:
    request = urllib.request.Request(f"{url}/v1/receipts", data=msgpack.packb({"receipts": records}, use_bin_type=True),
                                     method="POST", headers={"Content-Type": "application/msgpack"})
    with urllib.request.urlopen(request, timeout=60) as resp:
        results = json.loads(resp.read())["results"]
        return {"status": resp.status, "results": dict(Counter(f"{r['status']}/{r['reason']}" for r in results))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("records", type=Path)
    parser.add_argument("server_seed", type=Path)
    args = parser.parse_args()
    honest = [decode(b) for b in msgpack.unpackb(args.records.read_bytes())]
    assert all(isinstance(b, BatchedReceipt) for b in honest)
    server = Identity.from_seed(args.server_seed.read_bytes())
    out: dict[str, object] = {}

    inflated = [replace(b, receipt=replace(b.receipt, tokens=4 * b.receipt.tokens, pairs=4 * b.receipt.pairs,
                                           expert_flops=4 * b.receipt.expert_flops)) for b in honest]
    out["inflated"] = post(args.url, [encode(b) for b in inflated])

    fakes = [replace(b.receipt, request_id=os.urandom(16), seq=b.receipt.seq + 1000) for b in honest]
    forged = [replace(b, receipt=fake) for b, fake in zip(honest, fakes)]
    out["forged"] = post(args.url, [encode(b) for b in forged])

    client_sig = honest[0].client_sig
    batch = sign_batch(server, honest[0].statement.client, [b.receipt for b in honest] + fakes)
    from moeswarm.protocol._merkle import merkle_paths  # the server builds the paths it needs

    paths = merkle_paths([receipt_leaf(r) for r in batch.receipts])
    resigned = [BatchedReceipt(r, batch.statement, i, paths[i], client_sig) for i, r in enumerate(batch.receipts)]
    out["resigned"] = post(args.url, [encode(b) for b in resigned[len(honest):]])

    recounted = [replace(b, statement=replace(b.statement, count=b.statement.count + 1)) for b in honest]
    try:
        out["recounted"] = post(args.url, [encode(b) for b in recounted])
    except Exception as e:  # noqa: BLE001 - a path of the wrong length does not even encode as valid
        out["recounted"] = {"status": None, "error": str(e)}

    out["replayed"] = post(args.url, [encode(b) for b in honest] * 2)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    sys.exit(main())
