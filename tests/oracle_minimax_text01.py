"""Test-side oracle for MiniMax-Text-01 (``minimax``): a tiny hot-initialised checkpoint built by
transformers 5.24 and reference logits from transformers (fp32, eager attention and experts).
Test-only; reuses ``oracle.py``'s prompt, hot init, loader and reference run.

The config (``CONFIG``): vocab 512, hidden 64, 4 heads of 16 (2 kv heads on softmax layers), 4 layers
(``layer_types`` full, linear, full, linear), 8 experts 32 wide top-2; lightning attention in blocks of
4 tokens (``block_size``: transformers' prefill of the 16-token prompt runs 4 blocks), residual factors
``full_attn`` (1.7, 0.8), ``linear_attn`` (1.3, 0.9), ``mlp`` (1.5, 0.7) (alpha, beta).

Layouts: ``per_expert`` is ``save_pretrained`` (the hub's ``block_sparse_moe.experts.E.w1/w2/w3``),
``packed`` is ``save_original_format=False`` (``mlp.experts.gate_up_proj`` / ``down_proj``).  Both
store the lightning layers' persistent decay buffers (``slope_rate`` and the three derived from it:
the engine computes the decay from the layer and head count instead).

``reference_run`` is ``oracle.run_model`` with transformers' own ``MiniMaxCache`` (MiniMax refuses a
``DynamicCache``: its lightning layers keep their state beside the keys and values).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import oracle
import torch
from oracle import PROMPT, Reference, _quiet, load_model  # noqa: F401  (re-exported)
from transformers import MiniMaxConfig
from transformers.models.minimax.modeling_minimax import MiniMaxCache

LAYOUTS = ("per_expert", "packed")


def CONFIG() -> MiniMaxConfig:  # noqa: N802 - a config factory, as oracle_families.CONFIGS
    return MiniMaxConfig(
        vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, num_local_experts=8, num_experts_per_tok=2,
        layer_types=["full_attention", "linear_attention", "full_attention", "linear_attention"], block_size=4,
        full_attn_alpha_factor=1.7, full_attn_beta_factor=0.8, linear_attn_alpha_factor=1.3,
        linear_attn_beta_factor=0.9, mlp_alpha_factor=1.5, mlp_beta_factor=0.7,
        rope_parameters=dict(rope_type="default", rope_theta=10_000.0),
    )


def build_model(seed: int = 0) -> Any:
    """``oracle.reinit_hot`` overwrites every persistent buffer with noise, the lightning layers' decay
    buffers too; they are functions of the layer and head count, so they are computed again here."""
    model = oracle.build_from_config(CONFIG, seed)
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            if hasattr(attn, "slope_rate"):
                slope = attn.get_slope_rate()
                attn.slope_rate.copy_(slope)
                for buffer, value in zip((attn.query_decay, attn.key_decay, attn.diagonal_decay),
                                         attn.decay_factors(slope)):
                    buffer.copy_(value)
    return model


def build_checkpoint(layout: str, out_dir: Path, seed: int = 0) -> Path:
    return oracle.save_in_layout(lambda: build_model(seed), layout, out_dir)


def reference_run(model_dir: Path, prompt_ids: list[int], n_decode: int = 8) -> Reference:
    model = load_model(model_dir)
    plain = oracle.DynamicCache
    oracle.DynamicCache = lambda config=None: MiniMaxCache()  # what run_model builds its cache with
    try:
        return oracle.run_model(model, prompt_ids, n_decode)
    finally:
        oracle.DynamicCache = plain
