"""What this machine does, measured for the tier planner: how fast it reads experts from disk,
how fast the expert math streams weights, and how long a step without experts takes."""

from __future__ import annotations

import contextlib
import os
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from ..model import ExpertWeights, ModelConfig, Weights, expert_ffn
from ..model.weights import expert_shapes

if TYPE_CHECKING:
    pass


ASSUMED_DISK_BPS = 500e6  # until measured, or when the experts are not memory-mapped files


def measure_disk_bps(weights: Weights, samples: int = 4, *, consecutive: bool = False) -> float:
    """Bytes/s at which cold experts come in from the checkpoint's disk, the way ``MemoryBudget``
    reads them: a few experts' byte ranges are dropped from the page cache, then read in file
    order with ``pread``, one descriptor per file.  Spread over the file (decode: a token's picks
    are scattered; ~1.1 GB/s on this VM), or with ``consecutive`` one layer's experts one after
    the other (prefill reads nearly all of a layer in file order; readahead makes that ~1.8 GB/s
    here).  Falls back to ``ASSUMED_DISK_BPS`` when the experts are not memory-mapped files."""
    from ..model.memory import expert_ranges, read_range

    experts = [w for layer in weights.experts.values() for w in layer.values()]
    picked = experts[:samples] if consecutive else experts[:: max(1, len(experts) // samples)][:samples]
    ranges = [r for w in picked for r in expert_ranges(w)]
    if not ranges:
        return ASSUMED_DISK_BPS
    buffer = bytearray(4 << 20)
    fds = {path: os.open(path, os.O_RDONLY) for path in {r[0] for r in ranges}}  # one per file, as MemoryBudget
    try:
        for fd in fds.values():
            with contextlib.suppress(OSError):  # e.g. EINVAL where the file system has nothing to sync
                os.fsync(fd)  # pages still dirty (a checkpoint just written) cannot be dropped
        for path, start, length in ranges:
            os.posix_fadvise(fds[path], start, length, os.POSIX_FADV_DONTNEED)
        total = 0
        t0 = time.perf_counter()
        for path, start, length in ranges:
            total += read_range(fds[path], start, length, buffer)
        seconds = time.perf_counter() - t0
    finally:
        for fd in fds.values():
            os.close(fd)
    return total / seconds if total and seconds > 0 else ASSUMED_DISK_BPS


def measure_compute_bps(cfg: ModelConfig, expert: ExpertWeights | None = None, repeats: int = 5) -> float:
    """Bytes/s of expert weights one token's expert math streams (float32), the best of a few runs."""
    if expert is None:
        rng = np.random.default_rng(0)
        expert = ExpertWeights(*(rng.standard_normal(s, dtype=np.float32) * 0.02
                                 for n, s in expert_shapes(cfg).items() if not n.endswith("bias")))
    w = ExpertWeights(*(np.asarray(a, dtype=np.float32) for a in (expert.gate, expert.up, expert.down)))
    x = np.ones((1, cfg.hidden_size), np.float32)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        expert_ffn(w, x, cfg)
        best = min(best, time.perf_counter() - t0)
    return w.nbytes / max(best, 1e-7)


class _NoExperts:
    """An executor whose routed experts output zeros: times everything but them."""

    def submit(self, layer: int, x: np.ndarray, ids: np.ndarray, weights: np.ndarray) -> Any:
        class Zeros:
            def result(self) -> np.ndarray:
                return np.zeros_like(x)

        return Zeros()

    def end_step(self) -> None:
        pass


def measure_backbone_seconds(weights: Weights, steps: int = 3) -> float:
    """Seconds of one decode step without the routed experts (attention, routers, norms, shared
    experts, LM head, and the interpreter's share of it), the best of a few steps."""
    from ..model import Model

    model = Model(weights, experts=_NoExperts())  # type: ignore[arg-type]
    cache = model.new_cache()
    model.forward(np.asarray([[1]]), cache)  # warm: pages in what a step reads
    best = float("inf")
    for _ in range(steps):
        t0 = time.perf_counter()
        model.forward(np.asarray([[1]]), cache)
        best = min(best, time.perf_counter() - t0)
    return best
