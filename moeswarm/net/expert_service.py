"""The serving half of the data plane: validates ``ExpertRequest``s, queues them, batches them,
enforces deadlines and signs a receipt for each answer.  What computes the experts is a backend,
a subclass giving ``_experts`` and ``_compute``: ``moeswarm.node.expert_server.ExpertServer``
(numpy, from a memory-mapped checkpoint) or ``moeswarm.mobile_bridge.server.OnnxExpertServer``
(onnxruntime shards on a device).  Everything else is here, so both answer exactly alike.

Requests that arrive while a batch is computing wait in a queue; the worker then takes all queued
requests at once and hands them to the backend together, so concurrent backbones share one matmul
per expert.  Large batches compute in a worker thread; the event loop only decodes, queues and
answers.  A small request reaching an idle server (nothing queued, computing or being handed
over) skips the queue: ``answer_now`` computes it on the connection's own task, which sends the
answer at once (no task, future or worker wake-up on the way); anything concurrent still queues.

On a v1.3 connection (``handle_batched``) the answer goes out without a receipt: once it is sent,
the receipt's body (its two hashes) is made on the event loop, and the client's receipts are
signed together in a ``receipt_batch`` (``flush``) sent on the connection the calls came on: one
signature for up to ``batch_receipts`` calls, at most ``batch_interval_s`` after the first of
them, or before a ``pong`` (the data plane's ``receipts`` hook).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .._tasks import cancel_and_wait
from ..errors import ProtocolError
from ..protocol import (
    DEFAULT_MAX_FRAME, MAX_BATCH_RECEIPTS, ErrorCode, ExpertRequest, ExpertResponse, Identity, Receipt, ReceiptBatch,
    expert_call_flops, make_receipt, sign_batch,
)

log = logging.getLogger(__name__)

RESPONSE_OVERHEAD = 1024
"""Bytes of an expert_response besides its outputs and its receipt's expert list."""


