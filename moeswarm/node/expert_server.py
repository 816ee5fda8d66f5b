"""The expert server: computes a node's experts for ``ExpertRequest``s and signs receipts.

Requests that arrive while a batch is computing wait in a queue; the worker then takes all
queued requests at once and runs each (layer, expert) once over the rows of every request that
routed to it, so concurrent backbones share one matmul per expert.  Compute runs in a worker
thread; the event loop only decodes, queues and answers.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import numpy as np

from .._tasks import cancel_and_wait
from ..errors import ProtocolError
from ..model import ExpertWeights, Weights, expert_ffn, expert_flops
from ..model.experts import F32Cache
from ..protocol import ErrorCode, ExpertRequest, ExpertResponse, Identity, make_receipt


@dataclass(frozen=True)
class ExpertServerConfig:
    model_id: str  # the model id announced and required in requests
    layers: tuple[int, int]  # first, last layer held (inclusive)
    experts: tuple[int, int]  # first, last expert held in each layer (inclusive)
    max_queue: int = 256  # queued requests beyond this are refused with OVERLOADED
    max_batch_requests: int = 64  # requests merged into one compute batch
    inline_macs: int = 4_000_000  # batches smaller than this many multiply-adds run on the event loop
    f32_cache_bytes: int = 512 << 20  # float32 copies of fp16/bf16 experts kept between calls


@dataclass
class _Job:
    client: bytes
    request: ExpertRequest
    future: asyncio.Future[ExpertResponse]
    held: Mapping[int, ExpertWeights]  # the layer's experts when the request was accepted
    arrived: float = field(default_factory=time.monotonic)


class ExpertServer:
    def __init__(self, weights: Weights, identity: Identity, config: ExpertServerConfig) -> None:
        self.weights = weights
        self.cfg = weights.config
        self.identity = identity
        self.config = config
        self._queue: asyncio.Queue[_Job] = asyncio.Queue()
        self._worker: asyncio.Task[None] | None = None
        self.pairs_served = 0
        self.requests_served = 0
        self._rate = 0.0  # (expert, token) pairs per second of compute, smoothed
        self._f32 = F32Cache(config.f32_cache_bytes)
        self.on_access: Callable[[int, int], None] | None = None  # e.g. MemoryBudget.before_expert

    @property
    def load_permille(self) -> int:
        return min(1000, 1000 * self._queue.qsize() // max(1, self.config.max_queue))

    @property
    def throughput(self) -> int:
        return int(self._rate)

    async def start(self) -> None:
        self._worker = asyncio.create_task(self._work())

    async def aclose(self) -> None:
        if self._worker is not None:
            await cancel_and_wait(self._worker)
        while not self._queue.empty():
            job = self._queue.get_nowait()
            if not job.future.done():
                job.future.set_exception(ProtocolError("server shutting down", code=ErrorCode.OVERLOADED))

    def _experts(self, layer: int) -> dict[int, ExpertWeights]:
        return self.weights.experts.get(layer, {})

    def serve(self, weights: Weights, layers: tuple[int, int], experts: tuple[int, int]) -> None:
        """Serve the experts of ``weights`` from now on (a node moving its block). Requests already
        accepted are computed with the experts they were accepted for, even ones no longer held."""
        dropped = any(e not in weights.experts.get(L, {}) for L, held in self.weights.experts.items() for e in held)
        self.weights = weights
        self.config = replace(self.config, layers=layers, experts=experts)
        if dropped:  # free the float32 copies of experts no longer held
            self._f32 = F32Cache(self.config.f32_cache_bytes)

    def validate(self, request: ExpertRequest) -> None:
        """Everything the codec cannot know: is this model/layer/expert served here, shapes."""
        c = self.config
        if request.model_id != c.model_id:
            raise ProtocolError(f"model {request.model_id!r} is not served here", code=ErrorCode.UNKNOWN_EXPERT)
        held = self._experts(request.layer)
        if not held:
            raise ProtocolError(f"layer {request.layer} is not served here", code=ErrorCode.UNKNOWN_EXPERT)
        missing = [e.expert for e in request.experts if e.expert not in held]
        if missing:
            raise ProtocolError(f"experts {missing} of layer {request.layer} are not served here",
                                code=ErrorCode.UNKNOWN_EXPERT)
        if request.hidden.ndim != 2 or request.hidden.shape[1] != self.cfg.hidden_size:
            raise ProtocolError(f"hidden must be (N, {self.cfg.hidden_size}), got {list(request.hidden.shape)}",
                                code=ErrorCode.BAD_TENSOR)

    async def handle(self, client: bytes, request: ExpertRequest) -> ExpertResponse:
        self.validate(request)
        if self._queue.qsize() >= self.config.max_queue:
            raise ProtocolError("expert queue is full", code=ErrorCode.OVERLOADED)
        job = _Job(client, request, asyncio.get_running_loop().create_future(), self._experts(request.layer))
        self._queue.put_nowait(job)
        return await job.future

    async def _work(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while not self._queue.empty() and len(batch) < self.config.max_batch_requests:
                batch.append(self._queue.get_nowait())
            now = time.monotonic()
            live = []
            for job in batch:
                deadline = job.request.deadline_ms
                if deadline is not None and (now - job.arrived) * 1000 > deadline:
                    job.future.set_exception(ProtocolError("deadline passed before compute",
                                                           code=ErrorCode.DEADLINE_EXCEEDED))
                elif not job.future.done():  # the caller may have gone away
                    live.append(job)
            if not live:
                continue
            t0 = time.perf_counter()
            macs = sum(j.request.pairs for j in live) * 3 * self.cfg.hidden_size * self.cfg.moe_intermediate_size
            try:
                if macs <= self.config.inline_macs:  # a thread hop costs more than this much math
                    responses = self._compute(live)
                else:
                    responses = await asyncio.to_thread(self._compute, live)
            except Exception as e:  # noqa: BLE001 - report to every caller, keep serving
                for job in live:
                    if not job.future.done():
                        job.future.set_exception(e)
                continue
            seconds = time.perf_counter() - t0
            pairs = sum(job.request.pairs for job in live)
            self._rate = 0.8 * self._rate + 0.2 * (pairs / max(seconds, 1e-6)) if self._rate else pairs / max(seconds, 1e-6)
            self.pairs_served += pairs
            self.requests_served += len(live)
            for job, response in zip(live, responses):
                if job.future.done():
                    continue
                if isinstance(response, ProtocolError):
                    job.future.set_exception(response)
                else:
                    job.future.set_result(response)

    def _compute(self, jobs: list[_Job]) -> list[ExpertResponse | ProtocolError]:
        """Thread: one matmul chain per (layer, expert) over all jobs' rows, then sign."""
        t0 = time.perf_counter()
        inputs = [j.request.hidden.astype(np.float32, copy=False) for j in jobs]
        outputs = [np.empty((j.request.pairs, self.cfg.hidden_size), np.float32) for j in jobs]
        work: dict[tuple[int, int], list[tuple[int, np.ndarray, int]]] = defaultdict(list)
        for i, job in enumerate(jobs):
            offset = 0
            for e in job.request.experts:
                work[(job.request.layer, int(e.expert))].append((i, e.rows, offset))
                offset += len(e.rows)
        for (layer, expert), parts in work.items():
            x = np.concatenate([inputs[i][rows] for i, rows, _ in parts])
            held = jobs[parts[0][0]].held  # validated to hold this expert, even if a move dropped it since
            with np.errstate(over="ignore", invalid="ignore"):  # overflow is answered as NON_FINITE below
                y = expert_ffn(self._f32.layer(layer, held, self.on_access)[expert], x, self.cfg)
            start = 0
            for i, rows, offset in parts:
                outputs[i][offset : offset + len(rows)] = y[start : start + len(rows)]
                start += len(rows)
        return self._respond(jobs, outputs, t0)

    def _respond(self, jobs: list[_Job], outputs: list[np.ndarray],
                 t0: float) -> list[ExpertResponse | ProtocolError]:
        """Sign a receipt for each job's outputs (in its request's dtype) and build the responses.
        Outputs that overflowed (finite but huge hidden states in, Inf or NaN out, also after a
        cast to f16) become that request's NON_FINITE error: the protocol forbids sending them,
        and the other requests of the batch are answered as usual."""
        compute_us = int((time.perf_counter() - t0) * 1e6)
        now_ms = int(time.time() * 1000)
        responses: list[ExpertResponse | ProtocolError] = []
        for job, out in zip(jobs, outputs):
            req = job.request
            with np.errstate(over="ignore"):
                out = out.astype(req.hidden.dtype, copy=False)
            if not np.isfinite(out).all():
                responses.append(ProtocolError(f"the outputs overflow {req.hidden.dtype} (hidden states too large)",
                                               code=ErrorCode.NON_FINITE))
                continue
            flops = sum(expert_flops(self.cfg, len(e.rows)) for e in req.experts)
            receipt = make_receipt(self.identity, req, out, client=job.client, expert_flops=flops, time_ms=now_ms)
            responses.append(ExpertResponse(req.request_id, out, receipt, compute_us, self.load_permille))
        return responses
