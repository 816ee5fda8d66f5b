"""Weight fetching: copy an expert's weights from a holder into this process's memory.

The third tier of the planner (``moeswarm.node.planner``): instead of calling a holder for every
token, pull the expert once and compute it here.  The holder answers ``weights_request``s for
row ranges of one tensor (``serve_weights``); the fetcher asks for all of an expert's rows in
chunks that stay far below the frame limit, several in flight at once, and assembles them
(``fetch_expert``).  ``FetchedExperts`` keeps what was fetched, bounded in bytes, least recently
used out first.  A checkpoint quantised as published (FP8, MXFP4, INT4: ``moeswarm.model._stored``)
travels as stored, codes and scales (``wire_layout``), and stays so in that cache.

A holder could send any numbers, and the audits (``moeswarm.ledger``) check outputs, not
weights.  So the model's publisher writes ``expert_digests.json`` beside the checkpoint
(``moeswarm expert-digests``): one SHA-256 per expert over exactly what a holder sends.  A
backbone whose model folder has that file checks every fetched expert against it and refuses
one that differs (nothing is fetched from that holder again, and the expert is called instead);
without it, fetched weights are the holder's word, and the backbone says so once.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import BadResponse, ConfigError, ProtocolError
from ..model import ExpertWeights, ModelConfig, Weights
from ..model._stored import StoredTensor
from ..model.experts import ExpertLRU
from ..model.weights import expert_shapes
from ..net.client import ExpertClient
from ..protocol import DEFAULT_MAX_FRAME, WIRE_DTYPES, ErrorCode, WeightsRequest, WeightsResponse

CHUNK_BYTES = 4 << 20  # rows per weights_request: about this many bytes
PARALLEL_CHUNKS = 4  # weights_requests in flight per fetch


def wire_layout(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """What a holder sends of one expert: wire tensor name -> (shape, kind), kind ``"float"``
    (f32/f16/bf16) or ``"bytes"`` (u8).  A model whose config.json has a ``quantization_config``
    sends each matrix as stored: its codes under ``gate``/``up``/``down`` and its scales under
    ``gate_scale``... (see ``moeswarm.model._stored``); biases and other models' tensors as floats."""
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, shape in expert_shapes(cfg).items():
        if cfg.quant is not None and len(shape) == 2:
            codes, scale = cfg.quant.part_shapes(*shape)
            out[name] = (codes, "bytes")
            out[name + "_scale"] = (scale, "bytes" if cfg.quant.scale_bytes == 1 else "float")
        else:
            out[name] = (shape, "float")
    return out


def held_parts(w: ExpertWeights, cfg: ModelConfig) -> dict[str, Any]:
    """An expert held here by wire tensor name: a stored matrix's codes and scales, else the tensor."""
    out: dict[str, Any] = {}
    for name in expert_shapes(cfg):
        t = getattr(w, name)
        if isinstance(t, StoredTensor):
            out[name], out[name + "_scale"] = t.codes, t.scale
        else:
            out[name] = t
    return out


WEIGHTS_OVERHEAD = 1024  # bytes of a weights_response besides its rows


