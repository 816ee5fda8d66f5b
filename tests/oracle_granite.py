"""Test-side oracle for Granite MoE (``granitemoe``) and Granite MoE shared (``granitemoeshared``): tiny
hot-initialised checkpoints built by transformers 5.24, reference logits from transformers (fp32, eager
attention, eager experts).  Test-only; reuses ``oracle.py``'s prompt, hot init, loader and reference run.

Configs (``CONFIGS``): vocab 512, hidden 64, 4 heads (2 kv heads), 2 layers, 8 experts (32 wide) top-2,
chosen so that every mechanism moves the logits: ``embedding_multiplier=6``, ``attention_multiplier=0.1``
(not 1/sqrt(16)), ``residual_multiplier=0.4``, ``logits_scaling=3``, q/k/v/o biases, tied embeddings
(Granite 3's); ``granitemoeshared`` adds a shared MLP 48 wide.

Layouts: ``per_expert`` is ``save_pretrained`` (the hub's ``input_linear`` / ``output_linear`` /
``router.layer``), ``packed`` is ``save_original_format=False`` (transformers' runtime names).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import oracle
from oracle import PROMPT, Reference, _quiet, reference_run  # noqa: F401  (re-exported)
from transformers import GraniteMoeConfig, GraniteMoeSharedConfig

ARCHS = ("granitemoe", "granitemoeshared")
LAYOUTS = ("per_expert", "packed")

_TEXT: dict[str, Any] = dict(
    vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
    intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=256, pad_token_id=0,
    bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5, tie_word_embeddings=True, attention_bias=True,
    embedding_multiplier=6.0, attention_multiplier=0.1, residual_multiplier=0.4, logits_scaling=3.0,
    rope_parameters=dict(rope_type="default", rope_theta=10_000.0),
)
CONFIGS: dict[str, Any] = {
    "granitemoe": lambda: GraniteMoeConfig(**_TEXT),
    "granitemoeshared": lambda: GraniteMoeSharedConfig(**_TEXT, shared_intermediate_size=48),
}


def build_model(arch: str, seed: int = 0) -> Any:
    return oracle.build_from_config(CONFIGS[arch], seed)


def build_checkpoint(arch: str, layout: str, out_dir: Path, seed: int = 0) -> Path:
    return oracle.save_in_layout(lambda: build_model(arch, seed), layout, out_dir)
