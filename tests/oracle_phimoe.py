"""Test-side oracle for PhiMoE (``phimoe``, Phi-3.5-MoE): a tiny hot-initialised checkpoint built by
transformers 5.24 and reference logits from transformers (fp32, eager attention and experts).
Test-only; reuses ``oracle.py``'s prompt, hot init, loader and reference run.

The config (``CONFIG``): vocab 512, hidden 64, 4 heads (2 kv heads), 2 layers, 8 experts (32 wide),
chosen so that every mechanism moves the logits: ``router_jitter_noise=0.4`` (sparsemixer's softmax
then spans several experts), q/k/v/o biases, LM-head bias, ``sliding_window=6`` (shorter than the
16-token prompt), ``longrope`` with short factors between 1 and 4, ``short_mscale`` 1.3 and
``long_mscale`` 1.7 and ``original_max_position_embeddings`` 32 (beyond the 24 tokens of a reference
run: the long scale only in ``chunked_run`` on a copy with a shorter original length).  LayerNorm
weights and biases get ``oracle.reinit_hot``'s 1 + 0.1 noise (the final norm's bias 0.1 noise).

Layouts: ``per_expert`` is ``save_pretrained`` (the hub's ``block_sparse_moe.experts.E.w1/w2/w3`` and
``gate``), ``packed`` is ``save_original_format=False`` (``mlp.experts.gate_up_proj`` / ``mlp.router``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import oracle
import torch
from oracle import PROMPT, Reference, _quiet, load_model, reference_run  # noqa: F401  (re-exported)
from transformers import DynamicCache, PhimoeConfig

LAYOUTS = ("per_expert", "packed")
HEAD_DIM = 16
SHORT_FACTOR = [1.0 + 3.0 * i / (HEAD_DIM // 2 - 1) for i in range(HEAD_DIM // 2)]
LONG_FACTOR = [2.0] * (HEAD_DIM // 2)  # never read by transformers 5.24's PhiMoE


def CONFIG() -> PhimoeConfig:  # noqa: N802 - a config factory, as oracle_families.CONFIGS
    return PhimoeConfig(
        vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=False, sliding_window=6, num_local_experts=8, num_experts_per_tok=2,
        router_jitter_noise=0.4, attention_bias=True, lm_head_bias=True,
        rope_parameters=dict(rope_type="longrope", rope_theta=10_000.0, short_factor=SHORT_FACTOR,
                             long_factor=LONG_FACTOR, short_mscale=1.3, long_mscale=1.7,
                             original_max_position_embeddings=32),
    )


def build_model(seed: int = 0) -> Any:
    return oracle.build_from_config(CONFIG, seed)


def build_checkpoint(layout: str, out_dir: Path, seed: int = 0) -> Path:
    return oracle.save_in_layout(lambda: build_model(seed), layout, out_dir)


@torch.inference_mode()
def chunked_run(folder: Path, ids: list[int], chunk: int) -> np.ndarray:
    """transformers' logits [len(ids), V] for ``ids`` fed ``chunk`` tokens per pass over one cache
    (each pass picks its own cos/sin scale, so this differs from one whole prefill)."""
    model = load_model(folder)
    with _quiet():
        cache = DynamicCache(config=model.config)
        out = [model(input_ids=torch.tensor([ids[i : i + chunk]]), cache=cache, use_cache=True).logits[0]
               for i in range(0, len(ids), chunk)]
    return torch.cat(out).float().numpy()


def sparsemixer_spread(folder: Path) -> float:
    """Mean number of experts inside the first choice's softmax (the ones sparsemixer does not mask),
    over the reference prompt's tokens and both layers: above 1 means the jitter window matters."""
    model = load_model(folder)
    counts: list[float] = []

    def hook(module: Any, args: Any, out: Any) -> None:
        logits = out[0]
        top = logits.max(dim=-1, keepdim=True).values
        near = (top - logits) / logits.abs().clamp(min=top) <= 2 * module.router_jitter_noise
        counts.append(float(near.sum(dim=-1).float().mean()))

    hooks = [layer.mlp.router.register_forward_hook(hook) for layer in model.model.layers]
    try:
        with torch.inference_mode(), _quiet():
            model(input_ids=torch.tensor([PROMPT]), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return float(np.mean(counts))
