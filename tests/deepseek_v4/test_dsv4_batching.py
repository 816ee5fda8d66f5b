"""DeepSeek-V4 in the batched server path (``forward_batch`` over a ``CachePool``): its layers keep
their own caches (sliding keys, compressor state; ``transformer.LAYER_CACHES``), so a batch steps each
sequence alone inside the pass.  A chunked prefill and single-token steps among other sequences (longer
chunks, a late joiner, one that leaves early) give transformers' logits and the logits alone."""

from __future__ import annotations

from engine_support import assert_batched_as_alone_and_as_transformers

from moeswarm.model import load_model
from moeswarm.model.batch import CachePool, layer_specs

TOL = 1e-4


def test_batched_logits_match_transformers_and_running_alone(dsv4_checkpoints) -> None:
    folder, ref = dsv4_checkpoints.get("packed")
    model = load_model(folder)
    pool = CachePool(layer_specs(model.config), 64 << 20)
    assert_batched_as_alone_and_as_transformers(model, ref, pool, tol=TOL)
