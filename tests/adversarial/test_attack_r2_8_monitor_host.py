"""Attack 8 of issue 32: DNS rebinding on the monitor.

The monitor serves the swarm map on 127.0.0.1 in its own process (``http_victims.py monitor``,
the monitor's own ``serve``). An attacker process sends what a DNS-rebinding page sends once its
name points at the monitor: ``Host: evil.example:PORT``. On 52de96c the monitor answered any Host:
the attacker printed ``{"/api/v1/swarm": 200, "read_snapshot": true, "/": 200, "/metrics": 200}``.
Now every route answers 421 to a Host that is not the bound address (the same check as the
backbone's API, shared in ``net.http_guard``), and this machine's own clients, which name
127.0.0.1 or localhost, are served as before.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

from http_attack_support import ENV, HERE, start_victim


def _get(url: str, host: str) -> int:
    request = urllib.request.Request(url, headers={"Host": host})
    with urllib.request.urlopen(request, timeout=30) as resp:
        return int(resp.status)


def test_a_rebinding_host_gets_421_and_local_clients_are_served() -> None:
    victim = start_victim("monitor")
    try:
        done = subprocess.run([sys.executable, str(HERE / "attackers" / "rebind.py"), victim.url], capture_output=True,
                              text=True, timeout=60, env=ENV)
        assert done.returncode == 0, done.stderr[-2000:]
        result = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"\nrebinding page: {result}")
        assert result == {"/api/v1/swarm": 421, "read_snapshot": False, "/": 421, "/metrics": 421}, result
        port = victim.url.rsplit(":", 1)[1]
        for host in (f"127.0.0.1:{port}", f"localhost:{port}"):
            assert _get(victim.url + "/api/v1/swarm", host) == 200
    finally:
        victim.stop()
