"""Paying through a gateway (issue 30, point 2), with real processes: a ledger (``moeswarm-ledger
serve``), a holder, a gateway charging 2 credits per token, a person's ``moeswarm complete
--identity`` and ``generate --swarm --ledger --identity``, and a client that will not pay.

- The person's account pays exactly the tokens it received at the announced price, the gateway's
  account gets them, and ``moeswarm-ledger verify`` finds every account what its grants, receipts
  and charges make it.
- ``generate --swarm --ledger --identity KEY`` countersigns its receipts with KEY: its account pays.
- A client that streamed tokens and does not acknowledge them (``attackers/denying_client.py``, its
  own process) gets no more: 402 ``unacknowledged_tokens``, with no acknowledgement and with one of
  1 token of 8. Before the defence (``SpendingGate`` without its "acknowledge first" check) it was
  served again both times: ``{"first": [200, 8], "unacknowledged": [200, 8], "under_acknowledged":
  [200, 8]}``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from ledger_process import start_ledger

from moeswarm.demo import CHECKPOINT
from moeswarm.demo.swarm import start_daemon, stop_daemon
from moeswarm.model import load_config
from moeswarm.model.model_id import model_id_for
from moeswarm.protocol import Identity

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

ATTACKERS = Path(__file__).resolve().parents[1] / "adversarial" / "attackers"
ENV = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
PRICE = 2
GRANT = 10**15  # the demo's expert calls cost one credit per FLOP


def _balance(url: str, peer: str) -> int:
    with urllib.request.urlopen(f"{url}/v1/accounts/{peer}", timeout=30) as resp:
        return int(json.loads(resp.read())["balance"])


def _wait_balance(url: str, peer: str, want: int, timeout_s: float = 30.0) -> int:
    deadline = time.monotonic() + timeout_s
    while (got := _balance(url, peer)) != want and time.monotonic() < deadline:
        time.sleep(0.2)
    return got


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, env=ENV, timeout=180, check=False)


def test_a_person_pays_a_gateway_its_announced_price_for_the_tokens_received(tmp_path: Path) -> None:
    cfg = load_config(CHECKPOINT)
    model_id = model_id_for(CHECKPOINT, cfg)
    db, key = tmp_path / "ledger.db", tmp_path / "ledger.key"
    key.write_bytes(Identity.generate().seed())
    person, gateway_key, other = tmp_path / "person.key", tmp_path / "gateway.key", tmp_path / "other.key"
    denier = tmp_path / "denier.key"  # funded: what stops it is the gateway's rule, not an empty account
    ids = {}
    for path in (person, gateway_key, other, denier):
        identity = Identity.generate()
        path.write_bytes(identity.seed())
        ids[path] = identity.peer_id_str
    ledger = start_ledger(["--db", str(db), "--key", str(key), "--listen", "127.0.0.1:0", "--model-dir",
                           str(CHECKPOINT)], tmp_path / "ledger.log")
    daemons = []
    try:
        for path, amount in ((person, 1000), (gateway_key, GRANT), (other, GRANT), (denier, 1000)):
            granted = _cli("moeswarm.ledger.cli", "grant", "--db", str(db), "--key", str(key), ids[path], str(amount))
            assert granted.returncode == 0, granted.stderr
        daemons.append(start_daemon("node0", ["node", "--model", str(CHECKPOINT)]))
        boot = daemons[0].info["multiaddrs"][0]
        gateway = start_daemon("gateway", ["backbone", "--model", str(CHECKPOINT), "--bootstrap", boot, "--http",
                                           "127.0.0.1:0", "--gateway", "--gateway-price", str(PRICE), "--ledger",
                                           ledger.url, "--identity", str(gateway_key)])
        daemons.append(gateway)
        gateway_before = _balance(ledger.url, ids[gateway_key])

        done = _cli("moeswarm.cli", "complete", "--swarm", boot, "--model", model_id, "--prompt", "And it came to pass",
                    "--max-new-tokens", "12", "--print-token-ids", "--identity", str(person), "--max-credits", "100")
        assert done.returncode == 0, done.stderr
        tokens = len(json.loads(done.stdout.splitlines()[-1]))
        assert tokens > 0
        assert _wait_balance(ledger.url, ids[person], 1000 - PRICE * tokens) == 1000 - PRICE * tokens
        unpaid = _cli("moeswarm.cli", "complete", "--swarm", boot, "--model", model_id, "--prompt", "In the beginning",
                      "--max-new-tokens", "4")  # no --identity: the only gateway wants payment
        assert unpaid.returncode != 0 and "every gateway failed or wants payment (1 tried)" in unpaid.stderr
        # the gateway got the fee (its own expert calls' receipts are paid from its account into escrow)
        attack = subprocess.run([sys.executable, str(ATTACKERS / "denying_client.py"), gateway.info["http"],
                                 gateway.info["peer_id"], model_id, str(PRICE), denier.read_bytes().hex()],
                                capture_output=True, text=True, env=ENV, timeout=180, check=False)
        assert attack.returncode == 0, attack.stderr
        denied = json.loads(attack.stdout.splitlines()[-1])
        assert denied == {"first": [200, 8], "unacknowledged": [402, "unacknowledged_tokens"],
                          "under_acknowledged": [402, "unacknowledged_tokens"]}
        assert _wait_balance(ledger.url, ids[denier], 1000 - PRICE) == 1000 - PRICE  # the 1 token it acknowledged

        other_before = _balance(ledger.url, ids[other])
        gen = _cli("moeswarm.cli", "generate", "--model", str(CHECKPOINT), "--swarm", boot, "--ledger", ledger.url,
                   "--identity", str(other), "--prompt", "And it came to pass", "--max-new-tokens", "4")
        assert gen.returncode == 0, gen.stderr
        deadline = time.monotonic() + 30
        while _balance(ledger.url, ids[other]) == other_before and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _balance(ledger.url, ids[other]) < other_before  # its receipts were paid from its account
    finally:
        for d in reversed(daemons):
            stop_daemon(d)
        ledger.stop()
    assert gateway_before >= 0
    charges = _cli("moeswarm.ledger.cli", "verify", "--db", str(db))
    assert charges.returncode == 0, charges.stderr
