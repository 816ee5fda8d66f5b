"""Checking holders' outputs, by default: probation, a steady sample, exclusion and DHT evidence.

Receipts prove who answered, not that the answer is right.  ``Verifier`` sits where the
dispatch receives a holder's response (``RemoteExperts._call``) and where it chooses holders:

* **Which calls are checked.**  A holder's first ``probation_calls`` calls are all checked; after
  that a random ``fraction`` of them in full, and every other call is *spot-checked* where this
  backbone holds the call's experts: one random row of each expert in the call is recomputed
  (``spot_fraction``, 1 by default: every such call). The choice is made after the response arrived, from ``os.urandom``, and a
  checked call looks exactly like an unchecked one on the wire, so the holder cannot tell which
  calls or rows are checked. So the chance of catching a lie does not drop once a holder passed
  probation: a call whose every row is wrong is caught on its first lie, whenever it comes
  (a liar that waits, one that lies on 1 call in 50, one that lies when it guesses a call is
  unchecked); a lie on ``k`` of a call's ``n`` rows of one expert is caught with chance ``k/n``
  per call. The cost is one row per expert per call on the backbone (issue 32): for a decode step
  (one token) that is the whole call, recomputed after the answer, so a backbone holding the
  experts pays their compute as well as the round trip. ``spot_fraction`` f < 1 trades that for a
  liar's life: one that lies on every row of 1 call in 50 then survives 50 / f calls on average.
* **How.**  By recomputing the call's experts from this backbone's own checkpoint where it holds
  them, else by sending the same request to a second holder and, if the two disagree, to a third:
  the majority wins.  Outputs agree when ``max|a - b| / max(1, max|ref|)`` stays within the wire
  dtype's tolerance (``moeswarm.net.evidence.output_tolerance``).  The check runs before the
  outputs enter the generation, so a caught lie never reaches a token.
* **A holder caught** is excluded at once (``SwarmTable.excluded``: no more calls; a response of
  it still in flight is refused and its experts retried elsewhere), its outputs are replaced by
  the reference, its receipt is not countersigned, and evidence goes into the DHT: a one-row
  challenge answered by the accused and by honest witnesses, each signed (``OutputEvidence``).
* **Evidence from others.**  Other backbones read ``/moeswarm/v1/<model>/evidence/<holder>`` for
  every holder they know, check the record's signatures and numbers without any call, and exclude.
* **Who is chosen.**  Holders that passed probation are preferred whatever the load others claim;
  a holder on probation gets experts nobody trusted holds, plus one exploratory call per MoE layer
  dispatch (always checked) until it passes, so newcomers earn trust and liars are caught early.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._tasks import cancel_and_wait
from ..errors import BadResponse, ConfigError, ProtocolError, SwarmError
from ..model import ModelConfig, Weights, expert_ffn
from ..model.experts import F32Cache
from ..net.evidence import (
    OutputEvidence,
    check_evidence,
    evidence_key,
    output_tolerance,
    relative_error,
    validate_evidence,
)
from ..net.routing_table import Holder, SwarmTable, plan_dispatch
from ..protocol import (
    DHT,
    ErrorCode,
    ExpertRequest,
    ExpertResponse,
    ExpertRows,
    Identity,
    peer_id_to_str,
)

log = logging.getLogger(__name__)

INLINE_MACS = 4_000_000
"""Recomputations of at most this many multiply-adds run on the event loop: a thread hop costs
more (the expert server's ``inline_macs`` rule)."""
METHODS = ("auto", "local", "holders")


@dataclass(frozen=True)
class VerifyConfig:
    fraction: float = 0.05  # share of a trusted holder's calls checked, 0..1; 0 turns every check off
    probation_calls: int = 8  # a holder's first calls, all checked; it is preferred only once it passed them
    method: str = "auto"  # "auto": recompute where the checkpoint holds the experts, else ask other holders;
    # "local": recompute only (calls whose experts are not here go unchecked); "holders": ask other holders only
    spot_fraction: float = 1.0  # after probation, the share of the calls not checked in full of which one random
    # row per expert is recomputed (where this backbone holds the experts): at 1 a liar that waits out probation
    # is caught on its first lie
    publish_evidence: bool = True  # put signed evidence against a caught holder into the DHT
    evidence_interval_s: float = 10.0  # read the DHT's evidence against known holders this often
    republish_s: float = 240.0  # put the evidence this backbone published again this often (DHT churn)

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction <= 1.0:
            raise ConfigError(f"the verify fraction must be within 0..1, not {self.fraction}")
        if self.probation_calls < 0:
            raise ConfigError(f"--probation-calls must be >= 0, not {self.probation_calls}")
        if not 0.0 <= self.spot_fraction <= 1.0:
            raise ConfigError(f"--spot-check-fraction must be within [0, 1], not {self.spot_fraction}")
        if self.method not in METHODS:
            raise ConfigError(f"--verify-by is one of {', '.join(METHODS)}, not {self.method!r}")

    @property
    def enabled(self) -> bool:
        return self.fraction > 0


class ExcludedHolder(BadResponse):
    """A response from a holder excluded for wrong outputs (its experts are retried elsewhere)."""


@dataclass
class HolderChecks:
    calls: int = 0  # responses received
    checked: int = 0
    passed: int = 0
    failed: int = 0


CallHolder = Callable[[bytes, ExpertRequest, bool], Awaitable[tuple[ExpertRequest, ExpertResponse]]]
"""(peer, request, settle) -> (the request as sent: new id and seq, its checked response)."""


class Verifier:
    def __init__(self, cfg: ModelConfig, identity: Identity, table: SwarmTable, config: VerifyConfig, *,
                 weights: Weights | None, call: CallHolder, dht: DHT | None, wire_dtype: str) -> None:
        self.cfg, self.identity, self.table, self.config = cfg, identity, table, config
        self.weights = weights if config.method != "holders" else None
        self.call, self.dht = call, dht
        self.tolerance = output_tolerance(wire_dtype)
        self.stats: dict[bytes, HolderChecks] = {}
        self._rng = random.Random(os.urandom(16))
        self._f32 = F32Cache(64 << 20)
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop_task: asyncio.Task[None] | None = None
        self.checked = self.passed = self.disagreements = self.unverifiable = 0
        self.spot_checked = 0  # calls of trusted holders of which one row per expert was recomputed
        self.verification_calls = 0  # extra calls to other holders made to check one
        self.check_s = 0.0  # time the checks added to the token path, seconds
        self.evidence_published = self.evidence_accepted = 0
        self.evidence_errors: list[str] = []
        self._published: dict[str, bytes] = {}  # evidence key -> the record this backbone put there

    # ------------------------------------------------------------------ choosing holders

    def trusted(self, peer: bytes) -> bool:
        s = self.stats.get(peer)
        return s is not None and s.passed >= self.config.probation_calls and s.failed == 0

    def plan(self, layer: int, experts: Iterable[int], exclude: set[bytes]) -> tuple[dict[bytes, list[int]], list[int]]:
        """Trusted holders first (by score); holders on probation get what no trusted holder
        holds, and one of them one exploratory expert; see the module docstring."""
        live = [h for h in self.table.live() if h.peer_id not in exclude]
        if not self.config.enabled:
            return plan_dispatch(layer, experts, live)
        trusted = [h for h in live if self.trusted(h.peer_id)]
        plan, missing = plan_dispatch(layer, experts, trusted)
        if missing:
            more, missing = plan_dispatch(layer, missing, [h for h in live if not self.trusted(h.peer_id)])
            for peer, es in more.items():
                plan.setdefault(peer, []).extend(es)
        self._explore(layer, plan, [h for h in live if not self.trusted(h.peer_id) and h.peer_id not in plan])
        return plan, missing

    def _explore(self, layer: int, plan: dict[bytes, list[int]], newcomers: list[Holder]) -> None:
        for h in sorted(newcomers, key=lambda h: (self.stats.get(h.peer_id, HolderChecks()).calls, h.peer_id)):
            for peer, es in plan.items():
                movable = [e for e in es if h.holds(layer, e)]
                if movable:
                    es.remove(movable[0])
                    if not es:
                        del plan[peer]
                    plan[h.peer_id] = [movable[0]]
                    return

    # ------------------------------------------------------------------ checking a response

    async def check(self, peer: bytes, request: ExpertRequest, response: ExpertResponse,
                    outputs: np.ndarray) -> tuple[np.ndarray, bool]:
        """-> (outputs to use (P, H) float32, whether the holder's own outputs are used).
        Raises ``ExcludedHolder`` for a holder excluded meanwhile."""
        if peer in self.table.excluded:
            raise ExcludedHolder(f"{peer_id_to_str(peer)} is excluded: {self.table.excluded[peer]}",
                                 code=ErrorCode.BAD_TENSOR)
        s = self.stats.setdefault(peer, HolderChecks())
        s.calls += 1
        if not self.config.enabled:
            return outputs, True
        if self.trusted(peer) and self._rng.random() >= self.config.fraction:
            if self.weights is None or self._rng.random() >= self.config.spot_fraction:
                return outputs, True
            t0 = time.perf_counter()
            try:
                return await self._spot_check(peer, request, response, outputs)
            finally:
                self.check_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        try:
            local = await self._recompute(request) if self.weights is not None else None
            if local is not None:
                return self._judge_local(peer, request, response, outputs, local)
            if self.config.method == "local":
                self.unverifiable += 1
                return outputs, True
            return await self._judge_by_holders(peer, request, response, outputs)
        finally:
            self.check_s += time.perf_counter() - t0

    async def _spot_check(self, peer: bytes, request: ExpertRequest, response: ExpertResponse,
                          outputs: np.ndarray) -> tuple[np.ndarray, bool]:
        """Recompute one random row of each expert of the call; on a mismatch, the whole call."""
        assert self.weights is not None
        held = self.weights.experts.get(request.layer, {})
        if any(int(e.expert) not in held for e in request.experts):
            return outputs, True  # not held here: only the sampled full checks (by holders) cover it
        picks: list[tuple[int, int, int]] = []  # (row of the outputs, expert, row of the hidden states)
        offset = 0
        for e in request.experts:
            i = self._rng.randrange(len(e.rows))
            picks.append((offset + i, int(e.expert), int(e.rows[i])))
            offset += len(e.rows)
        sample = ExpertRequest(request.request_id, request.model_id, request.layer, request.seq, request.hidden,
                               tuple(ExpertRows(e, np.array([row], np.uint32)) for _, e, row in picks))
        reference = await self._run(self._compute, sample, held)  # (k, H)
        self.spot_checked += 1
        error = relative_error(response.outputs[[p for p, _, _ in picks]], reference)
        if error <= self.tolerance:
            return outputs, True
        full = await self._recompute(request)
        assert full is not None
        return self._judge_local(peer, request, response, outputs, full)

    def _judge_local(self, peer: bytes, request: ExpertRequest, response: ExpertResponse, outputs: np.ndarray,
                     reference: np.ndarray) -> tuple[np.ndarray, bool]:
        self.checked += 1
        self.stats[peer].checked += 1
        error = relative_error(response.outputs, reference)
        if error <= self.tolerance:
            self._pass(peer)
            return outputs, True
        self.disagreements += 1
        self._caught(peer, request, response, f"outputs differ from this backbone's recomputation by {error:.3g} "
                                               f"(tolerance {self.tolerance:.3g})", (), reference)
        return reference, False

    async def _judge_by_holders(self, peer: bytes, request: ExpertRequest, response: ExpertResponse,
                                outputs: np.ndarray) -> tuple[np.ndarray, bool]:
        """Second holder; on disagreement a third; the majority wins."""
        second = await self._witness(request, exclude={peer})
        if second is None:
            self.unverifiable += 1
            return outputs, True
        self.checked += 1
        self.stats[peer].checked += 1
        w1, r1 = second
        if relative_error(r1.outputs, response.outputs) <= self.tolerance:
            self._pass(peer)
            self._pass(w1)
            return outputs, True
        self.disagreements += 1
        third = await self._witness(request, exclude={peer, w1})
        if third is None:
            raise BadResponse(f"{peer_id_to_str(peer)} and {peer_id_to_str(w1)} disagree and no third holder "
                              "could decide", code=ErrorCode.BAD_TENSOR)
        w2, r2 = third
        if relative_error(r2.outputs, r1.outputs) <= self.tolerance:
            self._pass(w1)
            self._pass(w2)
            self._caught(peer, request, response, "outputs differ from two other holders'", (w1, w2), r1.outputs)
            return r1.outputs.astype(np.float32), False
        if relative_error(r2.outputs, response.outputs) <= self.tolerance:
            self._pass(peer)
            self._pass(w2)
            self.stats.setdefault(w1, HolderChecks()).checked += 1
            self._caught(w1, request, r1, "outputs differ from two other holders'", (peer, w2), response.outputs)
            return outputs, True
        raise BadResponse("three holders returned three different outputs for one request", code=ErrorCode.BAD_TENSOR)

    async def _witness(self, request: ExpertRequest, exclude: set[bytes]) -> tuple[bytes, ExpertResponse] | None:
        """Send the same request to another holder of all its experts (trusted ones first)."""
        experts = [int(e.expert) for e in request.experts]
        options = [h for h in self.table.live() if h.peer_id not in exclude
                   and all(h.holds(request.layer, e) for e in experts)]
        for h in sorted(options, key=lambda h: (not self.trusted(h.peer_id), h.score(), h.peer_id))[:2]:
            self.verification_calls += 1
            try:
                _, response = await self.call(h.peer_id, request, True)
            except (SwarmError, OSError) as e:
                log.info("verification call to %s failed: %s", peer_id_to_str(h.peer_id), e)
                continue
            return h.peer_id, response
        return None

    def _pass(self, peer: bytes) -> None:
        self.passed += 1
        self.stats.setdefault(peer, HolderChecks()).passed += 1

    def _caught(self, peer: bytes, request: ExpertRequest, response: ExpertResponse, why: str,
                witnesses: tuple[bytes, ...], reference: np.ndarray) -> None:
        """Exclude ``peer`` and publish evidence (``witnesses``: the majority that outvoted it, if any)."""
        self.stats.setdefault(peer, HolderChecks()).failed += 1
        if peer in self.table.excluded:  # caught twice by checks that were in flight together
            return
        self.exclude(peer, why)
        if self.config.publish_evidence and self.dht is not None:
            challenge = _challenge(request, response.outputs, reference)
            task = asyncio.create_task(self._prove(peer, challenge, witnesses))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def exclude(self, peer: bytes, why: str) -> None:
        if peer not in self.table.excluded:
            log.warning("excluding holder %s: %s", peer_id_to_str(peer), why)
            self.table.excluded[peer] = why

    async def _recompute(self, request: ExpertRequest) -> np.ndarray | None:
        assert self.weights is not None
        held = self.weights.experts.get(request.layer, {})
        if any(int(e.expert) not in held for e in request.experts):
            return None
        return await self._run(self._compute, request, held)

    async def _run(self, compute: Callable[[ExpertRequest, dict[int, Any]], np.ndarray], request: ExpertRequest,
                   held: dict[int, Any]) -> np.ndarray:
        """A recomputation: on the event loop when it is smaller than a thread hop costs (a
        decode step's spot check: one row per expert), else in a worker thread."""
        macs = request.pairs * 3 * self.cfg.hidden_size * self.cfg.moe_intermediate_size
        if macs <= INLINE_MACS:
            return compute(request, held)
        return await asyncio.to_thread(compute, request, held)

    def _compute(self, request: ExpertRequest, held: dict[int, Any]) -> np.ndarray:
        """Thread: the request's outputs (P, H) float32, as an honest holder computes them."""
        hidden = request.hidden.astype(np.float32)  # (N, H)
        out = []
        for e in request.experts:
            w = held[int(e.expert)]
            w32 = w if w.gate.dtype == np.float32 else self._f32.get((request.layer, int(e.expert)), w)
            out.append(expert_ffn(w32, hidden[e.rows.astype(np.int64)], self.cfg))
        return np.concatenate(out)  # (P, H)

    # ------------------------------------------------------------------ evidence

    async def _prove(self, accused: bytes, challenge: ExpertRequest, witnesses: tuple[bytes, ...]) -> None:
        """Send the challenge to the accused and to witnesses (the majority, else trusted holders
        first), check the record as its readers will, publish it."""
        try:
            _, accused_answer = await self.call(accused, challenge, False)
            mine = await self._recompute(challenge) if self.weights is not None else None
            answers = []
            for w in witnesses or self._evidence_witnesses(challenge, accused):
                try:
                    _, answer = await self.call(w, challenge, True)
                except (SwarmError, OSError) as e:
                    log.info("evidence witness %s failed: %s", peer_id_to_str(w), e)
                    continue
                if mine is not None and relative_error(answer.outputs, mine) > self.tolerance:
                    self._caught(w, challenge, answer, "outputs differ from this backbone's recomputation", (), mine)
                    continue  # a witness that is wrong too: caught in turn, not a witness
                answers.append(answer)
                if len(answers) == max(1, len(witnesses)):
                    break
            if not answers:
                raise BadResponse("no other holder answered the challenge")
            ev = OutputEvidence(self.table.model_id, accused, self.identity.peer_id, int(time.time() * 1000),
                                challenge, (accused_answer, *answers)).signed(self.identity)
            check_evidence(ev)  # what readers will check: the accused may have answered this one honestly
            assert self.dht is not None
            key, value = evidence_key(self.table.model_id, accused), ev.encode()
            await self.dht.put(key, value)
            self._published[key] = value
            self.evidence_published += 1
        except (SwarmError, OSError) as e:
            self.evidence_errors.append(f"{type(e).__name__}: {e}")
            log.warning("no evidence published against %s: %s", peer_id_to_str(accused), e)

    def _evidence_witnesses(self, challenge: ExpertRequest, accused: bytes) -> list[bytes]:
        e = int(challenge.experts[0].expert)
        options = [h for h in self.table.live() if h.peer_id != accused and h.holds(challenge.layer, e)]
        return [h.peer_id for h in sorted(options, key=lambda h: (not self.trusted(h.peer_id), h.score(), h.peer_id))]

    async def read_evidence(self) -> int:
        """Exclude every known holder the DHT holds valid evidence against; returns how many."""
        if self.dht is None or not self.config.enabled:
            return 0
        found = 0
        for peer in [p for p in list(self.table.holders) if p not in self.table.excluded]:
            key = evidence_key(self.table.model_id, peer)
            try:
                value = await self.dht.get(key)
                if value is None:
                    continue
                ev = validate_evidence(key, value)
            except ProtocolError as e:
                log.info("evidence against %s rejected: %s", peer_id_to_str(peer), e)
                continue
            except SwarmError as e:
                log.info("reading evidence against %s failed: %s", peer_id_to_str(peer), e)
                continue
            self.exclude(peer, f"evidence from {peer_id_to_str(ev.reporter)} (witnesses "
                               f"{', '.join(peer_id_to_str(w)[-8:] for w in ev.witnesses)})")
            self.evidence_accepted += 1
            found += 1
        return found

    async def start(self) -> None:
        """Read the evidence once now, then on a period."""
        await self.read_evidence()
        self._loop_task = asyncio.create_task(self._read_loop())

    async def _read_loop(self) -> None:
        republished = time.monotonic()
        while True:
            await asyncio.sleep(self.config.evidence_interval_s)
            await self.read_evidence()
            if self._published and time.monotonic() - republished >= self.config.republish_s:
                republished = time.monotonic()
                for key, value in list(self._published.items()):
                    try:
                        assert self.dht is not None
                        await self.dht.put(key, value)
                    except SwarmError as e:
                        log.info("republishing %s failed: %s", key, e)

    async def aclose(self) -> None:
        if self._loop_task is not None:
            await cancel_and_wait(self._loop_task)
        for task in list(self._tasks):  # evidence being published: bounded by the calls' timeouts
            await asyncio.wait({task}, timeout=30)
            await cancel_and_wait(task)

    def status(self) -> dict[str, Any]:
        c = self.config
        return {"fraction": c.fraction, "probation_calls": c.probation_calls, "tolerance": self.tolerance,
                "method": "off" if not c.enabled else "local" if self.weights is not None and c.method != "holders"
                else "holders" if c.method != "local" else "none",
                "checked": self.checked, "spot_checked": self.spot_checked, "passed": self.passed,
                "disagreements": self.disagreements,
                "unverifiable": self.unverifiable, "verification_calls": self.verification_calls,
                "check_ms": round(self.check_s * 1e3, 1),
                "evidence_published": self.evidence_published, "evidence_accepted": self.evidence_accepted,
                "evidence_errors": self.evidence_errors[-5:],
                "excluded": {peer_id_to_str(p): why for p, why in self.table.excluded.items()},
                "holders": {peer_id_to_str(p): {"calls": s.calls, "checked": s.checked, "passed": s.passed,
                                                "failed": s.failed, "trusted": self.trusted(p)}
                            for p, s in self.stats.items()}}


def _challenge(request: ExpertRequest, outputs: np.ndarray, reference: np.ndarray) -> ExpertRequest:
    """One row through one expert of ``request``: where ``outputs`` differ most from ``reference``."""
    pair = int(np.abs(outputs.astype(np.float32) - reference.astype(np.float32)).max(axis=1).argmax())
    offset = 0
    for e in request.experts:
        if pair < offset + len(e.rows):
            row = int(e.rows[pair - offset])
            return ExpertRequest(os.urandom(16), request.model_id, request.layer, 0,
                                 np.ascontiguousarray(request.hidden[row:row + 1]),
                                 (ExpertRows(int(e.expert), np.zeros(1, np.uint32)),))
        offset += len(e.rows)
    raise ConfigError("the request has no pairs")
