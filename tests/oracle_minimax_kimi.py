"""Test-side oracle for MiniMax M2, MiniMax M3 (vision-language, text model) and Kimi K2.5
(vision-language, DeepSeek-V3 text): tiny hot-initialised checkpoints built by transformers 5.24
from their configs, and reference logits from transformers (fp32, eager attention, eager experts).

Test-only (imports torch + transformers); reuses ``oracle.py``'s prompt, quieting and hot init rules.

Configs (see ``CONFIGS``), all vocab 512, hidden 64, fp32:

* ``minimax_m2``: 2 layers, 4 heads / 2 kv heads, head_dim 16, partial rotary factor 0.5 (8 of 16
  channels turn), theta 5e6, q/k RMSNorm over the whole projections, 8 experts top-2, sigmoid
  router + ``e_score_correction_bias`` (hot: 0.1 N).
* ``minimax_m3_vl``: 4 layers: attention ``full, sparse, sparse, full``; MLP ``dense, sparse,
  dense, sparse``; indexer 2 heads x 16, block 4, top-2 blocks, 1 local block, so with the
  16-token prompt a query at position 15 sees its own block and one of three earlier ones; Gemma
  norms (1 + w); partial rotary 0.5; SwiGLU-OAI with limit 1.5 (bites on hot weights);
  8 experts top-2 + shared expert (48); routed scaling 2.0; a 1-layer vision tower (ignored).
* ``kimi_k25``: ``oracle._deepseek`` (MLA, YaRN, grouped sigmoid router, 1 dense + 2 MoE layers)
  as ``text_config``, a 1-layer vision tower; top-level ``tie_word_embeddings`` left at its
  default (True: transformers ties lm_head to the embeddings, whatever text_config says).

Layouts: ``per_expert`` is ``save_pretrained`` (the hub names: ``language_model.model.*``,
``block_sparse_moe.experts.E.w1``... -- Kimi's layers come out as ``blocks.N``), ``packed`` is
``save_original_format=False`` (transformers' runtime names).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import oracle
import torch
from oracle import PROMPT, Reference, _quiet  # noqa: F401  (PROMPT re-exported)
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    DynamicCache,
    Kimi_K25Config,
    MiniMaxM2Config,
    MiniMaxM3VLConfig,
)

ARCHS = ("minimax_m2", "minimax_m3_vl", "kimi_k25")
EXTRA = ("minimax_m3_vl_odd_index",)  # model_type minimax_m3_vl too
VISION_LANGUAGE = ("minimax_m3_vl", "kimi_k25", "minimax_m3_vl_odd_index")
LAYOUTS = ("per_expert", "packed")

_TEXT = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-6)
_VISION_M3 = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
_VISION_KIMI = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                    pos_emb_height=4, pos_emb_width=4)

M3_TEXT = dict(
    **_TEXT,
    num_hidden_layers=4,
    tie_word_embeddings=False,
    intermediate_size=32,
    dense_intermediate_size=96,
    shared_intermediate_size=48,
    num_local_experts=8,
    num_experts_per_tok=2,
    routed_scaling_factor=2.0,
    swiglu_limit=1.5,
    index_n_heads=2,
    index_head_dim=16,
    index_block_size=4,
    index_topk_blocks=2,
    index_local_blocks=1,
    layer_types=["full_attention", "minimax_m3_sparse", "minimax_m3_sparse", "full_attention"],
    mlp_layer_types=["dense", "sparse", "dense", "sparse"],
    rope_parameters=dict(rope_type="default", rope_theta=5_000_000.0, partial_rotary_factor=0.5),
)

#: a second MiniMax M3 shape for the indexer's corner cases: one indexer head for two kv heads, an
#: indexer narrower than the rotary width (transformers cuts the cos/sin tables, which pairs channels
#: oddly), blocks of 3 (the last one padded), 2 local blocks, full rotary
M3_ODD_INDEX = dict(M3_TEXT, index_n_heads=1, index_head_dim=8, index_block_size=3, index_topk_blocks=3,
                    index_local_blocks=2, rope_parameters=dict(rope_type="default", rope_theta=10_000.0))

CONFIGS: dict[str, Any] = {
    "minimax_m3_vl_odd_index": lambda: MiniMaxM3VLConfig(text_config=dict(M3_ODD_INDEX),
                                                         vision_config=dict(_VISION_M3)),
    "minimax_m2": lambda: MiniMaxM2Config(
        **_TEXT,
        num_hidden_layers=2,
        tie_word_embeddings=False,
        intermediate_size=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        rope_parameters=dict(rope_type="default", rope_theta=5_000_000.0, partial_rotary_factor=0.5),
    ),
    "minimax_m3_vl": lambda: MiniMaxM3VLConfig(text_config=dict(M3_TEXT), vision_config=dict(_VISION_M3)),
    "kimi_k25": lambda: Kimi_K25Config(
        text_config=oracle._deepseek(32, oracle.DEEPSEEK_YARN).to_dict(), vision_config=dict(_VISION_KIMI)
    ),
}


def _auto(arch_or_type: str) -> Any:
    return AutoModelForImageTextToText if arch_or_type in VISION_LANGUAGE else AutoModelForCausalLM


@torch.no_grad()
def _reinit_hot(model: torch.nn.Module, seed: int) -> None:
    """``oracle.reinit_hot``'s rules for the language model; the vision tower gets small noise."""
    g = torch.Generator().manual_seed(seed)
    persistent = set(model.state_dict().keys())
    for n, p in list(model.named_parameters()) + list(model.named_buffers()):
        if n not in persistent:
            continue
        r = torch.randn(p.shape, generator=g, dtype=torch.float32)
        if "vision" in n or "projector" in n:
            p.copy_(0.02 * r)
        elif n.endswith("norm.weight") or "layernorm" in n:
            p.copy_(1 + 0.1 * r)
        elif n.endswith("bias"):
            p.copy_(0.1 * r)
        elif "embed_tokens" in n:
            p.copy_(r)
        elif p.dim() == 3:
            p.copy_(r / p.shape[2] ** 0.5)
        elif p.dim() == 2:
            p.copy_(r / p.shape[1] ** 0.5)
        else:
            raise AssertionError(f"no hot-init rule for {n} {tuple(p.shape)}")


