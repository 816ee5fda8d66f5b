"""Issue 30, point 2: the abuses of paying through a gateway, each run as an attacker would (its own
process, the ledger's real HTTP route, ``moeswarm-ledger serve`` as the operator runs it).

A person (granted 1000 credits) authorized a gateway to charge at most 30 credits at the announced
3 credits per token, and acknowledged 4 tokens (12 credits), which the gateway charged honestly.
The greedy gateway (``attackers/greedy_gateway.py``) then tries: raising the token count in that
acknowledgement or signing one itself (tokens never streamed), raising the bound (as is, and
re-signed with its own key), presenting the person's real acknowledgement of 20 tokens (60
credits, past the bound), replaying the real charge five times at once and once later, and
charging a real authorization after it expired. The denying person (``attackers/denying_person.py``)
signs acknowledgements of 1 and then 0 tokens, to take back the 12 credits it acknowledged.

Before the defences (``charge`` in moeswarm/ledger/_authorizations.py with the signature check of
``decode_charge``, the bound check and the expiry check removed, and each charge moving the credits
its acknowledgement names, a lower one giving the difference back) this test failed; what the
attacks got there:

    {"inflated_ack": "insufficient_funds", "self_signed_ack": "charged", "raised_bound": "charged",
     "raised_bound_resigned": "charged", "over_bound_ack": "charged", "replay_later": "charged",
     "after_expiry": "charged", "replays": ["charged" x 5], "honest": ["charged", 12],
     "deny_1": "charged", "deny_0": "charged", "balances": [970, 30]}

(the inflated acknowledgement failed only because the person could not pay 3,000,000 credits).
Now each is refused and only the 12 honest credits moved.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import msgpack
import pytest
from ledger_attack_support import attacker, ledger_cli, start_ledger

from moeswarm.protocol import Identity
from moeswarm.protocol._spending import acknowledge_usage, authorize_spending

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "mixtral-e4bde7c04b4d"


def _charge(url: str, auth: bytes, usage: bytes) -> dict:
    body = msgpack.packb({"authorization": auth, "usage": usage}, use_bin_type=True)
    req = urllib.request.Request(f"{url}/v1/gateway-charges", data=body, method="POST",
                                 headers={"Content-Type": "application/msgpack"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return dict(json.loads(resp.read()))


def _balance(url: str, peer: str) -> int:
    with urllib.request.urlopen(f"{url}/v1/accounts/{peer}", timeout=60) as resp:
        return int(json.loads(resp.read())["balance"])


def test_a_greedy_gateway_and_a_denying_person_move_nothing_but_the_honest_charge(tmp_path: Path) -> None:
    db, key = tmp_path / "ledger.db", tmp_path / "ledger.key"
    key.write_bytes(Identity.generate().seed())
    person, gateway = Identity.generate(), Identity.generate()
    ledger = start_ledger(["--db", str(db), "--key", str(key), "--listen", "127.0.0.1:0"], tmp_path / "ledger.log")
    try:
        granted = ledger_cli("grant", "--db", str(db), "--key", str(key), person.peer_id_str, "1000")
        assert granted.returncode == 0, granted.stderr
        expires = int(time.time() * 1000) + 120_000
        auth = authorize_spending(person, gateway.peer_id, MODEL, max_credits=30, price_per_token=3, expires_ms=expires)
        ack = acknowledge_usage(person, auth, 4)
        honest = _charge(ledger.url, auth.encode(), ack.encode())
        late = authorize_spending(person, gateway.peer_id, MODEL, max_credits=30, price_per_token=3,
                                  expires_ms=int(time.time() * 1000) + 1500)
        late_ack = acknowledge_usage(person, late, 2)
        greedy = attacker("greedy_gateway.py", ledger.url, gateway.seed().hex(), auth.encode().hex(), ack.encode().hex(),
                          acknowledge_usage(person, auth, 20).encode().hex(), late.encode().hex(),
                          late_ack.encode().hex())
        denying = attacker("denying_person.py", ledger.url, person.seed().hex(), auth.encode().hex())
        balances = (_balance(ledger.url, person.peer_id_str), _balance(ledger.url, gateway.peer_id_str))
    finally:
        ledger.stop()
    seen = {name: answer["status"] for name, answer in greedy.items() if isinstance(answer, dict)}
    seen |= {"replays": greedy["replays"], "honest": (honest["status"], honest["moved"]),
             "deny_1": denying["ack_1"]["status"], "deny_0": denying["ack_0"]["status"], "balances": balances}
    assert seen == {
        "honest": ("charged", 12),
        "inflated_ack": "bad_signature", "self_signed_ack": "bad_signature",  # tokens never streamed
        "raised_bound": "bad_signature", "raised_bound_resigned": "bad_signature",  # past the bound
        "over_bound_ack": "exceeds_authorization",
        "replays": ["duplicate"] * 5, "replay_later": "duplicate",  # replaying the authorization's charge
        "after_expiry": "authorization_expired",
        "deny_1": "duplicate", "deny_0": "duplicate",  # the person cannot take back what it acknowledged
        "balances": (1000 - 12, 12),  # the gateway's fee: 4 acknowledged tokens at the signed 3 credits
    }
    checked = ledger_cli("verify", "--db", str(db))  # every account what its grants, receipts and charges make it
    assert checked.returncode == 0, checked.stderr
