"""The backbone's expert executor: routed experts computed by the swarm.

The model's forward pass runs in a worker thread; for each MoE layer it calls ``submit``, which
schedules the dispatch on the event loop and returns at once, so the shared expert is computed
while the requests are in flight.  The dispatch groups the layer's (token, expert) pairs by
holder, sends one request per holder in parallel, checks and countersigns every receipt,
retries failed experts on other replicas, optionally falls back to the local memory-mapped
checkpoint, and otherwise fails with an error that names the missing experts.  Outputs are
combined in slot order, the same on every run.

Hash-routed layers (DeepSeek-V4's) take their experts from the token ids, which the forward pass
hands over before any layer runs (``hint``).  With ``DispatchConfig.early_hash`` each such layer
after the first MoE layer has its holders sent a warm-up call (rows of zeros, one per top_k
experts) for exactly those experts a layer early, just behind the previous MoE layer's requests:
a holder that pages its experts in under a memory budget reads them in the round trip it would
otherwise idle through; the layer's own call then goes to the same holders.  The warm-up is an
ordinary (paid, receipted) call whose outputs are discarded: no protocol change.  The pass's
first MoE layer is not warmed: its warm-up would reach the holder only an attention ahead of the
call and be computed in front of it (measured: +9 ms on that layer).  Off by default: on holders
that keep their experts resident it only adds their compute (benchmarks/hash_dispatch.py).

Receipts are settled off the token path (``settle_receipts``, between steps). On a v1.3
connection the answers come without receipts and the server signs them in batches: each
batch's receipts are checked against the calls they name, its statement is countersigned once,
and every call's ``BatchedReceipt`` goes to the ledger sink.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .._tasks import cancel_and_wait
from ..errors import BadResponse, ConfigError, NetworkError, ProtocolError, SwarmError
from ..model import ExpertWeights, ModelConfig, Weights, expert_ffn
from ..model.experts import F32Cache
from ..net.client import Connections, ExpertClient
from ..net.routing_table import Holder, SwarmTable, plan_dispatch
from .onloop import on_loop_greenlet, wait_on
from ..protocol import (
    SUPPORTED_VERSIONS,
    BatchedReceipt,
    CountersignedReceipt,
    ErrorCode,
    ExpertRequest,
    ExpertResponse,
    ExpertRows,
    Identity,
    ReceiptBatch,
    check_receipt,
    check_response,
    countersign,
    countersign_batch,
)

if TYPE_CHECKING:
    from .tiers import TierPlanner
    from .verify import Verifier

log = logging.getLogger(__name__)


class MissingExperts(SwarmError):
    """No replica (and no local fallback) could compute these experts."""

    def __init__(self, layer: int, experts: list[int], reasons: list[str]) -> None:
        self.layer, self.experts = layer, experts
        why = "; ".join(reasons[-3:]) or "no holder announced them"
        super().__init__(f"layer {layer}: experts {experts} unavailable in the swarm ({why})")


@dataclass(frozen=True)
class DispatchConfig:
    timeout_s: float = 10.0  # per expert call
    attempts: int = 3  # holders tried per expert before falling back or failing
    wire_dtype: str = "float32"  # hidden states on the wire: float32 (exact) or float16
    settle_idle_s: float = 0.05  # settle receipts after this long without a forward pass
    max_unsettled: int = 4096  # ... or as soon as this many are waiting
    versions: tuple[int, ...] = SUPPORTED_VERSIONS  # protocol versions offered ((1,): receipts in every answer)
    max_awaiting: int = 16384  # v1.3: calls kept waiting for their receipt batch (the oldest are dropped)
    early_hash: bool = False  # warm hash-routed layers' holders a layer early (see the module docstring)
    warm_after_s: float = 0.002  # ... a warm-up leaving at least this long after the previous layer's requests


ReceiptSink = Callable[[CountersignedReceipt | BatchedReceipt], None]
AuditHook = Callable[[ExpertRequest, np.ndarray, CountersignedReceipt | BatchedReceipt], None]
"""Offered every countersigned call: the request, the outputs as received (P, H), the receipt."""


@dataclass
class _Sent:
    """A call ``RemoteExperts._send_now`` wrote: what ``_call`` needs to finish it."""

    experts: list[int]
    request: ExpertRequest
    token_sets: list[np.ndarray]  # each expert's tokens ...
    slot_sets: list[np.ndarray]  # ... and the slot of ids it fills for each
    client: ExpertClient
    future: asyncio.Future | None  # type: ignore[type-arg]  # the answer (ExpertClient.send_now; None: not written yet)
    t0: float  # perf_counter when it was written


class _Handle:
    def __init__(self, future: Future[np.ndarray]) -> None:
        self._future = future

    def result(self) -> np.ndarray:
        return self._future.result()


class _LoopHandle:
    def __init__(self, task: asyncio.Task[np.ndarray]) -> None:
        self._task = task

    def result(self) -> np.ndarray:
        return self._task.result() if self._task.done() else wait_on(self._task)


class RemoteExperts:
    """``ExpertExecutor`` over the swarm (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, identity: Identity, table: SwarmTable, loop: asyncio.AbstractEventLoop,
                 *, config: DispatchConfig = DispatchConfig(), local: Weights | None = None,
                 receipts: ReceiptSink | None = None, audit: AuditHook | None = None,
                 tiers: "TierPlanner | None" = None) -> None:
        self.cfg = cfg
        self.identity = identity
        self.table = table
        self.loop = loop
        self.config = config
        self.local = local  # memory-mapped checkpoint for --local-fallback, or None
        self.receipts = receipts
        self.audit = audit  # e.g. moeswarm.ledger.AuditRunner.offer: must not block
        self.tiers = tiers  # acting tier planner: experts it places here are computed here
        self.verifier: "Verifier | None" = None  # checks a sample of responses and chooses holders (verify.py)
        self._f32 = F32Cache(256 << 20)
        self.local_pairs = 0  # (token, expert) pairs computed here on the planner's word
        self.connections = Connections(identity, versions=config.versions, on_batch=self._batch_arrived)
        self._seq = itertools.count(int(time.time() * 1000) * 1000)  # never reused across restarts
        self.served_by: dict[bytes, set[tuple[int, int]]] = {}  # peer -> (layer, expert) it computed
        self.calls = 0
        self.fallbacks = 0
        self.bad_receipts = 0
        self._unchecked: deque[tuple[ExpertRequest, ExpertResponse, bytes]] = deque()
        self._awaiting: dict[tuple[bytes, bytes], tuple[ExpertRequest, ExpertResponse]] = {}  # (peer, request id)
        self._batches: deque[tuple[bytes, ReceiptBatch]] = deque()
        self.batches_settled = 0
        self._idle_timer: asyncio.TimerHandle | None = None
        self._ahead: dict[int, np.ndarray] = {}  # hash-routed layers of this pass not warmed yet -> ids (T, k)
        self._warmed: dict[int, dict[bytes, list[int]]] = {}  # layer -> the plan its warm-up calls used
        self._warming: set[asyncio.Task[None]] = set()
        self._checking: set[tuple[bytes, bytes]] = set()  # (peer, request id) of calls the verifier is checking
        self.warmups = 0  # warm-up calls answered

    def submit(self, layer: int, x: np.ndarray, ids: np.ndarray, weights: np.ndarray) -> _Handle | _LoopHandle:
        """Start one MoE layer's dispatch. From a forward pass run on the loop by ``onloop.run_on_loop``
        no thread is involved: the requests are sent (the forward yields to the loop until they
        are) and ``result`` waits on the loop. From a worker thread: two thread hops."""
        if on_loop_greenlet() and _on_loop(self.loop):
            sent = self._send_now(layer, x, ids)  # the requests leave now, as this code runs
            task = self.loop.create_task(self.dispatch(layer, x, ids, weights, sent))
            for _ in range(0 if sent is not None else 2):  # else the dispatch starts, then its calls write
                if task.done():
                    break
                wait_on(asyncio.sleep(0))
            return _LoopHandle(task)
        if _on_loop(self.loop):
            raise ConfigError("run the model's forward pass in a worker thread or with onloop.run_on_loop, "
                              "not directly on the event loop")
        return _Handle(asyncio.run_coroutine_threadsafe(self.dispatch(layer, x, ids, weights), self.loop))

    def _send_now(self, layer: int, x: np.ndarray, ids: np.ndarray) -> dict[bytes, _Sent] | None:
        """On the loop, from a forward pass (``submit``): plan the layer's calls and write their
        requests at once, where every holder planned has an open connection (the usual case while
        decoding); else ``None`` and the dispatch task plans and sends them itself. Not with tiers
        or early warm-ups (their plans are made inside the dispatch)."""
        if self.tiers is not None or self._ahead or self._warmed:
            return None
        experts = _experts_of(ids)
        plan, unheld = (self.verifier.plan(layer, experts, set()) if self.verifier is not None
                        else plan_dispatch(layer, experts, self.table.live()))
        clients = {peer: self.connections.open_client(peer) for peer in plan}
        if unheld or not plan or any(c is None for c in clients.values()):
            return None
        sent: dict[bytes, _Sent] = {}
        for peer, held in plan.items():
            token_sets, slot_sets, request = self._request(layer, x, ids, held)
            client = clients[peer]
            assert client is not None
            try:
                future = client.send_now(request)
            except (NetworkError, ConfigError) as e:  # the dispatch retries it like any failed call
                future = self.loop.create_future()
                future.set_exception(e if isinstance(e, NetworkError) else NetworkError(str(e)))
            self.table.holders[peer].in_flight += 1
            sent[peer] = _Sent(held, request, token_sets, slot_sets, client, future, time.perf_counter())
        return sent

    def hint(self, routes: dict[int, np.ndarray]) -> None:
        """Before a forward pass: the experts (T, k) of its hash-routed layers, from the token ids
        (``Model._announce_hashed``).  With ``early_hash`` each is warmed after the MoE layer before it."""
        ahead = dict(sorted(routes.items())) if self.config.early_hash else {}
        if not ahead and not self._ahead:
            return
        if _on_loop(self.loop):
            self._ahead = ahead
        else:  # before this pass's first dispatch reaches the loop
            self.loop.call_soon_threadsafe(setattr, self, "_ahead", ahead)

    def _warm_next(self, layer: int) -> None:
        """On the loop, once ``layer``'s calls are under way: warm the first hash-routed layer after it."""
        later = [L for L in self._ahead if L > layer]
        for L in [L for L in self._ahead if L <= layer]:
            del self._ahead[L]
        if later:
            self._start_warmup(later[0], self._ahead.pop(later[0]))

    def _start_warmup(self, layer: int, ids: np.ndarray) -> None:
        """On the loop: warm-up calls (zeros) for the layer's experts to the holders its dispatch will
        use (planned now, before that dispatch can start), so that they read (page in) the weights
        before the layer's hidden states arrive."""
        experts = sorted({int(e) for e in np.unique(ids)})
        if self.tiers is not None:
            experts = [e for e in experts if not self._here(layer, e)]
        plan, _ = (self.verifier.plan(layer, experts, set()) if self.verifier is not None
                   else plan_dispatch(layer, experts, self.table.live()))
        self._warmed[layer] = plan
        for peer, held in plan.items():
            task = self.loop.create_task(self._warm_call(peer, layer, held, self._warm_delay(peer)))
            self._warming.add(task)
            task.add_done_callback(self._warming.discard)

    def _warm_delay(self, peer: bytes) -> float:
        """How long after the previous layer's requests (whose call tasks were created first) a warm-up
        leaves: long enough to reach the holder once it has answered that layer's call (it takes
        everything queued as one batch, and paging in during that answer delayed it: +5 ms on layer 0
        measured at 2 ms), at most half its round trip, so that it still arrives well before the
        layer's own call (which leaves at least a round trip after the previous layer's)."""
        holder = self.table.holders.get(peer)
        service = holder.service_s if holder is not None and holder.service_s is not None else 0.0
        rtt = holder.rtt_s if holder is not None and holder.rtt_s is not None else 0.0
        return max(self.config.warm_after_s, min(2 * service + self.config.warm_after_s, rtt / 2))

    async def _warm_call(self, peer: bytes, layer: int, experts: list[int], delay: float) -> None:
        if delay:
            await asyncio.sleep(delay)
        k = self.cfg.top_k  # a holder takes at most top_k (expert, row) pairs per row
        request = ExpertRequest(
            request_id=os.urandom(16), model_id=self.table.model_id, layer=layer, seq=next(self._seq),
            hidden=np.zeros((-(-len(experts) // k), self.cfg.hidden_size), self.config.wire_dtype),
            experts=tuple(ExpertRows(e, np.array([i // k], np.uint32)) for i, e in enumerate(experts)))
        try:
            response = await self._call_once_or_reconnect(self.table.holders[peer], request)
        except (SwarmError, OSError) as e:  # only a warm-up: the layer's own call retries as always
            log.debug("warm-up of layer %d at %s failed: %s", layer, peer.hex()[-12:], e)
            return
        self.warmups += 1
        self._unchecked.append((request, response, peer))  # a call like any other: its receipt is settled

    async def dispatch(self, layer: int, x: np.ndarray, ids: np.ndarray, weights: np.ndarray,
                       sent: dict[bytes, _Sent] | None = None) -> np.ndarray:
        """x (T, H), ids (T, k), weights (T, k) -> (T, H); ``sent``: the calls ``_send_now`` made."""
        T, k = ids.shape
        y = np.zeros((T, k, x.shape[1]), np.float32)  # each (token, slot) expert output
        pending = _experts_of(ids)
        here: asyncio.Future[list[int]] | None = None
        reasons: list[str] = []
        if self.tiers is not None:  # the planner's local/fetched experts: computed here meanwhile
            mine = [e for e in pending if self._here(layer, e)]
            if mine:
                pending = [e for e in pending if e not in mine]
                here = asyncio.ensure_future(self._compute_here(layer, x, ids, mine, y, reasons))
        try:
            pending = await self._call_holders(layer, x, ids, pending, y, reasons, sent)
        except BaseException:
            if here is not None:
                here.cancel()
            raise
        if here is not None:
            refused = await here  # weights that could not be had: the holders compute those instead
            if refused:
                pending += await self._call_holders(layer, x, ids, refused, y, reasons)
        if pending:
            if self.local is None or any(e not in self.local.experts.get(layer, {}) for e in pending):
                raise MissingExperts(layer, pending, reasons)
            await asyncio.to_thread(self._compute_locally, layer, x, ids, pending, y)
            self.fallbacks += 1
        return (weights[:, :, None] * y).sum(axis=1, dtype=np.float32) if k > 1 else weights * y[:, 0]

    async def _call_holders(self, layer: int, x: np.ndarray, ids: np.ndarray, pending: list[int], y: np.ndarray,
                            reasons: list[str], sent: dict[bytes, _Sent] | None = None) -> list[int]:
        """Call holders for ``pending`` experts (the first attempt's calls already ``sent``, if
        given), retrying failures on other replicas; returns the experts nobody computed."""
        tried: dict[int, set[bytes]] = {e: set() for e in pending}
        warmed = self._warmed.pop(layer, None)  # the holders warmed for this layer, if it was
        for _ in range(self.config.attempts):
            if not pending:
                break
            exclude = set().union(*(tried[e] for e in pending))
            if sent is not None:
                plan, unheld = {peer: call.experts for peer, call in sent.items()}, []
            elif warmed is not None and self._still_fits(warmed, pending, exclude):
                plan, unheld = warmed, []
            else:
                plan, unheld = (self.verifier.plan(layer, pending, exclude) if self.verifier is not None
                                else plan_dispatch(layer, pending, self.table.live(), exclude=exclude))
            warmed = None
            calls = [asyncio.ensure_future(self._call(peer, layer, x, ids, experts, y, sent and sent[peer]))
                     for peer, experts in plan.items()]
            sent = None
            self._warm_next(layer)  # the next hash-routed layer, behind these requests
            results = await asyncio.gather(*calls, return_exceptions=True)
            failed = list(unheld)
            for (peer, experts), result in zip(plan.items(), results):
                if isinstance(result, BaseException):
                    if not isinstance(result, (SwarmError, OSError)):
                        raise result
                    reasons.append(f"{type(result).__name__}: {result}")
                    for e in experts:
                        tried[e].add(peer)
                    failed.extend(experts)
            pending = sorted(failed)
            if unheld and len(unheld) == len(pending):
                break  # nobody else to ask
        return pending

    def _still_fits(self, plan: dict[bytes, list[int]], pending: list[int], exclude: set[bytes]) -> bool:
        """A warm-up's plan serves the layer's call if it covers exactly ``pending`` with live holders."""
        live = {h.peer_id for h in self.table.live()}
        return (sorted(e for held in plan.values() for e in held) == pending
                and all(peer in live and peer not in exclude for peer in plan))

    def _here(self, layer: int, expert: int) -> bool:
        assert self.tiers is not None
        tier = self.tiers.tier_of(layer, expert)
        return tier == "fetch" or (tier == "local" and self.tiers.weights(layer, expert) is not None)

    async def _compute_here(self, layer: int, x: np.ndarray, ids: np.ndarray, experts: list[int],
                            y: np.ndarray, reasons: list[str]) -> list[int]:
        """Experts the planner placed here (ones to fetch on a miss are fetched first); returns
        those whose weights could not be had, for the holders to compute instead."""
        assert self.tiers is not None
        tiers = self.tiers
        got = await asyncio.gather(*(
            _ready(tiers.weights(layer, e)) if tiers.tier_of(layer, e) != "fetch" else tiers.ensure(layer, e)
            for e in experts), return_exceptions=True)
        weights, failed = {}, []
        for e, w in zip(experts, got):
            if isinstance(w, (SwarmError, OSError)) or w is None:
                reasons.append(f"expert {e} here: {type(w).__name__}: {w}")
                failed.append(e)
            elif isinstance(w, BaseException):
                raise w
            else:
                weights[e] = w
        ok = [e for e in experts if e in weights]
        if ok:
            await asyncio.to_thread(self._compute_locally, layer, x, ids, ok, y, lambda L, e: weights[e])
            self.local_pairs += int(np.isin(ids, ok).sum())
        return failed

    def _request(self, layer: int, x: np.ndarray, ids: np.ndarray, experts: list[int]
                 ) -> tuple[list[np.ndarray], list[np.ndarray], ExpertRequest]:
        """One holder's request for ``experts``, and where their outputs go (tokens, slots of ``ids``)."""
        token_sets, slot_sets, hidden, rows = _routes(x, ids, experts)
        request = ExpertRequest(
            request_id=os.urandom(16), model_id=self.table.model_id, layer=layer, seq=next(self._seq),
            hidden=hidden.astype(self.config.wire_dtype),  # a copy: the receipt's input hash is checked later
            experts=tuple(ExpertRows(e, r) for e, r in zip(experts, rows)),
        )
        return token_sets, slot_sets, request

    async def _call(self, peer: bytes, layer: int, x: np.ndarray, ids: np.ndarray, experts: list[int],
                    y: np.ndarray, sent: _Sent | None = None) -> None:
        holder = self.table.holders[peer]
        if sent is None:
            token_sets, slot_sets, request = self._request(layer, x, ids, experts)
            t0 = time.perf_counter()
            holder.in_flight += 1  # the queue term of its expected latency (Holder.score)
        else:  # written by _send_now, which counted it in flight
            token_sets, slot_sets, request, t0 = sent.token_sets, sent.slot_sets, sent.request, sent.t0
        try:
            response: ExpertResponse = await (self._call_once_or_reconnect(holder, request) if sent is None
                                              else self._answer_sent(holder, sent))
            if response.outputs.shape != (request.pairs, x.shape[1]):
                raise BadResponse(f"outputs have shape {list(response.outputs.shape)}, expected "
                                  f"[{request.pairs}, {x.shape[1]}]", code=ErrorCode.BAD_TENSOR)
        except (NetworkError, ProtocolError) as e:
            if isinstance(e, ProtocolError) and e.code == ErrorCode.NON_FINITE and not isinstance(e, BadResponse):
                raise  # our hidden states overflowed its experts: not the holder's fault, the connection is fine
            holder.fail(time.monotonic())
            if not (isinstance(e, ProtocolError) and e.code == ErrorCode.OVERLOADED):
                await self.connections.drop(peer)
            raise
        finally:
            holder.in_flight -= 1
        compute_s = response.compute_us / 1e6
        holder.observe(max(0.0, time.perf_counter() - t0 - compute_s), response.load_permille, compute_s)
        outputs = response.outputs.astype(np.float32, copy=False)
        honest = True
        if self.verifier is not None:  # a sample is checked before its outputs are used
            self._checking.add((peer, request.request_id))  # its receipt batch waits for the verdict
            try:
                outputs, honest = await self.verifier.check(peer, request, response, outputs)
            finally:
                self._checking.discard((peer, request.request_id))
        self.calls += 1
        offset = 0
        for tokens, slots in zip(token_sets, slot_sets):
            y[tokens, slots] = outputs[offset : offset + tokens.size]
            offset += tokens.size
        if honest:
            self.served_by.setdefault(peer, set()).update((layer, e) for e in experts)
            self._unchecked.append((request, response, peer))  # receipts: checked off the token path

    async def call_holder(self, peer: bytes, request: ExpertRequest, settle: bool = True
                          ) -> tuple[ExpertRequest, ExpertResponse]:
        """``request`` (with a new id and seq) to one holder, for checks: returns it and the response
        whose receipt was checked; with ``settle`` the receipt is countersigned like any other."""
        sent = dataclasses.replace(request, request_id=os.urandom(16), seq=next(self._seq), signed=True)
        response = await self._call_once_or_reconnect(self.table.holders[peer], sent)
        check_response(sent, response, client=self.identity.peer_id, server=peer)
        if settle:
            self._unchecked.append((sent, response, peer))
        return sent, response

    def settle_receipts(self) -> int:
        """Check, countersign and hand over the receipts of finished calls; returns how many were bad.

        Receipts cost two hashes and two signature operations each, so they are settled between
        tokens (``Model.forward`` calls this once per step via ``after_step``), not per layer."""
        bad = 0
        while self._unchecked:
            request, response, peer = self._unchecked.popleft()
            if response.receipt is None:  # v1.3: its receipt comes in a batch
                self._awaiting[(peer, request.request_id)] = (request, response)
                if len(self._awaiting) > self.config.max_awaiting:
                    del self._awaiting[next(iter(self._awaiting))]
                continue
            try:
                receipt = check_response(request, response, client=self.identity.peer_id, server=peer)
            except BadResponse as e:
                bad += 1
                self.bad_receipts += 1
                log.warning("refusing a receipt from %s: %s", peer.hex()[-12:], e)
                self.table.holders[peer].fail(time.monotonic()) if peer in self.table.holders else None
                continue
            countersigned = countersign(self.identity, receipt)
            if self.receipts is not None:
                self.receipts(countersigned)
            if self.audit is not None:
                self.audit(request, response.outputs, countersigned)
        while self._batches:
            peer, batch = self._batches[0]
            if any((peer, r.request_id) in self._checking for r in batch.receipts):
                self._settle_when_idle()  # a call it names is still being checked: settled after that
                break
            bad += self._settle_batch(*self._batches.popleft())
        return bad

    def _batch_arrived(self, peer: bytes, batch: ReceiptBatch) -> None:
        self._batches.append((peer, batch))
        self._settle_when_idle()

    def _settle_batch(self, peer: bytes, batch: ReceiptBatch) -> int:
        """Check every receipt of a batch against the call it names, then the batch's root and
        signature; countersign it once and hand each call's ``BatchedReceipt`` over. Returns how
        many receipts were refused (all of a batch that fails any check: its statement covers all)."""
        calls: list[tuple[ExpertRequest, ExpertResponse]] = []
        problem = ""
        for r in batch.receipts:
            held = self._awaiting.pop((peer, r.request_id), None)
            if held is None:
                problem = f"it names request {r.request_id.hex()}, not a call of ours awaiting a receipt"
                break
            try:
                check_receipt(held[0], held[1].outputs, r, client=self.identity.peer_id, server=peer)
            except BadResponse as e:
                problem = str(e)
                break
            calls.append(held)
        records: list[BatchedReceipt] = []
        if not problem:
            try:
                records = countersign_batch(self.identity, batch)
            except BadResponse as e:
                problem = str(e)
        if problem:
            self.bad_receipts += len(batch.receipts)
            log.warning("refusing a batch of %d receipts from %s: %s", len(batch.receipts), peer.hex()[-12:], problem)
            if peer in self.table.holders:
                self.table.holders[peer].fail(time.monotonic())
            return len(batch.receipts)
        self.batches_settled += 1
        for (request, response), record in zip(calls, records):
            if self.receipts is not None:
                self.receipts(record)
            if self.audit is not None:
                self.audit(request, response.outputs, record)
        return 0

    async def _call_once_or_reconnect(self, holder: Holder, request: ExpertRequest) -> ExpertResponse:
        """A connection that was already open may have died since its last use (a relay restarted,
        a NAT forgot us): then dial once more before counting the holder as failed."""
        reused = self.connections.is_open(holder.peer_id)
        client = await self.connections.get(holder, self.config.timeout_s)
        try:
            response = await client.call(request, self.config.timeout_s)
        except NetworkError:
            if not reused:
                raise
            await self.connections.drop(holder.peer_id)
            client = await self.connections.get(holder, self.config.timeout_s)
            response = await client.call(request, self.config.timeout_s)
        return _with_receipt_if_due(client, request, response)

    async def _answer_sent(self, holder: Holder, sent: _Sent) -> ExpertResponse:
        """The answer to a request ``_send_now`` wrote; if its connection failed, it is sent once
        more on a new one (as ``_call_once_or_reconnect`` does for a connection in use)."""
        client = sent.client
        try:
            response = await (client.answer(sent.request, sent.future, self.config.timeout_s) if sent.future is not None
                              else client.call(sent.request, self.config.timeout_s))  # its write had to wait
        except NetworkError:
            await self.connections.drop(holder.peer_id)
            client = await self.connections.get(holder, self.config.timeout_s)
            response = await client.call(sent.request, self.config.timeout_s)
        return _with_receipt_if_due(client, sent.request, response)

    def _compute_locally(self, layer: int, x: np.ndarray, ids: np.ndarray, experts: list[int], y: np.ndarray,
                         source: Callable[[int, int], ExpertWeights | None] | None = None) -> None:
        """Thread: experts from ``source`` (default: the local map), float32 copies kept for reuse."""
        for e in experts:
            w = source(layer, e) if source is not None else None
            if w is None:
                assert self.local is not None
                w = self.local.experts[layer][e]
            tokens = np.nonzero((ids == e).any(axis=1))[0]
            slots = np.argmax(ids[tokens] == e, axis=1)
            w32 = w if w.gate.dtype == np.float32 else self._f32.get((layer, e), w)
            y[tokens, slots] = expert_ffn(w32, x[tokens], self.cfg)

    def end_step(self) -> None:
        """After each forward pass: settle receipts once decoding pauses (checking and signing
        them costs ~0.2 ms each, which would otherwise sit on the next step's path), or at once
        when too many are pending."""
        schedule = self.loop.call_soon if _on_loop(self.loop) else self.loop.call_soon_threadsafe
        if len(self._unchecked) >= self.config.max_unsettled:
            schedule(self.settle_receipts)
        else:
            schedule(self._settle_when_idle)

    def _settle_when_idle(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        self._idle_timer = self.loop.call_later(self.config.settle_idle_s, self.settle_receipts)

    async def flush_receipts(self, timeout: float = 2.0) -> None:
        """v1.3: ask every server for the receipts it has not batched yet (a ping: it sends them
        before its pong), then settle them."""
        for client in self.connections.open_clients():
            if client.version >= 2:
                with contextlib.suppress(NetworkError, ProtocolError):
                    await client.ping(timeout)
        self.settle_receipts()

    async def aclose(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        for task in list(self._warming):
            await cancel_and_wait(task)
        self.settle_receipts()
        await self.flush_receipts()
        await self.connections.aclose()


def _with_receipt_if_due(client: ExpertClient, request: ExpertRequest, response: ExpertResponse) -> ExpertResponse:
    if response.receipt is None and (client.version < 2 or request.signed):
        raise BadResponse("the answer carries no receipt (it must: v1.2 connection, or asked for)")
    return response


def _experts_of(ids: np.ndarray) -> list[int]:
    """The distinct experts of ``ids (T, k)``, ascending."""
    return sorted(set(ids.ravel().tolist())) if ids.size <= 4096 else np.unique(ids).tolist()


_ROW0 = np.zeros(1, np.intp)
_ROW0.setflags(write=False)
_ROW0_U32 = np.zeros(1, np.uint32)
_ROW0_U32.setflags(write=False)


def _routes(x: np.ndarray, ids: np.ndarray, experts: list[int]
            ) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray, list[np.ndarray]]:
    """For one holder's ``experts`` of a layer routed by ``ids (T, k)``: each expert's tokens
    (ascending) and the slot of ``ids`` it fills for each, the rows of ``x (T, H)`` the holder
    needs, and each expert's rows among those (uint32, as ``ExpertRows`` takes them)."""
    if ids.shape[0] == 1:  # a decode step: one token, no index arithmetic
        row = ids[0].tolist()
        return [_ROW0] * len(experts), [np.array([row.index(e)]) for e in experts], x, [_ROW0_U32] * len(experts)
    token_sets = [np.nonzero((ids == e).any(axis=1))[0] for e in experts]
    slot_sets = [np.argmax(ids[t] == e, axis=1) for e, t in zip(experts, token_sets)]
    rows_used = np.unique(np.concatenate(token_sets))
    local_index = np.full(ids.shape[0], -1, np.int64)
    local_index[rows_used] = np.arange(rows_used.size)
    return token_sets, slot_sets, x[rows_used], [local_index[t].astype(np.uint32) for t in token_sets]


async def _ready(value: ExpertWeights | None) -> ExpertWeights | None:
    return value


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    with contextlib.suppress(RuntimeError):
        return asyncio.get_running_loop() is loop
    return False