def build_model(arch: str, seed: int = 0) -> Any:
    with _quiet():
        cfg = CONFIGS[arch]()
        torch.manual_seed(seed)
        model = _auto(arch).from_config(cfg, attn_implementation="eager", dtype=torch.float32,
                                        experts_implementation="eager")
    model.eval()
    _reinit_hot(model, seed)
    return model


def build_checkpoint(arch: str, layout: str, out_dir: Path, seed: int = 0) -> Path:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=False)
    model = build_model(arch, seed)
    with _quiet():
        model.save_pretrained(out_dir, save_original_format=(layout == "per_expert"))
    return out_dir


def load_model(model_dir: Path) -> Any:
    model_dir = Path(model_dir)
    with _quiet():
        config = AutoConfig.from_pretrained(model_dir)
    return oracle.load_complete(_auto(config.model_type), model_dir, config=config, experts_implementation="eager")


@torch.inference_mode()
def reference_run(model_dir: Path, prompt_ids: list[int], n_decode: int = 8) -> Reference:
    """One prefill over the prompt, then ``n_decode`` greedy steps on the same cache (see ``oracle.Reference``)."""
    model = load_model(model_dir)
    vocab = model.config.get_text_config().vocab_size
    with _quiet():
        cache = DynamicCache(config=model.config)
        logits = model(input_ids=torch.tensor([prompt_ids]), cache=cache, use_cache=True).logits[0].float()
        prefill, last = logits, logits[-1]
        toks, dec, margins = [], [], []
        for _ in range(n_decode):
            tok = int(torch.argmax(last))
            toks.append(tok)
            margins.append(oracle._top2_gap(last))
            last = model(input_ids=torch.tensor([[tok]]), cache=cache, use_cache=True).logits[0, -1].float()
            dec.append(last)
        if cache.get_seq_length() != len(prompt_ids) + n_decode:
            raise AssertionError("cache length mismatch")
    margins.append(oracle._top2_gap(last))
    return Reference(
        prompt_ids=list(prompt_ids),
        prefill_logits=prefill.numpy().astype(np.float32),
        decode_logits=torch.stack(dec).numpy().astype(np.float32) if dec else np.zeros((0, vocab), np.float32),
        decode_tokens=toks,
        greedy_tokens=toks + [int(torch.argmax(last))],
        greedy_margins=np.asarray(margins, np.float32),
        model_type=json.loads((Path(model_dir) / "config.json").read_text())["model_type"],
    )
