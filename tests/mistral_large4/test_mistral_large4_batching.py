"""Mistral Large 4 in the batched server path (``forward_batch`` over a ``CachePool``): its layers keep
their own caches (keys, values and indexer keys; ``transformer.LAYER_CACHES``), so a batch steps each
sequence alone inside the pass, and what one layer hands the next (a latent KV, the indexer's top-k)
stays within that sequence.  A chunked prefill and single-token steps among other sequences (a longer
one, a late joiner) give transformers' logits and the logits alone."""

from __future__ import annotations

import numpy as np
from engine_support import run_batched

from moeswarm.model import load_model
from moeswarm.model.batch import CachePool, layer_specs

TOL = 1e-4


def test_batched_logits_match_transformers_and_running_alone(ml4_checkpoints) -> None:
    folder, ref = ml4_checkpoints.get("packed")
    model = load_model(folder)
    pool = CachePool(layer_specs(model.config), 64 << 20)
    ids, T = ref.sequence_ids, len(ref.prompt_ids)
    mine = [ids[:7], ids[7:T]] + [[t] for t in ids[T:]]
    rng = np.random.default_rng(0)
    V = model.config.vocab_size
    others = [
        [rng.integers(3, V, 12).tolist()] + [rng.integers(3, V, 1).tolist()] * (len(mine) - 1),
        [None, None, rng.integers(3, V, 9).tolist()] + [rng.integers(3, V, 1).tolist()] * (len(mine) - 3),
    ]
    batched = run_batched(model, [mine, *others], pool)[0]
    alone = run_batched(model, [mine], pool)[0]
    assert pool.free == pool.num_blocks
    assert np.abs(batched - alone).max() <= TOL
    assert np.abs(batched - ref.all_logits).max() <= TOL
