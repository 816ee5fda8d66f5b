"""Weight fetching: copy an expert's weights from a holder into this process's memory.

The third tier of the planner (``moeswarm.node.planner``): instead of calling a holder for every
token, pull the expert once and compute it here.  The holder answers ``weights_request``s for
row ranges of one tensor (``serve_weights``); the fetcher asks for all of an expert's rows in
chunks that stay far below the frame limit, several in flight at once, and assembles them
(``fetch_expert``).  ``FetchedExperts`` keeps what was fetched, bounded in bytes, least recently
used out first.

Fetched weights are the holder's word, like its expert outputs: the audits that check outputs
(``moeswarm.ledger``) do not check weights.  Fetch from holders you would call.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import numpy as np

from ..errors import BadResponse, ProtocolError
from ..model import ExpertWeights, ModelConfig, Weights
from ..model.experts import ExpertLRU
from ..model.weights import expert_shapes
from ..protocol import WIRE_DTYPES, ErrorCode, WeightsRequest, WeightsResponse
from .dataplane import ExpertClient

CHUNK_BYTES = 4 << 20  # rows per weights_request: about this many bytes
PARALLEL_CHUNKS = 4  # weights_requests in flight per fetch


def serve_weights(weights: Weights, model_id: str, request: WeightsRequest) -> WeightsResponse:
    """The holder's side: rows ``[start, stop)`` of a tensor of an expert held in ``weights``.

    float32/float16/bfloat16 tensors travel as stored (bytes from the map); quantised ones
    (GGUF) are decoded, only the rows asked for, to float32."""
    if request.model_id != model_id:
        raise ProtocolError(f"model {request.model_id!r} is not served here", code=ErrorCode.UNKNOWN_EXPERT)
    expert = weights.experts.get(request.layer, {}).get(request.expert)
    if expert is None:
        raise ProtocolError(f"expert {request.expert} of layer {request.layer} is not held here",
                            code=ErrorCode.UNKNOWN_EXPERT)
    tensor = getattr(expert, request.tensor)
    if tensor is None:
        raise ProtocolError(f"this model's experts have no {request.tensor}", code=ErrorCode.BAD_FIELD)
    if request.stop > tensor.shape[0]:
        raise ProtocolError(f"{request.tensor} has {tensor.shape[0]} rows, asked for [{request.start}, "
                            f"{request.stop})", code=ErrorCode.BAD_FIELD)
    if isinstance(tensor, np.ndarray) and tensor.dtype in WIRE_DTYPES.values():
        rows = np.ascontiguousarray(tensor[request.start:request.stop])
    else:  # quantised: decode just these rows
        rows = np.asarray(tensor[np.arange(request.start, request.stop)], dtype=np.float32)
    return WeightsResponse(request.request_id, rows)


def _chunks(shape: tuple[int, ...], itemsize: int) -> Iterator[tuple[int, int]]:
    row_bytes = itemsize * int(np.prod(shape[1:], dtype=np.int64))
    step = max(1, CHUNK_BYTES // max(row_bytes, 1))
    for start in range(0, shape[0], step):
        yield start, min(shape[0], start + step)


async def fetch_expert(client: ExpertClient, cfg: ModelConfig, model_id: str, layer: int, expert: int,
                       timeout: float = 60.0) -> ExpertWeights:
    """All tensors of one expert from ``client``'s server, checked against ``cfg``'s shapes.

    Raises ``BadResponse`` if the holder sends rows of the wrong shape, or different dtypes for
    the chunks of one tensor; network and protocol errors as ``ExpertClient`` raises them."""
    shapes = expert_shapes(cfg)
    jobs = [(name, start, stop) for name, shape in shapes.items() for start, stop in _chunks(shape, 2)]
    parts: dict[tuple[str, int], np.ndarray] = {}
    gate = asyncio.Semaphore(PARALLEL_CHUNKS)

    async def one(name: str, start: int, stop: int) -> None:
        async with gate:
            request = WeightsRequest(os.urandom(16), model_id, layer, expert, name, start, stop)
            response = await client.fetch(request, timeout)
        want = (stop - start, *shapes[name][1:])
        if response.data.shape != want:
            raise BadResponse(f"{name}[{start}:{stop}] of expert ({layer}, {expert}) came as "
                              f"{list(response.data.shape)}, expected {list(want)}", code=ErrorCode.BAD_TENSOR)
        parts[(name, start)] = response.data

    await asyncio.gather(*(one(*job) for job in jobs))
    arrays: dict[str, np.ndarray] = {}
    for name in shapes:
        pieces = [parts[(n, s)] for n, s, _ in jobs if n == name]
        if len({p.dtype for p in pieces}) != 1:
            raise BadResponse(f"the chunks of {name} came in different dtypes", code=ErrorCode.BAD_TENSOR)
        arrays[name] = np.concatenate(pieces) if len(pieces) > 1 else np.array(pieces[0])
    return ExpertWeights(**arrays)


class FetchedExperts(ExpertLRU):
    """Experts fetched from holders, bounded in bytes; the least recently used leaves first."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(max_bytes)
        self.fetched_bytes = 0  # total ever fetched (a metric)

    def put(self, key: tuple[int, int], w: ExpertWeights) -> bool:
        self.fetched_bytes += w.nbytes
        return super().put(key, w)


__all__ = ["FetchedExperts", "fetch_expert", "serve_weights"]
