"""Test-side oracle for Mistral Small 4 (``mistral4``): a tiny hot-initialised checkpoint built by
transformers 5.24, and reference logits from transformers (fp32, eager attention, eager experts).
Test-only (imports torch + transformers); reuses ``oracle.py``'s prompt, hot init and reference run.

The config (``CONFIG``): vocab 512, hidden 64, 4 heads, 3 layers, chosen so that every mechanism moves
the logits (``tests/mistral4/test_mistral4_oracle.py`` switches each off): MLA with ``q_lora_rank=32``,
``kv_lora_rank=16``, ``qk_nope_head_dim=8``, ``qk_rope_head_dim=8`` (interleaved), ``v_head_dim=16``;
YaRN ``factor=4`` from ``original_max_position_embeddings=4`` with ``mscale_all_dim=1`` (a softmax
scale of (1 + 0.1 ln 4)^2 / sqrt(16)); ``llama_4_scaling_beta=0.5`` over that length of 4 (query scales
1 ... 1.9 over 24 positions); layer 0 dense (``first_k_dense_replace=1``, 128 wide), layers 1-2 MoE:
16 experts (32 wide) top-4 by softmax in ``n_group=4`` groups of which ``topk_group=2`` compete,
``norm_topk_prob``, ``routed_scaling_factor=2.5``, one shared expert.

transformers 5.24's Auto classes do not list ``mistral4``: the model is built and loaded as
``Mistral4ForCausalLM``.  Layout: transformers has one for this family (no conversion mapping): ``gate_up_proj [E, 2I, H]``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import oracle
import torch
from oracle import PROMPT, Reference, _quiet, run_model  # noqa: F401  (re-exported)
from transformers import Mistral4Config, Mistral4ForCausalLM

ROPE: dict[str, Any] = dict(rope_type="yarn", rope_theta=10_000.0, factor=4.0, original_max_position_embeddings=4,
                            beta_fast=32.0, beta_slow=1.0, mscale_all_dim=1.0, mscale=1.0, llama_4_scaling_beta=0.5,
                            partial_rotary_factor=0.5)


def CONFIG() -> Mistral4Config:  # noqa: N802 - a config factory, as oracle_families.CONFIGS
    return Mistral4Config(
        vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=3,
        max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5,
        intermediate_size=128, moe_intermediate_size=32, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
        n_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5,
        tie_word_embeddings=False, rope_parameters=dict(ROPE),
    )


def build_model(seed: int = 0) -> Any:
    with _quiet():
        torch.manual_seed(seed)
        model = Mistral4ForCausalLM._from_config(CONFIG(), attn_implementation="eager", dtype=torch.float32,
                                                 experts_implementation="eager")
    model.eval()
    oracle.reinit_hot(model, seed)
    return model


def build_checkpoint(out_dir: Path, seed: int = 0) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=False)
    model = build_model(seed)
    with _quiet():
        model.save_pretrained(out_dir)
    return out_dir


def reference_run(folder: Path, prompt: list[int], n_decode: int = 8) -> Reference:
    """Load ``folder`` with transformers (fp32, eager, refusing an incomplete load) and run the reference."""
    return run_model(oracle.load_complete(Mistral4ForCausalLM, folder, experts_implementation="eager"), prompt, n_decode)
