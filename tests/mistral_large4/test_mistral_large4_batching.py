"""Mistral Large 4 in the batched server path (``forward_batch`` over a ``CachePool``): its layers keep
their own caches (keys, values and indexer keys; ``transformer.LAYER_CACHES``), so a batch steps each
sequence alone inside the pass, and what one layer hands the next (a latent KV, the indexer's top-k)
stays within that sequence.  A chunked prefill and single-token steps among other sequences (a longer
one, a late joiner) give transformers' logits and the logits alone."""

from __future__ import annotations

import numpy as np

from moeswarm.model import load_model
from moeswarm.model.batch import CachePool, Step, forward_batch, layer_specs

TOL = 1e-4


def _run(model, seqs: list[list[list[int] | None]], pool: CachePool) -> list[np.ndarray]:  # type: ignore[no-untyped-def]
    caches = [pool.admit(sum(len(c) for c in chunks if c)) for chunks in seqs]
    out: list[list[np.ndarray]] = [[] for _ in seqs]
    for i in range(max(len(s) for s in seqs)):
        batch = [(j, Step(caches[j], chunks[i], all_logits=True))
                 for j, chunks in enumerate(seqs) if i < len(chunks) and chunks[i]]
        forward_batch(model, [s for _, s in batch])
        for j, step in batch:
            out[j].append(step.logits)
    for cache in caches:
        cache.release()  # type: ignore[union-attr]
    return [np.concatenate(o) for o in out]


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
    batched = _run(model, [mine, *others], pool)[0]
    alone = _run(model, [mine], pool)[0]
    assert pool.free == pool.num_blocks
    assert np.abs(batched - alone).max() <= TOL
    assert np.abs(batched - ref.all_logits).max() <= TOL