class ExpertShape(Protocol):
    """What the service needs to know of a model (a ``moeswarm.model.ModelConfig`` is one)."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def moe_intermediate_size(self) -> int: ...
    @property
    def top_k(self) -> int: ...


@dataclass(frozen=True)
class ExpertServerConfig:
    model_id: str  # the model id announced and required in requests
    layers: tuple[int, int]  # first, last layer held (inclusive)
    experts: tuple[int, int]  # first, last expert held in each layer (inclusive)
    max_queue: int = 256  # queued requests beyond this are refused with OVERLOADED
    max_batch_requests: int = 64  # requests merged into one compute batch
    inline_macs: int = 4_000_000  # batches smaller than this many multiply-adds run on the event loop
    f32_cache_bytes: int = 512 << 20  # numpy backend: float32 copies of fp16/bf16 experts kept between calls
    max_response_bytes: int = DEFAULT_MAX_FRAME  # largest frame the answer may take (the client's limit)
    batch_receipts: int = 256  # v1.3: a client's receipts signed together once this many wait ...
    batch_interval_s: float = 0.2  # ... or this long after the first of them


@dataclass
class Job:
    client: bytes
    request: ExpertRequest
    future: asyncio.Future[ExpertResponse]
    held: Mapping[int, Any]  # the layer's experts when the request was accepted (backend's own objects)
    arrived: float = field(default_factory=time.monotonic)
    channel: object = None  # v1.3: the connection whose receipt_batch carries this call's receipt (None: signed inline)


class _NoFuture:
    """The future of a job answered at once (``answer_now``): nobody waits on it."""

    def done(self) -> bool:
        return False


_NO_FUTURE: Any = _NoFuture()


class ExpertService:
    """Queue, batch, validate and sign; subclasses compute (``_experts``, ``_compute``)."""

    def __init__(self, cfg: ExpertShape, identity: Identity, config: ExpertServerConfig) -> None:
        self.cfg = cfg
        self.identity = identity
        self.config = config
        self._queue: asyncio.Queue[Job] = asyncio.Queue()
        self._worker: asyncio.Task[None] | None = None
        self._computing = False  # a queued batch is being computed (maybe in a thread): newcomers queue behind it
        self.pairs_served = 0
        self.requests_served = 0
        self.answered_at_once = 0  # of those, answered by ``answer_now`` (an idle server), not through the queue
        self._rate = 0.0  # (expert, token) pairs per second of compute, smoothed
        self._to_receipt: list[tuple[Job, np.ndarray, int, int]] = []  # answered, receipt body not yet made
        self._unbatched: dict[object, tuple[bytes, list[Receipt]]] = {}  # channel -> (client, receipts not batched)
        self._batch_timer: asyncio.TimerHandle | None = None
        self.batch_sink: Callable[[object, ReceiptBatch], Awaitable[bool]] | None = None  # sends a batch on a channel
        self.batches_signed = 0
        self.receipts_dropped = 0  # receipts not sent: their channel closed first

    @property
    def load_permille(self) -> int:
        return min(1000, 1000 * self._queue.qsize() // max(1, self.config.max_queue))

    @property
    def throughput(self) -> int:
        return int(self._rate)

    async def start(self) -> None:
        self._worker = asyncio.create_task(self._work())

    async def aclose(self) -> None:
        if self._batch_timer is not None:
            self._batch_timer.cancel()
        if self._worker is not None:
            await cancel_and_wait(self._worker)
        while not self._queue.empty():
            job = self._queue.get_nowait()
            if not job.future.done():
                job.future.set_exception(ProtocolError("server shutting down", code=ErrorCode.OVERLOADED))

    def _experts(self, layer: int) -> Mapping[int, Any]:
        """The experts of ``layer`` held here, by expert id (the backend's own objects)."""
        raise NotImplementedError

    def _compute(self, jobs: Sequence[Job]) -> list[ExpertResponse | ProtocolError]:
        """Compute every job's outputs (``(pairs, hidden)`` float32 each) and ``_respond``."""
        raise NotImplementedError

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
        self.check_work(request)

    def check_work(self, request: ExpertRequest) -> None:
        """Refuse, before any work or allocation, a request that routes a token to more experts
        than the model's top-k, or whose answer would not fit a frame (``ProtocolError`` 4)."""
        tokens, width = request.hidden.shape
        pairs = request.pairs
        top_k = self.cfg.top_k
        if top_k > 0 and pairs > tokens * top_k:
            raise ProtocolError(f"{pairs} (expert, token) pairs exceed {tokens} tokens x top-{top_k}",
                                code=ErrorCode.BAD_FIELD)
        size = pairs * width * request.hidden.dtype.itemsize + 5 * len(request.experts) + RESPONSE_OVERHEAD
        if size > self.config.max_response_bytes:
            raise ProtocolError(f"the answer ({pairs} x {width} outputs, {size} bytes) would not fit a frame of "
                                f"{self.config.max_response_bytes} bytes", code=ErrorCode.BAD_FIELD)

    async def handle(self, client: bytes, request: ExpertRequest) -> ExpertResponse:
        """The answer with its signed receipt (v1.2, or a v1.3 request with ``signed``)."""
        return await self._handle(client, request, None)

    async def handle_batched(self, client: bytes, request: ExpertRequest, channel: object) -> ExpertResponse:
        """v1.3: the answer without a receipt (unless ``request.signed``); the receipt follows in a
        ``receipt_batch`` sent on ``channel`` (the connection the request came on: ``batch_sink``)."""
        return await self._handle(client, request, None if request.signed else channel)

    def answer_now(self, client: bytes, request: ExpertRequest, channel: object) -> ExpertResponse | None:
        """The answer computed at once, on the caller's task, if the server is idle (nothing queued,
        no batch computing) and the request is small enough for the event loop (``inline_macs``);
        else ``None``: it must go through the queue (``handle``/``handle_batched``), where it is
        batched with whatever else waits. ``channel`` as ``handle_batched`` takes it (``None``:
        the receipt is signed into the answer). ``ProtocolError`` for a request refused or
        an answer that cannot be sent (``NON_FINITE``)."""
        self.validate(request)
        if not self._queue.empty() or self._computing or self._macs(request.pairs) > self.config.inline_macs:
            return None
        job = Job(client, request, _NO_FUTURE, self._experts(request.layer),
                  channel=None if request.signed else channel)
        t0 = time.perf_counter()
        response = self._compute([job])[0]
        self._served([job], time.perf_counter() - t0)
        self.answered_at_once += 1
        if isinstance(response, ProtocolError):
            raise response
        self._answered(job, response)
        return response

    async def _handle(self, client: bytes, request: ExpertRequest, channel: object) -> ExpertResponse:
        self.validate(request)
        if self._queue.qsize() >= self.config.max_queue:
            raise ProtocolError("expert queue is full", code=ErrorCode.OVERLOADED)
        job = Job(client, request, asyncio.get_running_loop().create_future(), self._experts(request.layer),
                  channel=channel)
        self._queue.put_nowait(job)
        return await job.future

    def _macs(self, pairs: int) -> int:
        return pairs * 3 * self.cfg.hidden_size * self.cfg.moe_intermediate_size

    async def _work(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while not self._queue.empty() and len(batch) < self.config.max_batch_requests:
                batch.append(self._queue.get_nowait())
            now = time.monotonic()
            live: list[Job] = []
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
            self._computing = True
            try:
                if self._macs(sum(j.request.pairs for j in live)) <= self.config.inline_macs:  # a thread hop costs more than this much math
                    responses = self._compute(live)
                else:
                    responses = await asyncio.to_thread(self._compute, live)
            except Exception as e:  # noqa: BLE001 - report to every caller, keep serving
                for job in live:
                    if not job.future.done():
                        job.future.set_exception(e)
                continue
            finally:
                self._computing = False
            self._served(live, time.perf_counter() - t0)
            for job, response in zip(live, responses):
                if job.future.done():
                    continue
                if isinstance(response, ProtocolError):
                    job.future.set_exception(response)
                else:
                    job.future.set_result(response)
                    self._answered(job, response)

    def _served(self, jobs: Sequence[Job], seconds: float) -> None:
        """Counters and the smoothed compute rate, after a batch was computed."""
        pairs = sum(job.request.pairs for job in jobs)
        rate = pairs / max(seconds, 1e-6)
        self._rate = 0.8 * self._rate + 0.2 * rate if self._rate else rate
        self.pairs_served += pairs
        self.requests_served += len(jobs)

    def _answered(self, job: Job, response: ExpertResponse) -> None:
        """v1.3: an answer without a receipt gets its receipt body made once the answer is sent
        (a callback after the caller's task, which sends it, has run)."""
        if response.receipt is not None:
            return
        if not self._to_receipt:
            asyncio.get_running_loop().call_soon(self._make_receipts)
        self._to_receipt.append((job, response.outputs, self._flops(job.request), int(time.time() * 1000)))

    # ------------------------------------------------------------------ v1.3 receipt batches

    def _make_receipts(self) -> None:
        """The receipt bodies of calls answered without one (two hashes each), queued per channel."""
        made, self._to_receipt = self._to_receipt, []
        for job, out, flops, now_ms in made:
            receipt = make_receipt(self.identity, job.request, out, client=job.client, expert_flops=flops,
                                   time_ms=now_ms, sign=False)
            waiting = self._unbatched.setdefault(job.channel, (job.client, []))[1]
            waiting.append(receipt)
            if len(waiting) >= self.config.batch_receipts:
                self._send(job.channel)
        if self._unbatched and self._batch_timer is None:
            self._batch_timer = asyncio.get_running_loop().call_later(self.config.batch_interval_s, self._send_all)

    def flush(self, channel: object) -> list[ReceiptBatch]:
        """Sign every receipt waiting for ``channel`` now (at most ``MAX_BATCH_RECEIPTS`` a batch)."""
        if self._to_receipt:
            self._make_receipts()
        client, waiting = self._unbatched.pop(channel, (b"", []))
        batches = []
        for i in range(0, len(waiting), MAX_BATCH_RECEIPTS):
            batches.append(sign_batch(self.identity, client, waiting[i : i + MAX_BATCH_RECEIPTS]))
            self.batches_signed += 1
        return batches

    def forget(self, channel: object) -> None:
        """The channel closed: the receipts not yet sent on it are dropped (counted)."""
        self.receipts_dropped += len(self._unbatched.pop(channel, (b"", []))[1])

    def _send_all(self) -> None:
        self._batch_timer = None
        for channel in list(self._unbatched):
            self._send(channel)

    def _send(self, channel: object) -> None:
        if self.batch_sink is None or channel not in self._unbatched:
            return
        task = asyncio.ensure_future(self._deliver(channel, self.flush(channel)))
        task.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)

    async def _deliver(self, channel: object, batches: list[ReceiptBatch]) -> None:
        assert self.batch_sink is not None
        for batch in batches:
            if not await self.batch_sink(channel, batch):  # the channel closed meanwhile
                self.receipts_dropped += len(batch.receipts)

    def _flops(self, request: ExpertRequest) -> int:
        return sum(expert_call_flops(self.cfg.hidden_size, self.cfg.moe_intermediate_size, len(e.rows))
                   for e in request.experts)

    def _respond(self, jobs: Sequence[Job], outputs: list[np.ndarray],
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
            if job.channel is not None:  # v1.3: the receipt is made once the answer is sent (``_work``), signed in a batch
                responses.append(ExpertResponse(req.request_id, out, None, compute_us, self.load_permille))
                continue
            receipt = make_receipt(self.identity, req, out, client=job.client, expert_flops=self._flops(req),
                                   time_ms=now_ms)
            responses.append(ExpertResponse(req.request_id, out, receipt, compute_us, self.load_permille))
        return responses
