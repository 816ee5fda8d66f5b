"""Audits: re-execute a sample of expert calls and compare the outputs within a tolerance.

``reexecute`` is the pure core: given the call's request (hidden rows and expert ids), the
outputs the server returned, its countersigned receipt and the model's weights, it checks that
the sample really is the receipted call (both hashes, both signatures, every field) and then
recomputes every (expert, row) pair. The error is ``max |output - reference|`` divided by
``max(1, max |reference|)``; above ``tolerance`` the server lied (or computed garbage).

``AuditRunner`` is the shell a backbone wires in: ``offer(request, outputs, receipt)`` after each
countersigned receipt samples ``fraction`` of the calls and hands them to a judge in the
background: ``LocalJudge`` (weights in this process, evidence into a ``Ledger``; in ``_evidence``) or
``RemoteJudge`` (``POST /v1/audits`` to the ledger service, which re-executes itself).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from moeswarm._tasks import cancel_and_wait
from moeswarm.errors import BadResponse, ConfigError, ProtocolError
from moeswarm.model import Weights, expert_ffn
from moeswarm.protocol import (
    BatchedReceipt,
    CountersignedReceipt,
    DecodeLimits,
    ErrorCode,
    ExpertRequest,
    canonical,
    decode,
    encode,
    input_hash,
    output_hash,
    tensor_from_wire,
    tensor_to_wire,
    unpack,
    verify_record,
)

from ._chain import receipt_id

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AuditConfig:
    """How many calls are audited and how close the outputs must be."""

    fraction: float = 0.01  # share of expert calls re-executed, 0..1
    tolerance: float = 1e-2  # largest max|output - reference| / max(1, max|reference|) that passes
    seed: int | None = None  # sampling RNG seed; None = unpredictable (a server must not guess)
    max_queue: int = 64  # sampled calls waiting for a judge; beyond it new samples are skipped
    max_pairs: int = 8192  # a judge refuses to re-execute a call of more (expert, token) pairs
    max_flops: int = 2**40  # ... or of more expert-FLOPs (6 * H * F per pair): ~1e12, seconds of one core

    def work_problem(self, pairs: int, flops: int) -> str | None:
        """Why a call of ``pairs`` pairs costing ``flops`` is too much to re-execute, or None."""
        if pairs > self.max_pairs or flops > self.max_flops:
            return (f"re-executing {pairs} pairs ({flops:.3g} expert-FLOPs) is above this judge's cap of "
                    f"{self.max_pairs} pairs and {self.max_flops:.3g} FLOPs per audit")
        return None

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction <= 1.0:
            raise ConfigError(f"audit fraction must be within 0..1, not {self.fraction}")
        if not self.tolerance >= 0.0:
            raise ConfigError(f"audit tolerance must be >= 0, not {self.tolerance}")


@dataclass(frozen=True, eq=False)
class AuditSample:
    """One served call as the backbone saw it: enough for anyone with the weights to re-check it."""

    request: ExpertRequest
    outputs: np.ndarray  # (P, H) as the server returned them
    receipt: CountersignedReceipt | BatchedReceipt

    def encode(self) -> bytes:
        return canonical({"outputs": tensor_to_wire(self.outputs), "receipt": encode(self.receipt),
                          "request": encode(self.request)})

    @classmethod
    def decode(cls, data: bytes) -> AuditSample:
        """``ProtocolError`` for anything that is not a sample."""
        try:
            m = unpack(data, DecodeLimits(max_depth=4, max_map=16))  # bounded like any frame body
        except ProtocolError as e:
            raise ProtocolError(f"audit sample is not msgpack: {e}", code=ErrorCode.MALFORMED_FRAME) from None
        if type(m) is not dict or not all(type(m.get(k)) is bytes for k in ("request", "receipt")):
            raise ProtocolError("audit sample must map request and receipt to bin", code=ErrorCode.BAD_FIELD)
        request, receipt = decode(m["request"]), decode(m["receipt"])
        if not isinstance(request, ExpertRequest) or not isinstance(receipt, (CountersignedReceipt, BatchedReceipt)):
            raise ProtocolError("audit sample must hold an expert_request and a countersigned or batched receipt",
                                code=ErrorCode.BAD_FIELD)
        return cls(request, tensor_from_wire(m.get("outputs"), "outputs", rank=2), receipt)


@dataclass(frozen=True)
class AuditVerdict:
    receipt_id: bytes
    server: bytes
    ok: bool  # outputs within tolerance
    max_error: float  # max|output - reference| / max(1, max|reference|)
    tolerance: float
    message: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"receipt_id": self.receipt_id.hex(), "server": self.server.hex(), "ok": self.ok,
                "max_error": self.max_error, "tolerance": self.tolerance, "message": self.message}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> AuditVerdict:
        return cls(bytes.fromhex(d["receipt_id"]), bytes.fromhex(d["server"]), bool(d["ok"]),
                   float(d["max_error"]), float(d["tolerance"]), str(d.get("message", "")))


def check_sample(sample: AuditSample) -> None:
    """That the sample is the call its receipt describes; ``BadResponse`` (the sample's fault) if not."""
    verify_record(sample.receipt)
    req, r = sample.request, sample.receipt.receipt
    expected = {"request_id": req.request_id, "model_id": req.model_id, "layer": req.layer,
                "experts": tuple(int(e.expert) for e in req.experts), "tokens": int(req.hidden.shape[0]),
                "pairs": req.pairs, "seq": req.seq}
    for name, value in expected.items():
        if getattr(r, name) != value:
            raise BadResponse(f"audit sample: receipt.{name} does not match the request", code=ErrorCode.BAD_FIELD)
    if input_hash(req.hidden, req.experts) != r.input_hash:
        raise BadResponse("audit sample: hidden rows or routing differ from the receipt's input_hash")
    if sample.outputs.shape != (req.pairs, req.hidden.shape[1]) or output_hash(sample.outputs) != r.output_hash:
        raise BadResponse("audit sample: outputs differ from the receipt's output_hash")


def reexecute(sample: AuditSample, weights: Weights, tolerance: float) -> AuditVerdict:
    """Recompute every (expert, row) pair of a receipted call and compare (see the module docstring)."""
    check_sample(sample)
    req, cfg = sample.request, weights.config
    held = weights.experts.get(req.layer, {})
    missing = [e.expert for e in req.experts if e.expert not in held]
    if missing:
        raise ConfigError(f"cannot audit: layer {req.layer} experts {missing} are not in the audit weights")
    if req.hidden.shape[1] != cfg.hidden_size:
        raise BadResponse(f"audit sample: hidden width {req.hidden.shape[1]} is not {cfg.hidden_size}")
    hidden = req.hidden.astype(np.float32)  # (N, H)
    reference = np.concatenate([expert_ffn(held[e.expert], hidden[e.rows.astype(np.int64)], cfg)
                                for e in req.experts])  # (P, H)
    outputs = sample.outputs.astype(np.float32)  # (P, H)
    scale = max(1.0, float(np.abs(reference).max()))
    error = float(np.abs(outputs - reference).max()) / scale
    ok = error <= tolerance
    r = sample.receipt.receipt
    message = "" if ok else f"outputs differ from a re-execution by {error:.3g} (tolerance {tolerance:.3g})"
    return AuditVerdict(receipt_id(r), r.server, ok, error, tolerance, message)


Judge = Callable[[AuditSample], Awaitable[AuditVerdict]]


class AuditRunner:
    """Samples ``config.fraction`` of the calls offered and has ``judge`` check them in the background."""

    def __init__(self, config: AuditConfig, judge: Judge) -> None:
        self.config = config
        self.judge = judge
        self._rng = random.Random(config.seed)
        self._queue: asyncio.Queue[AuditSample] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self.offered = 0
        self.skipped = 0  # sampled but the queue was full
        self.verdicts: list[AuditVerdict] = []
        self.errors: list[str] = []  # samples a judge could not decide, with the reason

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue = asyncio.Queue(self.config.max_queue)
        self._task = asyncio.create_task(self._work())

    def offer(self, request: ExpertRequest, outputs: np.ndarray,
              receipt: CountersignedReceipt | BatchedReceipt) -> bool:
        """Non-blocking, from any thread: maybe queue this call for an audit. True if sampled."""
        self.offered += 1
        if self._loop is None or self._rng.random() >= self.config.fraction:
            return False
        sample = AuditSample(request, np.array(outputs, copy=True), receipt)
        self._loop.call_soon_threadsafe(self._enqueue, sample)
        return True

    def _enqueue(self, sample: AuditSample) -> None:
        assert self._queue is not None
        try:
            self._queue.put_nowait(sample)
        except asyncio.QueueFull:
            self.skipped += 1

    async def _work(self) -> None:
        assert self._queue is not None
        while True:
            sample = await self._queue.get()
            try:
                verdict = await self.judge(sample)
                self.verdicts.append(verdict)
                if not verdict.ok:
                    log.warning("audit failed for server %s: %s", verdict.server.hex()[-12:], verdict.message)
            except Exception as e:  # noqa: BLE001 - one undecidable sample must not stop the audits
                self.errors.append(f"{type(e).__name__}: {e}")
                log.warning("audit could not be decided: %s", e)
            finally:
                self._queue.task_done()

    async def drain(self) -> None:
        """Wait until every queued sample has been judged."""
        await asyncio.sleep(0)  # let call_soon_threadsafe enqueues land
        if self._queue is not None:
            await self._queue.join()

    async def aclose(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
