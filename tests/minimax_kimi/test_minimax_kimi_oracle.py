"""MiniMax M2, MiniMax M3 (text model) and Kimi K2.5 (text model) against transformers 5.24:
both on-disk layouts, a 16-token prefill (whole, and in chunks of 5 over the cache), 8 decode steps
on the cache, greedy tokens; and negative controls showing each new mechanism changes the logits,
so the match is not an accident of a mechanism that does nothing on these weights."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from engine_support import assert_matches_transformers, copy_with_config, run_engine
from engine_support import moved as _moved
from engine_support import variant as _variant

from moeswarm.model import (
    BACKENDS,
    SamplingParams,
    generate,
    get_backend,
    load_model,
)
from moeswarm.model._attn_lightning import select_blocks
from moeswarm.model._config_minimax_kimi import (
    ARCHITECTURES as ARCHITECTURES_MINIMAX_KIMI,
)
from moeswarm.model.routing import route

LAYOUTS = ("per_expert", "packed")
TOL = 1e-4
MATTERS = 1e-2  # a mechanism switched off must move some logit by at least 100x the tolerance


def test_the_three_families_are_parsed() -> None:
    assert set(ARCHITECTURES_MINIMAX_KIMI) == {"minimax_m2", "minimax_m3_vl", "kimi_k25"}


@pytest.mark.parametrize("chunk", [None, 5], ids=["one-prefill", "prefill-in-chunks-of-5"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arch", ARCHITECTURES_MINIMAX_KIMI)
def test_logits_and_greedy_tokens_match_transformers(family_checkpoints, arch: str, layout: str,
                                                     chunk: int | None) -> None:
    folder, ref = family_checkpoints.get(arch, layout)
    model = load_model(folder, backend="eager")
    assert model.config.arch == arch
    assert_matches_transformers(model, ref, chunk, TOL)


@pytest.mark.parametrize("arch", ARCHITECTURES_MINIMAX_KIMI)
def test_backends_agree(family_checkpoints, arch: str) -> None:
    folder, _ = family_checkpoints.get(arch, "packed")
    model = load_model(folder)
    cfg, w = model.config, model.weights
    layer = next(L for L in range(cfg.num_layers) if cfg.moe_layers[L])
    rng = np.random.default_rng(1)
    for tokens in (1, 3, 8, 33):
        x = rng.standard_normal((tokens, cfg.hidden_size)).astype(np.float32)
        ids, weights = route(cfg, x, w[f"{layer}.router"], None, w.get(f"{layer}.router_score_bias"))
        outs = {name: get_backend(name)(w.experts[layer], x, ids, weights, cfg) for name in BACKENDS}
        for name, out in outs.items():
            assert np.abs(out - outs["eager"]).max() <= 1e-5, (tokens, name)
        assert np.abs(outs["eager"]).max() > 1e-2


def test_minimax_m3_indexer_really_drops_key_blocks(family_checkpoints) -> None:
    folder, ref = family_checkpoints.get("minimax_m3_vl")
    cfg = load_model(folder).config
    # the configuration makes the selection bite: 4-token blocks, 2 kept, a 16-token prompt
    assert cfg.index_topk_blocks * cfg.index_block_size < len(ref.prompt_ids)
    assert any(cfg.sparse_layers) and not all(cfg.sparse_layers)
    assert any(cfg.moe_layers) and not all(cfg.moe_layers)
    # at the last prompt position the indexer sees 4 causal blocks and keeps 2
    scores = np.random.default_rng(0).standard_normal((1, cfg.index_heads, 1, 16)).astype(np.float32)
    keep = select_blocks(scores, np.asarray([15]), cfg)
    assert keep.sum(axis=-1).tolist() == [[[2]] * cfg.index_heads]
    assert keep[..., 3].all()  # the query's own block is always local
    dense_attention = _variant(folder, index_topk_blocks=1000)
    no_local = _variant(folder, index_local_blocks=0)
    assert _moved(dense_attention, ref) > MATTERS
    assert _moved(no_local, ref) > MATTERS


@pytest.mark.parametrize("change", ["swiglu_limit", "routed_scaling_factor", "dense_activation", "rotary",
                                    "score_bias"])
def test_minimax_m3_mechanisms_each_change_the_logits(family_checkpoints, change: str) -> None:
    folder, ref = family_checkpoints.get("minimax_m3_vl")
    cfg = load_model(folder).config
    if change == "score_bias":
        model = load_model(folder, backend="eager")
        for L in range(cfg.num_layers):
            if cfg.moe_layers[L]:
                model.weights.tensors[f"{L}.router_score_bias"] = np.zeros(cfg.num_experts, np.float32)
    else:
        changes = {
            "swiglu_limit": dict(swiglu_limit=1e9),
            "routed_scaling_factor": dict(routed_scaling_factor=1.0),
            "dense_activation": dict(dense_activation="swiglu"),
            "rotary": dict(rope=replace(cfg.rope, dim=cfg.head_dim)),
        }[change]
        model = _variant(folder, **changes)
    assert _moved(model, ref) > MATTERS


@pytest.mark.parametrize("change", ["rotary", "score_bias", "qk_norm"])
def test_minimax_m2_mechanisms_each_change_the_logits(family_checkpoints, change: str) -> None:
    folder, ref = family_checkpoints.get("minimax_m2")
    cfg = load_model(folder).config
    assert cfg.rope.dim == cfg.head_dim // 2
    if change == "score_bias":
        model = load_model(folder, backend="eager")
        for L in range(cfg.num_layers):
            model.weights.tensors[f"{L}.router_score_bias"] = np.zeros(cfg.num_experts, np.float32)
    elif change == "rotary":
        model = _variant(folder, rope=replace(cfg.rope, dim=cfg.head_dim))
    else:
        model = _variant(folder, qk_norm=None)
    assert _moved(model, ref) > MATTERS


def test_kimi_k25_ties_the_head_as_transformers_does(family_checkpoints) -> None:
    folder, _ = family_checkpoints.get("kimi_k25")
    raw = json.loads((folder / "config.json").read_text())
    assert raw["text_config"]["tie_word_embeddings"] is False and raw["tie_word_embeddings"] is True
    model = load_model(folder)
    assert model.config.tie_word_embeddings
    assert model.weights["lm_head"] is model.weights["embed"]


def test_hub_spellings_of_the_configs_give_the_same_logits(family_checkpoints, tmp_path: Path) -> None:
    """MiniMax M2 as published says ``rotary_dim``; MiniMax M3 as published says
    ``sparse_attention_config`` and ``moe_layer_freq``.  transformers reads both."""
    folder, ref = family_checkpoints.get("minimax_m2")

    def m2(raw):  # type: ignore[no-untyped-def]
        raw["rope_parameters"].pop("partial_rotary_factor")
        raw["rotary_dim"] = 8

    model = load_model(copy_with_config(folder, tmp_path / "m2", m2), backend="eager")
    assert model.config.rope.dim == 8
    prefill, _ = run_engine(model, ref)
    assert np.abs(prefill - ref.prefill_logits).max() <= TOL

    folder, ref = family_checkpoints.get("minimax_m3_vl")

    def m3(raw):  # type: ignore[no-untyped-def]
        t = raw["text_config"]
        t["sparse_attention_config"] = {
            "sparse_attention_freq": [int(k == "minimax_m3_sparse") for k in t.pop("layer_types")],
            "sparse_num_index_heads": t.pop("index_n_heads"), "sparse_index_dim": t.pop("index_head_dim"),
            "sparse_block_size": t.pop("index_block_size"), "sparse_topk_blocks": t.pop("index_topk_blocks"),
            "sparse_local_block": t.pop("index_local_blocks"),
        }
        t["moe_layer_freq"] = [int(k == "sparse") for k in t.pop("mlp_layer_types")]

    model = load_model(copy_with_config(folder, tmp_path / "m3", m3), backend="eager")
    assert replace(model.config, model_id="") == replace(load_model(folder).config, model_id="")
    prefill, _ = run_engine(model, ref, chunk=5)
    assert np.abs(prefill - ref.prefill_logits).max() <= TOL


def test_minimax_m3_cache_rolls_back_its_index_keys_too(family_checkpoints) -> None:
    """Speculative decoding truncates the cache after a rejected draft: the index keys must go too."""
    from moeswarm.model.speculative import generate_speculative

    folder, ref = family_checkpoints.get("minimax_m3_vl")
    model = load_model(folder, backend="eager")
    cache = model.new_cache()
    model.forward(np.asarray([ref.prompt_ids]), cache)
    model.forward(np.asarray([[5, 6, 7, 8]]), cache)  # a draft that is then rejected
    cache.truncate(len(ref.prompt_ids))
    assert {layer.length for layer in cache.layers} == {len(ref.prompt_ids)}
    assert {layer.index.length for layer in cache.layers if hasattr(layer, "index")} == {len(ref.prompt_ids)}
    again = model.forward(np.asarray([[ref.decode_tokens[0]]]), cache)[0, -1]
    assert np.abs(again - ref.decode_logits[0]).max() <= TOL
    prompt = ref.prompt_ids + ref.prompt_ids[:8]  # repeats, so prompt lookup drafts (and some are rejected)
    params = SamplingParams(max_new_tokens=12)
    assert list(generate_speculative(model, prompt, params, k=4)) == list(generate(model, prompt, params))


def test_minimax_m3_batch_rows_equal_single_rows(family_checkpoints) -> None:
    folder, _ = family_checkpoints.get("minimax_m3_vl")
    model = load_model(folder)
    batch = np.random.default_rng(2).integers(3, model.config.vocab_size, size=(3, 13))

    def two_chunks(ids: np.ndarray) -> np.ndarray:
        cache = model.new_cache()
        return np.concatenate([model.forward(ids[:, :9], cache), model.forward(ids[:, 9:], cache)], axis=1)

    # rows must not see each other's keys, index keys or blocks; what is left is fp32 summation order
    # (gemm vs gemv over 3x more rows), amplified by M3's Gemma norms (~2x per norm): ~1e-5 on logits ~7
    together = two_chunks(batch)
    for b in range(3):
        alone = two_chunks(batch[b : b + 1])
        assert np.abs(together[b] - alone[0]).max() <= TOL
        other = two_chunks(batch[(b + 1) % 3 : (b + 1) % 3 + 1])
        assert np.abs(together[b] - other[0]).max() > 1.0  # a different row is far away


@pytest.mark.parametrize(("edit", "message"), [
    (lambda t: t.update(layer_types=["full_attention", "sliding_attention"] * 2), "layer type 'sliding_attention'"),
    (lambda t: t.update(mlp_layer_types=["dense"] * 3), "fewer than num_hidden_layers=4"),
    (lambda t: t.update(index_n_heads=3), "index_n_heads=3 must divide num_attention_heads=4"),
    (lambda t: t.pop("num_local_experts"), "'num_experts'"),
])
def test_a_bad_minimax_m3_config_says_what_is_wrong(family_checkpoints, tmp_path: Path, edit, message: str) -> None:  # type: ignore[no-untyped-def]
    from moeswarm.errors import CheckpointError

    folder, _ = family_checkpoints.get("minimax_m3_vl")
    bad = copy_with_config(folder, tmp_path / "bad", lambda raw: edit(raw["text_config"]))
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace("[", r"\[")):
        load_model(bad)


def test_kimi_k25_text_config_may_say_kimi_k2(family_checkpoints, tmp_path: Path) -> None:
    """The hub's Kimi K2.5 config.json names its text model ``kimi_k2``; transformers reads it as DeepSeek-V3."""
    folder, ref = family_checkpoints.get("kimi_k25")
    hub = copy_with_config(folder, tmp_path / "hub", lambda raw: raw["text_config"].update(model_type="kimi_k2"))
    prefill, _ = run_engine(load_model(hub, backend="eager"), ref)
    assert np.abs(prefill - ref.prefill_logits).max() <= TOL


