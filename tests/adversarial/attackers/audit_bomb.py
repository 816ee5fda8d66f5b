"""Attacker for attack 3 of issue 32: ``POST /v1/audits`` samples that cost the ledger work before
anything about them is checked, run as its own process.

    python audit_bomb.py LEDGER_URL MODEL_ID HIDDEN FFN [--tokens 60000]

Two fresh keys (no credit at the ledger) sign and countersign a call of ``tokens`` float16 rows,
each routed to experts 0 and 1 (2 x tokens pairs, within a top-2 model's per-call limits), with
made-up outputs; then a small call (64 rows) of the same two keys. Prints one JSON line: the
status and answer of each.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import time
from urllib.parse import urlsplit

import numpy as np

from moeswarm.ledger import AuditSample
from moeswarm.protocol import ExpertRequest, ExpertRows, Identity, countersign, make_receipt


def sample(model_id: str, hidden: int, ffn: int, tokens: int, client: Identity, server: Identity, seq: int) -> bytes:
    rng = np.random.default_rng(seq)
    rows = np.arange(tokens, dtype=np.uint32)
    x = rng.standard_normal((tokens, hidden)).astype(np.float16)  # (N, H)
    request = ExpertRequest(os.urandom(16), model_id, 0, seq, x, (ExpertRows(0, rows), ExpertRows(1, rows)))
    outputs = rng.standard_normal((request.pairs, hidden)).astype(np.float16)  # (P, H): never computed
    receipt = make_receipt(server, request, outputs, client=client.peer_id, expert_flops=6 * hidden * ffn * request.pairs,
                           time_ms=int(time.time() * 1000))
    return AuditSample(request, outputs, countersign(client, receipt)).encode()


def post(url: str, body: bytes) -> tuple[int | None, str]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=300)
    try:
        conn.putrequest("POST", "/v1/audits")
        conn.putheader("Content-Type", "application/msgpack")
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders()
        try:
            for i in range(0, len(body), 1 << 20):
                conn.send(body[i : i + (1 << 20)])
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before the whole body: the answer is still there to read
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace")[:400]
    finally:
        conn.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("model_id")
    parser.add_argument("hidden", type=int)
    parser.add_argument("ffn", type=int)
    parser.add_argument("--tokens", type=int, default=60_000)
    args = parser.parse_args()
    client, server = Identity.generate(), Identity.generate()
    big = sample(args.model_id, args.hidden, args.ffn, args.tokens, client, server, 1)
    status, text = post(args.url, big)
    small_status, small_text = post(args.url, sample(args.model_id, args.hidden, args.ffn, 64, client, server, 2))
    print(json.dumps({"big": {"bytes": len(big), "pairs": 2 * args.tokens, "status": status, "answer": text},
                      "small": {"status": small_status, "answer": small_text}}), flush=True)


if __name__ == "__main__":
    main()
