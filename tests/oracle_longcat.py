"""Test-side oracle for LongCat-Flash (``longcat_flash``): a tiny hot-initialised checkpoint built by
transformers 5.24 and reference logits from transformers (fp32, eager attention and experts).
Test-only; reuses ``oracle.py``'s prompt, hot init, loader and reference run.

The config (``CONFIG``): vocab 512, hidden 64, 4 heads, 2 logical layers (each two MLA sublayers and
two dense MLPs 48 wide, and one MoE shortcut), MLA with ``q_lora_rank`` 32 and ``kv_lora_rank`` 16
(so the LoRA scales sqrt(64/32) and sqrt(64/16) matter), nope 16 + rope 8, v 16; 8 routed experts
(24 wide) and 4 zero-computation experts, top-3, ``routed_scaling_factor`` 2.5; the
``e_score_correction_bias`` gets ``reinit_hot``'s 0.1 noise (it moves choices).  The hot init
(every matrix noise / sqrt(fan in)) leaves the zero experts' logits as likely as the routed ones', so
a good share of choices are zero-computation (``zero_share``).

Layouts: ``per_expert`` is ``save_pretrained`` (``mlp.experts.E.{gate,up,down}_proj``), ``packed`` is
``save_original_format=False`` (``mlp.experts.gate_up_proj [E + Z, 2I, H]``: transformers allocates
gate/up rows for the zero experts too, never read; ``down_proj [E, H, I]``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import oracle
import torch
from oracle import PROMPT, Reference, _quiet, load_model, reference_run  # noqa: F401  (re-exported)
from transformers import LongcatFlashConfig

LAYOUTS = ("per_expert", "packed")


def CONFIG() -> LongcatFlashConfig:  # noqa: N802 - a config factory, as oracle_families.CONFIGS
    return LongcatFlashConfig(
        vocab_size=512, hidden_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=256, rms_norm_eps=1e-5, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False, ffn_hidden_size=48, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, head_dim=8, v_head_dim=16, moe_topk=3, n_routed_experts=8, zero_expert_num=4,
        expert_ffn_hidden_size=24, routed_scaling_factor=2.5,
        rope_parameters=dict(rope_type="default", rope_theta=10_000.0),
    )


def build_model(seed: int = 0) -> Any:
    return oracle.build_from_config(CONFIG, seed)


def build_checkpoint(layout: str, out_dir: Path, seed: int = 0) -> Path:
    return oracle.save_in_layout(lambda: build_model(seed), layout, out_dir)


def zero_share(folder: Path) -> float:
    """The share of routing choices (prompt tokens x top-k x layers) that transformers gives to
    zero-computation experts: strictly between 0 and 1 means both kinds are exercised."""
    model = load_model(folder)
    picked: list[torch.Tensor] = []

    def hook(module: Any, args: Any, out: Any) -> None:
        picked.append(out[2].reshape(-1))

    hooks = [layer.mlp.router.register_forward_hook(hook) for layer in model.model.layers]
    try:
        with torch.inference_mode(), _quiet():
            model(input_ids=torch.tensor([PROMPT]), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    ids = torch.cat(picked)
    return float((ids >= model.config.n_routed_experts).float().mean())
