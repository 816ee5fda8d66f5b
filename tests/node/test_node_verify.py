"""Output evidence as a DHT record (``moeswarm.net.evidence`` behind ``net.records.validate_any``)
and the verifier's choice of holders, without a network.

Honest outputs are the demo checkpoint's experts computed here; the receipts are signed by real
keys with ``make_receipt`` as a node signs them.  Each forged or inconsistent record must be
refused with a ``ProtocolError`` naming why."""

from __future__ import annotations

import os
import time
from dataclasses import replace

import numpy as np
import pytest

from moeswarm.demo import CHECKPOINT
from moeswarm.errors import ProtocolError
from moeswarm.model import expert_ffn, load_weights
from moeswarm.model.experts import F32Cache
from moeswarm.net.evidence import OutputEvidence, evidence_key, output_tolerance
from moeswarm.net.records import select_any, validate_any
from moeswarm.net.routing_table import Holder, SwarmTable
from moeswarm.node.verify import HolderChecks, Verifier, VerifyConfig
from moeswarm.protocol import ErrorCode, ExpertRequest, ExpertResponse, ExpertRows, Identity, make_receipt

MODEL = "mixtral-test0123abcd"
REPORTER, ACCUSED, WITNESS, OTHER = (Identity.generate() for _ in range(4))


@pytest.fixture(scope="module")
def honest() -> tuple[np.ndarray, np.ndarray]:
    """(hidden (1, H) float32, the honest output of layer 1 expert 3 on it (1, H))."""
    weights = load_weights(str(CHECKPOINT))
    hidden = np.random.default_rng(0).standard_normal((1, weights.config.hidden_size)).astype(np.float32)
    w = F32Cache().get((1, 3), weights.experts[1][3])
    return hidden, expert_ffn(w, hidden, weights.config)


def answer(server: Identity, hidden: np.ndarray, outputs: np.ndarray, client: Identity = REPORTER
           ) -> tuple[ExpertRequest, ExpertResponse]:
    request = ExpertRequest(os.urandom(16), MODEL, 1, 7, hidden, (ExpertRows(3, np.zeros(1, np.uint32)),))
    receipt = make_receipt(server, request, outputs, client=client.peer_id, expert_flops=1000,
                           time_ms=int(time.time() * 1000))
    return request, ExpertResponse(request.request_id, outputs, receipt, 10, 0)


def evidence(hidden: np.ndarray, lie: np.ndarray, truth: np.ndarray, *, signer: Identity = REPORTER,
             witness: Identity = WITNESS, witness_client: Identity = REPORTER) -> OutputEvidence:
    request, accused = answer(ACCUSED, hidden, lie)
    _, witnessed = answer(witness, hidden, truth, witness_client)
    return replace(OutputEvidence(MODEL, ACCUSED.peer_id, REPORTER.peer_id, int(time.time() * 1000), request,
                                  (accused, witnessed)).signed(signer))


def refused(key: str, value: bytes, match: str, stored: bytes | None = None) -> ProtocolError:
    with pytest.raises(ProtocolError, match=match) as info:
        validate_any(key, value, stored)
    return info.value


def test_valid_evidence_is_accepted_and_never_replaced(honest) -> None:  # type: ignore[no-untyped-def]
    hidden, truth = honest
    key = evidence_key(MODEL, ACCUSED.peer_id)
    first = evidence(hidden, truth * 1.1, truth).encode()
    validate_any(key, first)
    second = evidence(hidden, truth + 0.5, truth).encode()
    assert refused(key, second, "already has valid evidence", stored=first).code == ErrorCode.STALE
    validate_any(key, second, stored=b"garbage")  # a void stored value is replaced
    assert select_any(key, [b"garbage", second, first]) in (1, 2)


def test_forged_or_inconsistent_evidence_is_refused(honest) -> None:  # type: ignore[no-untyped-def]
    hidden, truth = honest
    key = evidence_key(MODEL, ACCUSED.peer_id)
    lie = truth * 1.1
    # the accused's outputs agree with the witness's: an honest holder framed
    refused(key, evidence(hidden, truth + 1e-6, truth).encode(), "agree with the witnesses")
    # signed by someone other than the reporter it names
    assert refused(key, evidence(hidden, lie, truth, signer=OTHER).encode(), "signature").code == ErrorCode.AUTH_FAILED
    # stored under another holder's key
    refused(evidence_key(MODEL, WITNESS.peer_id), evidence(hidden, lie, truth).encode(), "accuses another peer")
    refused(f"/moeswarm/v1/other-model01/evidence/{key.rsplit('/', 1)[1]}", evidence(hidden, lie, truth).encode(),
            "accuses another peer or model")
    # a witness answer issued to another client (not the reporter's own call)
    refused(key, evidence(hidden, lie, truth, witness_client=OTHER).encode(), "differs from the challenge in client")
    # the accused as its own witness
    refused(key, evidence(hidden, lie, truth, witness=ACCUSED).encode(), "each witness another peer")
    # outputs swapped after the receipts were signed
    ev = evidence(hidden, lie, truth)
    swapped = replace(ev.responses[0], outputs=truth.copy())
    refused(key, replace(ev, responses=(swapped, ev.responses[1])).signed(REPORTER).encode(), "output_hash")
    # the witness answered another input
    request, other = answer(WITNESS, hidden + 1, truth)
    refused(key, replace(ev, responses=(ev.responses[0], other)).signed(REPORTER).encode(), "input_hash")
    refused(key, b"\x81\xa4type\xa3foo", "not an output evidence record")