def _published_m3_text() -> dict:  # type: ignore[type-arg]
    """MiniMax M3's text_config as published (hub field names and values; no weights needed)."""
    dense3 = [0, 0, 0] + [1] * 57
    return {
        "model_type": "minimax_m3", "hidden_size": 6144, "intermediate_size": 3072, "num_hidden_layers": 60,
        "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 200064,
        "max_position_embeddings": 524288, "rms_norm_eps": 1e-06, "use_gemma_norm": True, "rope_theta": 5000000,
        "rotary_dim": 64, "partial_rotary_factor": 0.5, "hidden_act": "swigluoai", "qk_norm_type": "per_head",
        "tie_word_embeddings": False, "dense_intermediate_size": 12288, "shared_intermediate_size": 3072,
        "num_local_experts": 128, "num_experts_per_tok": 4, "n_shared_experts": 1, "scoring_func": "sigmoid",
        "moe_layer_freq": dense3, "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "routed_scaling_factor": 2.0,
        "sparse_attention_config": {"use_sparse_attention": True, "sparse_index_dim": 128, "sparse_num_index_heads": 4,
                                    "sparse_topk_blocks": 16, "sparse_block_size": 128, "sparse_local_block": 1,
                                    "sparse_attention_freq": dense3},
    }


def test_published_configs_parse_at_real_scale() -> None:
    """The seed's figures for MiniMax M3 (7,296 routed experts, 228 active per token) and Kimi K2.5's shape."""
    from moeswarm.model import ModelConfig

    m3 = ModelConfig.from_hf({"model_type": "minimax_m3_vl", "text_config": _published_m3_text(),
                              "vision_config": {"hidden_size": 1280}})
    assert m3.num_experts * sum(m3.moe_layers) == 7296 and m3.top_k * sum(m3.moe_layers) == 228
    assert m3.rope.dim == 64 and m3.rope.theta == 5e6 and sum(m3.sparse_layers) == 57
    assert (m3.index_heads, m3.index_head_dim, m3.index_block_size, m3.index_topk_blocks) == (4, 128, 128, 16)
    assert (m3.dense_intermediate_size, m3.shared_intermediate_size, m3.routed_scaling_factor) == (12288, 3072, 2.0)
    kimi_text = {
        "model_type": "kimi_k2", "vocab_size": 163840, "hidden_size": 7168, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 64,
        "num_key_value_heads": 64, "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 8,
        "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "rope_theta": 50000.0, "max_position_embeddings": 262144, "tie_word_embeddings": False,
        "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    }
    kimi = ModelConfig.from_hf({"model_type": "kimi_k25", "text_config": kimi_text, "tie_word_embeddings": False,
                                "vision_config": {}})
    assert kimi.arch == "kimi_k25" and kimi.attention == "mla" and not kimi.tie_word_embeddings
    assert kimi.num_experts * sum(kimi.moe_layers) == 384 * 60 and kimi.rope.kind == "yarn"


@pytest.mark.parametrize("chunk", [None, 4])
def test_minimax_m3_indexer_corner_cases_match_transformers(family_checkpoints, chunk: int | None) -> None:
    """One indexer head shared by all query heads, an indexer narrower than the rotary width,
    3-key blocks (16 keys: the last block padded), 2 local blocks."""
    folder, ref = family_checkpoints.get("minimax_m3_vl_odd_index")
    model = load_model(folder, backend="eager")
    cfg = model.config
    assert (cfg.index_heads, cfg.index_head_dim, cfg.rope.dim, cfg.index_block_size) == (1, 8, 16, 3)
    prefill, decode = run_engine(model, ref, chunk)
    assert np.abs(prefill - ref.prefill_logits).max() <= TOL
    assert np.abs(decode - ref.decode_logits).max() <= TOL
    assert _moved(_variant(folder, index_topk_blocks=1000), ref) > MATTERS
