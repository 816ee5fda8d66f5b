"""Test-side oracle for Kimi Linear (``kimi_linear``): a tiny hot-initialised checkpoint built by
transformers 5.24 and reference logits from transformers (fp32, eager attention and experts).
Test-only; reuses ``oracle.py``'s prompt, hot init, loader and reference run.

The config (``CONFIG``): vocab 512, hidden 64, 3 layers (``layer_types`` linear, full, linear; layer 0
dense 48 wide, the others MoE: 8 experts 32 wide, top-2, sigmoid scores with the correction bias, 2
groups of which 1 competes, ``routed_scaling_factor`` 2.446, one shared expert); full layers are MLA
without RoPE (4 heads, kv rank 16, nope 16 + "rope" 8 unrotated, v 16, no q LoRA); delta-attention
(KDA) layers have 4 heads of 16, a causal convolution of width 4, the per-channel forget gate
(``A_log`` gets ``reinit_hot``'s -2 + 0.5 noise: a long memory) and the gated output norm.

Layouts: ``per_expert`` is ``save_pretrained`` (the hub's ``block_sparse_moe.experts.E.w1/w2/w3``,
``q/k/v_conv1d`` and the forget gate's tensors on ``self_attn``), ``packed`` is
``save_original_format=False`` (``mlp.experts.gate_up_proj``, one ``conv1d``, ``self_attn.forget_gate.*``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import oracle
from oracle import PROMPT, Reference, _quiet, load_model, reference_run  # noqa: F401  (re-exported)
from transformers import KimiLinearConfig

LAYOUTS = ("per_expert", "packed")


def CONFIG() -> KimiLinearConfig:  # noqa: N802 - a config factory, as oracle_families.CONFIGS
    return KimiLinearConfig(
        vocab_size=512, hidden_size=64, intermediate_size=48, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, routed_scaling_factor=2.446,
        kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=2,
        topk_group=1, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256, rms_norm_eps=1e-5,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, num_local_experts=8,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        mlp_layer_types=["dense", "sparse", "sparse"], linear_head_dim=16, linear_num_heads=4, linear_conv_kernel_dim=4,
    )


def build_model(seed: int = 0) -> Any:
    return oracle.build_from_config(CONFIG, seed)


def build_checkpoint(layout: str, out_dir: Path, seed: int = 0) -> Path:
    return oracle.save_in_layout(lambda: build_model(seed), layout, out_dir)