def test_tolerance_follows_the_wire_dtype(honest) -> None:  # type: ignore[no-untyped-def]
    hidden, truth = honest
    key = evidence_key(MODEL, ACCUSED.peer_id)
    assert output_tolerance("float16") == pytest.approx(8 * 2**-10)
    assert output_tolerance("float32") == 1e-4
    scale = max(1.0, float(np.abs(truth).max()))
    off = truth.copy()
    off[0, 0] += 2e-3 * scale  # beyond float32's tolerance, within float16's
    validate_any(key, evidence(hidden, off, truth).encode())
    h16, t16, o16 = hidden.astype(np.float16), truth.astype(np.float16), off.astype(np.float16)
    refused(key, evidence(h16, o16, t16).encode(), "agree with the witnesses")


def test_trusted_holders_win_and_a_newcomer_gets_one_checked_call() -> None:
    table = SwarmTable(MODEL)
    far = int(time.time() * 1000) + 60_000
    checked, newcomer = (Holder(i.peer_id, ("x",), MODEL, (0, 3), (0, 7), far, 1) for i in (WITNESS, ACCUSED))
    checked.rtt_s, checked.load_permille = 0.004, 900  # busy, and measured slower than ...
    newcomer.load_permille = 0  # ... a newcomer claiming to be idle
    table.holders = {h.peer_id: h for h in (checked, newcomer)}
    v = Verifier(None, REPORTER, table, VerifyConfig(probation_calls=2), weights=None,  # type: ignore[arg-type]
                 call=None, dht=None, wire_dtype="float32")  # type: ignore[arg-type]
    v.stats[checked.peer_id] = HolderChecks(calls=2, checked=2, passed=2)
    plan, missing = v.plan(1, [0, 2, 5], set())
    assert missing == [] and plan == {checked.peer_id: [2, 5], newcomer.peer_id: [0]}
    v.stats[newcomer.peer_id] = HolderChecks(calls=2, checked=2, passed=2)  # passed probation: by score now
    plan, _ = v.plan(1, [0, 2, 5], set())
    assert plan == {newcomer.peer_id: [0, 2, 5]}
    table.excluded[newcomer.peer_id] = "caught"
    assert v.plan(1, [0, 2, 5], set())[0] == {checked.peer_id: [0, 2, 5]}
    off = Verifier(None, REPORTER, table, VerifyConfig(fraction=0), weights=None,  # type: ignore[arg-type]
                   call=None, dht=None, wire_dtype="float32")  # type: ignore[arg-type]
    del table.excluded[newcomer.peer_id]
    assert off.plan(1, [0, 2, 5], set())[0] == {newcomer.peer_id: [0, 2, 5]}  # checks off: the old choice


def test_checks_are_on_by_default_and_the_flags_refuse_nonsense() -> None:
    from click.testing import CliRunner

    from moeswarm.daemon import SwarmConfig
    from moeswarm.errors import ConfigError
    from moeswarm.node.cli import backbone
    from moeswarm.node.config import BackboneConfig

    default = BackboneConfig(SwarmConfig(str(CHECKPOINT))).verify
    assert default.enabled and default.fraction == 0.05 and default.probation_calls == 8 and default.method == "auto"
    assert not VerifyConfig(fraction=0).enabled
    with pytest.raises(ConfigError, match="0..1"):
        VerifyConfig(fraction=1.5)
    with pytest.raises(ConfigError, match="--verify-by"):
        VerifyConfig(method="trust-me")
    with pytest.raises(ConfigError, match="--probation-calls"):
        VerifyConfig(probation_calls=-1)
    help_text = CliRunner().invoke(backbone, ["--help"]).output
    assert "--verify-fraction" in help_text and "--probation-calls" in help_text and "--verify-by" in help_text
    for bad in (["--verify-fraction", "1.5"], ["--probation-calls", "-1"], ["--verify-by", "trust-me"]):
        result = CliRunner().invoke(backbone, ["--model", str(CHECKPOINT), *bad])
        assert result.exit_code == 2, (bad, result.output)