def serve_weights(weights: Weights, model_id: str, request: WeightsRequest,
                  max_bytes: int = DEFAULT_MAX_FRAME) -> WeightsResponse:
    """The holder's side: rows ``[start, stop)`` of a tensor of an expert held in ``weights``.

    float32/float16/bfloat16 tensors travel as stored (bytes from the map), and so do quantised
    checkpoints' codes and scales (``wire_layout``); GGUF-quantised ones are decoded, only the
    rows asked for, to float32."""
    if request.model_id != model_id:
        raise ProtocolError(f"model {request.model_id!r} is not served here", code=ErrorCode.UNKNOWN_EXPERT)
    expert = weights.experts.get(request.layer, {}).get(request.expert)
    if expert is None:
        raise ProtocolError(f"expert {request.expert} of layer {request.layer} is not held here",
                            code=ErrorCode.UNKNOWN_EXPERT)
    tensor = held_parts(expert, weights.config).get(request.tensor)
    if tensor is None:
        raise ProtocolError(f"this model's experts have no {request.tensor}", code=ErrorCode.BAD_FIELD)
    if request.stop > tensor.shape[0]:
        raise ProtocolError(f"{request.tensor} has {tensor.shape[0]} rows, asked for [{request.start}, "
                            f"{request.stop})", code=ErrorCode.BAD_FIELD)
    # checked before anything is read or decoded: rows that would not fit one frame are refused,
    # so a quantised tensor is only ever decoded one frame-sized chunk at a time
    stored = isinstance(tensor, np.ndarray) and (tensor.dtype in WIRE_DTYPES.values() or tensor.dtype == np.uint8)
    row_bytes = (tensor.dtype.itemsize if stored else 4) * int(np.prod(tensor.shape[1:], dtype=np.int64))
    if (request.stop - request.start) * row_bytes + WEIGHTS_OVERHEAD > max_bytes:
        raise ProtocolError(f"rows [{request.start}, {request.stop}) of {request.tensor} would not fit a frame of "
                            f"{max_bytes} bytes: ask for at most {max(1, (max_bytes - WEIGHTS_OVERHEAD) // row_bytes)} "
                            "rows at a time", code=ErrorCode.BAD_FIELD)
    return WeightsResponse(request.request_id, wire_rows(tensor, request.start, request.stop))


def wire_rows(tensor: np.ndarray, start: int, stop: int) -> np.ndarray:
    """Rows ``[start, stop)`` of a held expert tensor as they travel: float32/float16/bfloat16 and
    stored bytes (uint8) as they are (bytes from the map); GGUF-quantised ones decoded, only these
    rows, to float32."""
    if isinstance(tensor, np.ndarray) and (tensor.dtype in WIRE_DTYPES.values() or tensor.dtype == np.uint8):
        return np.ascontiguousarray(tensor[start:stop])
    return np.asarray(tensor[np.arange(start, stop)], dtype=np.float32)


