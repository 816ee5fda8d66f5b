"""Test-side oracle for DBRX (``dbrx``): a tiny hot-initialised checkpoint built by transformers 5.24 and
reference logits from transformers (fp32, eager).  Test-only; reuses ``oracle.py``'s prompt, hot init,
loader and reference run.

The config (``CONFIG``): vocab 512, ``d_model`` 64, 4 heads (``kv_n_heads`` 2), 2 layers,
``clip_qkv=0.5`` (the hot projections exceed it), 8 experts (32 wide) top-2 renormalised
(``moe_normalize_expert_weights=1``).  ``reinit_hot`` is ``oracle.reinit_hot``'s rule for DBRX's names
(``norm_1`` / ``norm_2`` / ``norm_f``: 1 + 0.1 noise; matrices, the flat experts included: noise / sqrt(fan in)).
DBRX has one layout: the flat ``w1`` / ``v1`` / ``w2`` ``[E * I, H]`` of the hub, which transformers keeps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from oracle import PROMPT, Reference, _quiet, reference_run  # noqa: F401  (re-exported)
from transformers import AutoModelForCausalLM, DbrxConfig


def CONFIG() -> DbrxConfig:  # noqa: N802 - a config factory, as oracle_families.CONFIGS
    return DbrxConfig(
        d_model=64, n_heads=4, n_layers=2, max_seq_len=256, vocab_size=512, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=False,
        attn_config=dict(kv_n_heads=2, clip_qkv=0.5, rope_theta=10_000.0),
        ffn_config=dict(ffn_hidden_size=32, moe_num_experts=8, moe_top_k=2, moe_normalize_expert_weights=1.0),
    )


def build_model(seed: int = 0) -> Any:
    with _quiet():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(CONFIG(), attn_implementation="eager", dtype=torch.float32,
                                                 experts_implementation="eager")
    model.eval()
    reinit_hot(model, seed)
    return model


@torch.no_grad()
def reinit_hot(model: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
        if p.dim() == 1:  # the LayerNorm weights
            p.copy_(1 + 0.1 * noise)
        elif "wte" in name:
            p.copy_(noise)
        else:
            p.copy_(noise / p.shape[1] ** 0.5)


def build_checkpoint(out_dir: Path, seed: int = 0) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=False)
    model = build_model(seed)
    with _quiet():
        model.save_pretrained(out_dir)
    return out_dir
