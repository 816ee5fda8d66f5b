"""Attacker for attack 8 of issue 32 (DNS rebinding on the monitor), run as its own process.

    python rebind.py URL

After a rebinding, a page of evil.example reaches the monitor's address under the attacker's
name: its requests carry ``Host: evil.example:PORT``. This sends them for the snapshot, the page
and the metrics, and prints one JSON line: each status and whether the snapshot's text came back.
"""

from __future__ import annotations

import http.client
import json
import sys
from urllib.parse import urlsplit


def main() -> None:
    parts = urlsplit(sys.argv[1])
    result: dict[str, object] = {}
    for path in ("/api/v1/swarm", "/", "/metrics"):
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
        try:
            conn.request("GET", path, headers={"Host": f"evil.example:{parts.port}"})
            resp = conn.getresponse()
            body = resp.read()
            result[path] = resp.status
            if path == "/api/v1/swarm":
                result["read_snapshot"] = b'"nodes"' in body
        finally:
            conn.close()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
