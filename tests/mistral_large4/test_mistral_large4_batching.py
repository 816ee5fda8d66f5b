"""Mistral Large 4 in the batched server path (``forward_batch`` over a ``CachePool``): its layers keep
their own caches (keys, values and indexer keys; ``transformer.LAYER_CACHES``), so a batch steps each
sequence alone inside the pass, and what one layer hands the next (a latent KV, the indexer's top-k)
stays within that sequence.  A chunked prefill and single-token steps among other sequences (a longer
one, a late joiner) give transformers' logits and the logits alone."""

from __future__ import annotations

import numpy as np
from engine_support import assert_batched_as_alone_and_as_transformers

from moeswarm.model import load_model
from moeswarm.model.batch import CachePool, layer_specs

TOL = 1e-4


def test_batched_logits_match_transformers_and_running_alone(ml4_checkpoints) -> None:
    folder, ref = ml4_checkpoints.get("packed")
    model = load_model(folder)
    pool = CachePool(layer_specs(model.config), 64 << 20)

    def others(rng: np.random.Generator, vocab: int, steps: int) -> list[list[list[int] | None]]:
        return [[rng.integers(3, vocab, 12).tolist()] + [rng.integers(3, vocab, 1).tolist()] * (steps - 1),
                [None, None, rng.integers(3, vocab, 9).tolist()] + [rng.integers(3, vocab, 1).tolist()] * (steps - 3)]

    assert_batched_as_alone_and_as_transformers(model, ref, pool, first=7, others=others, tol=TOL)
