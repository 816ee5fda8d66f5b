"""The bridge's backend of the expert data plane: onnxruntime doing the arithmetic.

Validation, queueing, batching, deadlines, error codes and receipts are inherited unchanged
from ``moeswarm.net.expert_service.ExpertService``, so a device answers exactly like a node;
only the compute step differs: each layer of a batch is one onnxruntime run over every expert
the batch's requests routed to (the other branches of the layer's graph get empty inputs).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import ProtocolError
from ..net.expert_service import ExpertServerConfig, ExpertService, Job
from ..protocol import ExpertResponse, Identity
from .shards import OnnxShards


class OnnxExpertServer(ExpertService):
    def __init__(self, shards: OnnxShards, identity: Identity, config: ExpertServerConfig) -> None:
        cfg = shards.model_config
        super().__init__(cfg, identity, config)
        self.shards = shards
        self._held = {layer: dict.fromkeys(shards.held(layer)) for layer in shards.moe_layers}

    def _experts(self, layer: int) -> Any:  # validation only asks which experts are held
        return self._held.get(layer, {})

    def _compute(self, jobs: Sequence[Job]) -> list[ExpertResponse | ProtocolError]:
        """Thread: per layer, one onnxruntime run over the rows of every job, then sign."""
        t0 = time.perf_counter()
        hidden_size = self.cfg.hidden_size
        outputs = [np.empty((j.request.pairs, hidden_size), np.float32) for j in jobs]
        work: dict[int, dict[int, list[tuple[int, np.ndarray, int]]]] = defaultdict(lambda: defaultdict(list))
        for i, job in enumerate(jobs):
            offset = 0
            for e in job.request.experts:
                work[job.request.layer][int(e.expert)].append((i, e.rows, offset))
                offset += len(e.rows)
        for layer, experts in work.items():
            inputs = {e: np.concatenate([jobs[i].request.hidden[rows] for i, rows, _ in parts])
                      for e, parts in experts.items()}  # (rows of e, H)
            results = self.shards.run(layer, inputs)
            for e, parts in experts.items():
                y, start = results[e], 0
                for i, rows, offset in parts:
                    outputs[i][offset : offset + len(rows)] = y[start : start + len(rows)]
                    start += len(rows)
        return self._respond(jobs, outputs, t0)
