"""DeepSeek-V4's multi-token-prediction layer (``mtp.0.*``), read as the hub stores it, against an
oracle composed from transformers 5.24's V4 classes as DeepSeek's ``inference/model.py`` wires them
(``tests/oracle_dsv4_mtp.py`` says which line comes from where); drafting with it keeps the greedy
tokens; the V4 cache forgets rejected drafts exactly (checked against transformers' logits)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from engine_support import copy_with_config
from oracle import PROMPT
from oracle_dsv4_mtp import N, build_mtp_checkpoint, mtp_reference

from moeswarm.errors import CheckpointError, ConfigError
from moeswarm.model import SamplingParams, generate, load_model
from moeswarm.model._attn_dsv4 import ROLLBACK
from moeswarm.model._mtp_run import mtp_forward, new_mtp_cache
from moeswarm.model.speculative import (
    MtpDraft,
    PromptLookup,
    SpeculativeStats,
    generate_drafted,
)

TOL = 1e-4


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    return build_mtp_checkpoint(tmp_path_factory.mktemp("dsv4-mtp") / "ck")


def _ours(model, ids: list[int], split: int | None = None) -> tuple[np.ndarray, np.ndarray]:  # type: ignore[no-untyped-def]
    hidden: list[np.ndarray] = []
    model.forward(np.asarray([ids]), model.new_cache(), hidden_out=hidden)
    h = hidden[0][0]  # (T, n, H): the streams before the hc_head
    cache, cut = new_mtp_cache(model.config), split or len(ids) - 1
    parts = [mtp_forward(model, 0, h[a:b], np.asarray(ids[a + 1 : b + 1]), cache, a + 1)[1]
             for a, b in ((0, cut), (cut, len(ids) - 1)) if b > a]
    return h, np.concatenate(parts)


def test_the_mtp_layer_is_read_as_the_hub_stores_it(mtp_checkpoint) -> None:
    folder, _, _ = mtp_checkpoint
    cfg = load_model(folder).config
    assert cfg.mtp_layers == 1 and cfg.all_layers == N + 1
    assert cfg.family.layer_kinds[N] == "sliding" and cfg.family.hash_layers[N] is False
    assert cfg.moe_layers[N]


def test_mtp_logits_match_the_reference(mtp_checkpoint) -> None:
    """Every slot's MTP logits within 1e-4, in one pass and in two over the MTP cache (the 15 slots
    cross the 6-token sliding window); negative controls, each caught by the same comparison:
    e_proj and h_proj exchanged; the model's own hc_head used in place of the MTP layer's."""
    folder, main, mtp = mtp_checkpoint
    model = load_model(folder)
    assert model.weights.experts[N], "the MTP layer's routed experts are loaded as experts of layer n"
    streams, ref = mtp_reference(main, mtp, PROMPT)
    h, logits = _ours(model, PROMPT)
    assert np.abs(h - streams).max() <= TOL
    assert np.abs(logits - ref).max() <= TOL, np.abs(logits - ref).max()
    _, chunked = _ours(model, PROMPT, split=7)
    assert np.abs(chunked - ref).max() <= TOL
    t = model.weights.tensors
    e, hp = t[f"{N}.mtp.e_proj"], t[f"{N}.mtp.h_proj"]
    t[f"{N}.mtp.e_proj"], t[f"{N}.mtp.h_proj"] = hp, e
    assert np.abs(_ours(model, PROMPT)[1] - ref).max() > 1e-2
    t[f"{N}.mtp.e_proj"], t[f"{N}.mtp.h_proj"] = e, hp
    for p in ("fn", "base", "scale"):
        t[f"{N}.mtp.hc_head_{p}"] = t[f"hc_head_{p}"]
    assert np.abs(_ours(model, PROMPT)[1] - ref).max() > 1e-2


def test_greedy_drafting_keeps_the_greedy_tokens(mtp_checkpoint) -> None:
    """MTP drafts (k = 3) and prompt-lookup drafts, some accepted and some rejected, so the V4 cache
    and the MTP layer's own cache both roll back: the tokens are plain greedy's."""
    model = load_model(mtp_checkpoint[0])
    params = SamplingParams(max_new_tokens=24)
    expected = list(generate(model, PROMPT, params))
    st = SpeculativeStats()
    assert list(generate_drafted(model, PROMPT, params, MtpDraft(model), k=3, stats=st)) == expected
    assert st.drafted > 0
    lookup = SpeculativeStats()
    assert list(generate_drafted(model, PROMPT, params, PromptLookup(), k=4, stats=lookup)) == expected
    assert 0 < lookup.accepted < lookup.drafted


def test_the_cache_forgets_the_last_tokens_exactly(dsv4_checkpoints) -> None:
    """Prefill a prefix, feed tokens that are then forgotten, feed the prompt's rest: the logits are
    transformers' for the prompt, wherever the cut falls in the compressors' windows (CSA every 4,
    HCA every 8 tokens) and after a decode step; a cut further back than ``ROLLBACK`` is refused."""
    folder, ref = dsv4_checkpoints.get("per_expert")
    model = load_model(folder)
    for cut, junk in ((8, 7), (9, 6), (11, 3), (13, 1), (5, 11)):
        cache = model.new_cache()
        model.forward(np.asarray([PROMPT[:cut]]), cache)
        model.forward(np.asarray([[3] * junk]), cache)
        model.forward(np.asarray([[4]]), cache)
        cache.truncate(cut)
        logits = model.forward(np.asarray([PROMPT[cut:]]), cache)[0]
        assert np.abs(logits - ref.prefill_logits[cut:]).max() <= TOL, cut
    model.forward(np.asarray([[ref.decode_tokens[0], 9, 9]]), cache)
    cache.truncate(len(PROMPT) + 1)
    assert np.abs(model.forward(np.asarray([ref.decode_tokens[1:2]]), cache)[0, -1] - ref.decode_logits[1]).max() <= TOL
    model.forward(np.asarray([[7] * (ROLLBACK + 1)]), cache)
    with pytest.raises(ConfigError, match=f"can forget its last {ROLLBACK} tokens"):
        cache.truncate(len(PROMPT) + 2)


def test_a_compressed_mtp_layer_is_refused(mtp_checkpoint, tmp_path: Path) -> None:
    """No published V4 checkpoint has one and no reference says where its windows would start."""
    bad = copy_with_config(mtp_checkpoint[0], tmp_path / "bad", lambda raw: raw.update(
        layer_types=[*raw["layer_types"], "heavily_compressed_attention"]))
    with pytest.raises(CheckpointError, match="the MTP layers' attention must be sliding_attention"):
        load_model(bad)
