"""Attacks 2, 3 and 5 of issue 32 on the ledger's routes, each from its own attacker process against
one ``moeswarm-ledger serve`` (a real process, real HTTP) that audits the demo model's calls.

- **2, ``POST /v1/standing``**: 60 MiB of ``{"peers": [[], [], ...]}`` with no key. On 52de96c the
  ledger parsed it all before answering: the test printed ``'wide': {'status': 400, ...}`` and
  "the ledger's peak memory grew 1567 MB" (the issue measured +1,596 MB); the 80 KB body nested
  40,000 deep got ``500 Internal Server Error``. Now the route reads at most 96 KiB (its largest
  honest body, 1,024 peer IDs, is ~57 KiB): 413 from the Content-Length, before reading; the deep
  body 400; peak memory up by less than 100 MB (0 MB here); an honest query is answered.
- **3, ``POST /v1/audits``**: two fresh keys with no credit send a signed sample of 120,000
  pairs (52 MB), then one of 128. On 52de96c the ledger re-executed both before it found that
  their receipt could never enter the ledger: ``'big': {'status': 400, 'answer': '{"error": "the
  audited receipt cannot enter the ledger: insufficient_funds ...`` (the same 400 for the small
  one), its peak memory up 451 MB (the issue: +566 MB, 1.9 s of CPU). Now the big sample is
  refused with 413 before it is read (no sample above the judge's cap of 8,192 pairs is worth
  reading), the small one with 422 before any work (signatures, hashes, model limits, work cap
  and a client that can pay are checked first), and a funded client's honest sample is
  re-executed and passes.
- **5, zero-FLOP receipts**: 2,000 receipts with ``expert_flops = 0`` from 4,000 fresh keys. On
  52de96c the attacker printed ``{'status': 200, 'keys': 4000, 'results': {'accepted/': 2000}}``
  and the chain grew from 0 to 2000 entries, each free. Now each is refused (``zero_flops``), the
  chain does not grow, and a funded client's real call is still appended and paid for.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import msgpack
import numpy as np
import pytest
from adversarial_support import reset_peak_rss, rss_kib
from ledger_attack_support import LedgerProcess, attacker, ledger_cli, start_ledger

from moeswarm.demo import CHECKPOINT
from moeswarm.ledger import AuditSample
from moeswarm.model import expert_ffn, load_config, load_weights
from moeswarm.model.model_id import model_id_for
from moeswarm.protocol import ExpertRequest, ExpertRows, Identity, countersign, decode, encode, make_receipt

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

CFG = load_config(str(CHECKPOINT))
MODEL = model_id_for(str(CHECKPOINT), CFG)
H, F = CFG.hidden_size, CFG.moe_intermediate_size
GRANT = 10**12


@pytest.fixture(scope="module")
def ledger(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LedgerProcess, Path, Path]]:
    folder = tmp_path_factory.mktemp("ledger")
    db, key = folder / "ledger.db", folder / "ledger.key"
    key.write_bytes(Identity.generate().seed())
    process = start_ledger(["--db", str(db), "--key", str(key), "--listen", "127.0.0.1:0", "--model-dir",
                            str(CHECKPOINT)], folder / "ledger.log")
    try:
        yield process, db, key
    finally:
        process.stop()


def _json(url: str, body: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as resp:
        return dict(json.loads(resp.read()))


def _baseline(pid: int) -> int:
    """Reset the process's peak resident set to its current one and return that (KiB)."""
    reset_peak_rss(pid)
    return rss_kib(pid, "VmRSS")


def _peak_growth_mb(pid: int, baseline: int) -> float:
    return (rss_kib(pid) - baseline) / 1024


def _funded(db: Path, key: Path) -> Identity:
    client = Identity.generate()
    granted = ledger_cli("grant", "--db", str(db), "--key", str(key), client.peer_id_str, str(GRANT))
    assert granted.returncode == 0, granted.stderr
    return client


