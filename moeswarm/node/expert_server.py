"""The numpy backend of the expert data plane: computes a node's experts from its memory-mapped
checkpoint (``moeswarm.net.expert_service`` queues, batches, validates and signs).

Each (layer, expert) of a batch runs once over the rows of every request that routed to it.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from ..errors import ProtocolError
from ..model import ExpertWeights, Weights, expert_ffn
from ..model.experts import F32Cache
from ..net.expert_service import ExpertServerConfig, ExpertService, Job
from ..protocol import ExpertResponse, Identity

__all__ = ["ExpertServer", "ExpertServerConfig"]


class ExpertServer(ExpertService):
    """Experts of a ``Weights`` (the node's block of the checkpoint), computed with numpy."""

    def __init__(self, weights: Weights, identity: Identity, config: ExpertServerConfig) -> None:
        super().__init__(weights.config, identity, config)
        self.weights = weights
        self._f32 = F32Cache(config.f32_cache_bytes)
        self.on_access: Callable[[int, int], None] | None = None  # e.g. MemoryBudget.before_expert

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

    def _compute(self, jobs: Sequence[Job]) -> list[ExpertResponse | ProtocolError]:
        """Thread: one matmul chain per (layer, expert) over all jobs' rows, then sign. A job's
        one expert over all its rows (a decode step's usual call) reads its hidden states and
        answers with the expert's output as they are, no gathering or scattering copies."""
        t0 = time.perf_counter()
        inputs = [j.request.hidden.astype(np.float32, copy=False) for j in jobs]
        outputs: list[np.ndarray | None] = [None] * len(jobs)
        work: dict[tuple[int, int], list[tuple[int, np.ndarray, int]]] = defaultdict(list)
        for i, job in enumerate(jobs):
            offset = 0
            for e in job.request.experts:
                work[(job.request.layer, int(e.expert))].append((i, e.rows, offset))
                offset += len(e.rows)
        with np.errstate(over="ignore", invalid="ignore"):  # overflow is answered as NON_FINITE (_respond)
            for (layer, expert), parts in work.items():
                whole = [inputs[i] if len(rows) == len(inputs[i]) else inputs[i][rows] for i, rows, _ in parts]
                x = whole[0] if len(whole) == 1 else np.concatenate(whole)
                held = jobs[parts[0][0]].held  # validated to hold this expert, even if a move dropped it since
                y = expert_ffn(self._f32.layer(layer, held, self.on_access)[expert], x, self.cfg)
                start = 0
                for i, rows, offset in parts:
                    pairs = jobs[i].request.pairs
                    if len(rows) == pairs:  # the job's only expert
                        outputs[i] = y[start : start + pairs]
                    else:
                        out = outputs[i]
                        if out is None:
                            out = outputs[i] = np.empty((pairs, self.cfg.hidden_size), np.float32)
                        out[offset : offset + len(rows)] = y[start : start + len(rows)]
                    start += len(rows)
        return self._respond(jobs, outputs, t0)  # type: ignore[arg-type]