def _chunks(shape: tuple[int, ...], itemsize: int) -> Iterator[tuple[int, int]]:
    row_bytes = itemsize * int(np.prod(shape[1:], dtype=np.int64))
    step = max(1, CHUNK_BYTES // max(row_bytes, 1))
    for start in range(0, shape[0], step):
        yield start, min(shape[0], start + step)


async def fetch_expert(client: ExpertClient, cfg: ModelConfig, model_id: str, layer: int, expert: int,
                       timeout: float = 60.0) -> ExpertWeights:
    """All tensors of one expert from ``client``'s server, checked against ``cfg``'s shapes.

    Quantised checkpoints' experts arrive as stored (codes and scales) and stay so.  Raises
    ``BadResponse`` if the holder sends rows of the wrong shape or kind, or different dtypes for
    the chunks of one tensor; network and protocol errors as ``ExpertClient`` raises them."""
    layout = wire_layout(cfg)
    jobs = [(name, start, stop) for name, (shape, kind) in layout.items()
            for start, stop in _chunks(shape, 1 if kind == "bytes" else 2)]
    parts: dict[tuple[str, int], np.ndarray] = {}
    gate = asyncio.Semaphore(PARALLEL_CHUNKS)

    async def one(name: str, start: int, stop: int) -> None:
        async with gate:
            request = WeightsRequest(os.urandom(16), model_id, layer, expert, name, start, stop)
            response = await client.fetch(request, timeout)
        shape, kind = layout[name]
        want = (stop - start, *shape[1:])
        if response.data.shape != want:
            raise BadResponse(f"{name}[{start}:{stop}] of expert ({layer}, {expert}) came as "
                              f"{list(response.data.shape)}, expected {list(want)}", code=ErrorCode.BAD_TENSOR)
        if (response.data.dtype == np.uint8) != (kind == "bytes"):
            raise BadResponse(f"{name} of expert ({layer}, {expert}) came as {response.data.dtype}, expected "
                              f"{'stored bytes' if kind == 'bytes' else 'floats'}", code=ErrorCode.BAD_TENSOR)
        parts[(name, start)] = response.data

    await asyncio.gather(*(one(*job) for job in jobs))
    arrays: dict[str, np.ndarray] = {}
    for name in layout:
        pieces = [parts[(n, s)] for n, s, _ in jobs if n == name]
        if len({p.dtype for p in pieces}) != 1:
            raise BadResponse(f"the chunks of {name} came in different dtypes", code=ErrorCode.BAD_TENSOR)
        arrays[name] = np.concatenate(pieces) if len(pieces) > 1 else np.array(pieces[0])
    out: dict[str, Any] = {}
    for name, shape in expert_shapes(cfg).items():
        scale = arrays.get(name + "_scale")
        if scale is None:
            out[name] = arrays[name]
            continue
        assert cfg.quant is not None  # wire_layout names scales only then
        out[name] = StoredTensor(cfg.quant, shape, arrays[name], scale)
    return ExpertWeights(**out)


DIGESTS_FILE = "expert_digests.json"
DIGESTS_FORMAT = "moeswarm-expert-digests/1"


def _digest(parts: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256(DIGESTS_FORMAT.encode())
    for name, a in parts.items():
        a = np.ascontiguousarray(a)
        h.update(f"|{name}|{a.dtype}|{','.join(map(str, a.shape))}|".encode())
        h.update(a.view(np.uint8).data)
    return h.hexdigest()


def expert_digest(w: ExpertWeights, cfg: ModelConfig) -> str:
    """SHA-256 over an expert's tensors as ``fetch_expert`` returns them: each wire tensor's name,
    dtype and shape, then its bytes, in ``wire_layout`` order (a quantised checkpoint's matrices:
    their stored codes, then their scales)."""
    return _digest(held_parts(w, cfg))


def held_digest(w: ExpertWeights, cfg: ModelConfig) -> str:
    """The digest of an expert held here, over what ``serve_weights`` would send of it."""
    return _digest({name: wire_rows(a, 0, a.shape[0]) for name, a in held_parts(w, cfg).items()})


def write_expert_digests(weights: Weights, path: str | os.PathLike[str], *, model_id: str,
                         progress: bool = False) -> int:
    """Write ``expert_digests.json`` for every expert ``weights`` holds; returns how many."""
    from tqdm import tqdm

    cfg = weights.config
    pairs = [(L, e) for L in sorted(weights.experts) for e in sorted(weights.experts[L])]
    if not pairs:
        raise ConfigError(f"{weights.folder} holds no routed experts to digest")
    layers: dict[str, dict[str, str]] = {}
    for L, e in tqdm(pairs, desc="digesting experts", unit="expert", disable=not progress):
        layers.setdefault(str(L), {})[str(e)] = held_digest(weights.experts[L][e], cfg)
    doc = {"format": DIGESTS_FORMAT, "model_id": model_id, "layers": layers}
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)
    return len(pairs)


def load_expert_digests(path: str | os.PathLike[str], cfg: ModelConfig) -> dict[tuple[int, int], str] | None:
    """The digests in ``path``, or None if there is no such file; ``ConfigError`` if it is not one
    of ours or names experts this model does not have."""
    p = Path(path)
    if not p.is_file():
        return None
    try:
        doc = json.loads(p.read_text())
        if doc.get("format") != DIGESTS_FORMAT:
            raise ValueError(f"format is {doc.get('format')!r}, expected {DIGESTS_FORMAT!r}")
        out = {(int(L), int(e)): str(d) for L, experts in doc["layers"].items() for e, d in experts.items()}
    except (ValueError, KeyError, AttributeError, TypeError) as e:
        raise ConfigError(f"{p} is not an expert digest file: {e}") from None
    bad = [k for k, d in out.items() if not (0 <= k[0] < cfg.all_layers and 0 <= k[1] < cfg.num_experts)
           or len(d) != 64]
    if bad:
        raise ConfigError(f"{p} names experts this model does not have, or malformed digests, e.g. {bad[:4]}")
    return out


class FetchedExperts(ExpertLRU):
    """Experts fetched from holders, bounded in bytes; the least recently used leaves first."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(max_bytes)
        self.fetched_bytes = 0  # total ever fetched (a metric)

    def put(self, key: tuple[int, int], w: ExpertWeights) -> bool:
        self.fetched_bytes += w.nbytes
        return super().put(key, w)


__all__ = ["DIGESTS_FILE", "FetchedExperts", "expert_digest", "fetch_expert", "held_digest", "held_parts",
           "load_expert_digests", "serve_weights", "wire_layout", "wire_rows", "write_expert_digests"]