def _honest_call(client: Identity, server: Identity, seq: int) -> tuple[ExpertRequest, np.ndarray, bytes]:
    """A real call of the demo model, its outputs computed by the reference expert math."""
    weights = load_weights(str(CHECKPOINT))
    hidden = np.random.default_rng(seq).standard_normal((4, H)).astype(np.float32)  # (N, H)
    rows = np.arange(4, dtype=np.uint32)
    request = ExpertRequest(np.random.default_rng(seq).bytes(16), MODEL, 0, seq, hidden,
                            (ExpertRows(0, rows), ExpertRows(1, rows)))
    outputs = np.concatenate([expert_ffn(weights.experts[0][e], hidden, weights.config) for e in (0, 1)])  # (P, H)
    receipt = make_receipt(server, request, outputs, client=client.peer_id, expert_flops=6 * H * F * request.pairs,
                           time_ms=int(time.time() * 1000))
    return request, outputs, encode(countersign(client, receipt))


def test_attack_2_standing_reads_a_bounded_body(ledger: tuple[LedgerProcess, Path, Path]) -> None:
    process, db, key = ledger
    pid = process.process.pid
    baseline = _baseline(pid)
    result = attacker("standing_bomb.py", process.url, "--size", str(60 << 20))
    grown = _peak_growth_mb(pid, baseline)
    print(f"\nstanding bomb: {result}; the ledger's peak memory grew {grown:.0f} MB")
    assert result["wide"]["status"] == 413, result
    assert result["deep"]["status"] == 400, result
    assert grown < 100, f"the ledger's peak memory grew {grown:.0f} MB"
    client = _funded(db, key)  # an honest query still gets the standing
    answer = _json(process.url + "/v1/standing", {"peers": [client.peer_id_str], "since_ms": 0})
    assert answer["standing"][0]["peer"] == client.peer_id_str and answer["standing"][0]["balance"] == GRANT


def test_attack_3_audits_check_before_they_compute(ledger: tuple[LedgerProcess, Path, Path]) -> None:
    process, db, key = ledger
    pid = process.process.pid
    baseline = _baseline(pid)
    result = attacker("audit_bomb.py", process.url, MODEL, str(H), str(F), "--tokens", "60000")
    grown = _peak_growth_mb(pid, baseline)
    print(f"\naudit bomb: {result}; the ledger's peak memory grew {grown:.0f} MB")
    assert result["big"]["status"] == 413, result
    assert result["small"]["status"] == 422 and "insufficient_funds" in result["small"]["answer"], result
    assert grown < 100, f"the ledger's peak memory grew {grown:.0f} MB"

    request, outputs, cr = _honest_call(_funded(db, key), Identity.generate(), seq=7)  # an honest audit is served
    body = AuditSample(request, outputs, decode(cr)).encode()  # type: ignore[arg-type]
    post = urllib.request.Request(process.url + "/v1/audits", data=body, method="POST",
                                  headers={"Content-Type": "application/msgpack"})
    with urllib.request.urlopen(post, timeout=120) as resp:
        verdict = json.loads(resp.read())
    assert verdict["ok"] is True and verdict["max_error"] <= verdict["tolerance"], verdict


def test_attack_5_zero_flop_receipts_are_refused(ledger: tuple[LedgerProcess, Path, Path]) -> None:
    process, db, key = ledger
    before = _json(process.url + "/healthz")["entries"]
    result = attacker("zero_flops.py", process.url, MODEL, "--receipts", "2000")
    after = _json(process.url + "/healthz")["entries"]
    print(f"\nzero-FLOP receipts: {result}; chain {before} -> {after} entries")
    assert result["status"] == 200 and result["keys"] == 4000
    assert result["results"] == {"rejected/zero_flops": 2000}, result
    assert after == before

    client = _funded(db, key)  # a real call of a funded client is still appended, and paid for
    _, _, cr = _honest_call(client, Identity.generate(), seq=9)
    post = urllib.request.Request(process.url + "/v1/receipts", data=msgpack.packb({"receipts": [cr]}, use_bin_type=True),
                                  method="POST", headers={"Content-Type": "application/msgpack"})
    with urllib.request.urlopen(post, timeout=60) as resp:
        results = json.loads(resp.read())["results"]
    assert [r["status"] for r in results] == ["accepted"], results
    standing = _json(process.url + "/v1/standing", {"peers": [client.peer_id_str]})["standing"][0]
    assert standing["paid"] == 6 * H * F * 8 and standing["balance"] == GRANT - 6 * H * F * 8
