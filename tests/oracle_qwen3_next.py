"""Test-side oracle for Qwen3-Next (``qwen3_next``): a tiny hot-initialised checkpoint built by
transformers 5.24 from ``CONFIG``, and reference logits from transformers (fp32, eager attention,
eager experts).  Test-only (imports torch + transformers); reuses ``oracle.py``'s hot init
(``reinit_hot``), loader and reference run.

The config (vocab 512, hidden 64, fp32) is chosen so that every mechanism moves the logits
(``tests/qwen3next/test_qwen3_next_oracle.py`` switches each one off in the engine and sees them move):
3 layers, ``layer_types`` linear, full, linear; DeltaNet with 2 key heads and 4 value heads of 16
dims (two value heads per key head, so the per-key-head grouping of ``in_proj_qkvz`` /
``in_proj_ba`` matters), conv kernel 4; gated full attention with 4 heads, 2 kv heads,
``head_dim`` 32 (!= hidden / heads), partial rotary 0.25 (8 of 32 channels turn);
``mlp_only_layers=[1]`` (layer 1 a dense 96-wide MLP); 8 experts top-2 with
``norm_topk_prob=False`` (not the default, so the engine must read it) and a sigmoid-gated
48-wide shared expert.  The prompt is ``PROMPT_LEN`` (80) tokens: longer than one 64-token
DeltaNet prefill chunk.

Layouts: ``per_expert`` is ``save_pretrained`` (hub names ``mlp.experts.E.{gate,up,down}_proj``),
``packed`` is ``save_original_format=False`` (transformers' runtime ``gate_up_proj [E, 2I, H]``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import oracle
import torch
from oracle import Reference, _quiet, reference_run  # noqa: F401  (re-exported)
from transformers import AutoModelForCausalLM, Qwen3NextConfig

LAYOUTS = ("per_expert", "packed")
PROMPT_LEN = 80
PROMPT = [int(t) for t in np.random.default_rng(7).integers(3, 512, PROMPT_LEN)]


def make_config() -> Qwen3NextConfig:
    return Qwen3NextConfig(
        vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-6,
        tie_word_embeddings=False, num_hidden_layers=3,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4,
        intermediate_size=96, mlp_only_layers=[1], moe_intermediate_size=32, shared_expert_intermediate_size=48,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
        rope_parameters=dict(rope_type="default", rope_theta=10_000.0, partial_rotary_factor=0.25),
    )


def build_model(seed: int = 0) -> Any:
    with _quiet():
        cfg = make_config()
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32,
                                                 experts_implementation="eager")
    model.eval()
    oracle.reinit_hot(model, seed)
    return model


def build_checkpoint(layout: str, out_dir: Path, seed: int = 0) -> Path:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=False)
    model = build_model(seed)
    with _quiet():
        model.save_pretrained(out_dir, save_original_format=(layout == "per_expert"))
    return out_dir
