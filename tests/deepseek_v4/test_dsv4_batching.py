"""DeepSeek-V4 in the batched server path (``forward_batch`` over a ``CachePool``): its layers keep
their own caches (sliding keys, compressor state; ``transformer.LAYER_CACHES``), so a batch steps each
sequence alone inside the pass.  A chunked prefill and single-token steps among other sequences (longer
chunks, a late joiner, one that leaves early) give transformers' logits and the logits alone."""

from __future__ import annotations

import numpy as np
from engine_support import run_batched

from moeswarm.model import load_model
from moeswarm.model.batch import CachePool, layer_specs

TOL = 1e-4


def test_batched_logits_match_transformers_and_running_alone(dsv4_checkpoints) -> None:
    folder, ref = dsv4_checkpoints.get("packed")
    model = load_model(folder)
    pool = CachePool(layer_specs(model.config), 64 << 20)
    ids, T = ref.sequence_ids, len(ref.prompt_ids)
    mine = [ids[:3], ids[3:T]] + [[t] for t in ids[T:]]
    rng = np.random.default_rng(0)
    V = model.config.vocab_size
    others = [
        [rng.integers(3, V, 9).tolist(), rng.integers(3, V, 1).tolist(), rng.integers(3, V, 6).tolist()],
        [None, None, rng.integers(3, V, 20).tolist()] + [rng.integers(3, V, 1).tolist()] * (len(mine) - 3),
        [rng.integers(3, V, 2).tolist()] * len(mine),
    ]
    batched = run_batched(model, [mine, *others], pool)[0]
    alone = run_batched(model, [mine], pool)[0]
    assert pool.free == pool.num_blocks
    assert np.abs(batched - alone).max() <= TOL
    assert np.abs(batched - ref.all_logits).max() <= TOL
