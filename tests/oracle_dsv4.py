"""Test-side oracle for DeepSeek-V4 (``deepseek_v4``): a tiny hot-initialised checkpoint built by
transformers 5.24 and its reference logits (fp32, eager).  Test-only (imports torch + transformers);
reuses ``oracle.py``'s prompt and reference run.

``CONFIG`` switches every mechanism on (``tests/deepseek_v4/test_dsv4_oracle.py`` switches each off):
vocab 512, hidden 64, 4 query heads of 32 sharing one K=V head (the last 8 channels rotated,
interleaved), q LoRA 32, five layers:

* ``layer_types``: sliding, compressed sparse (CSA, every 4 tokens, an indexer of 4 heads of 16
  keeping the best 3 compressed entries), heavily compressed (HCA, every 8 tokens), CSA, HCA; the
  sliding window is 6 tokens (the 16-token prompt and 8 decode steps cross it);
  the compressed layers rotate with ``compress_rope_theta`` and YaRN (factor 4 over 64), the sliding
  layer with ``rope_theta``; per-head attention sinks; grouped output LoRA (2 groups, rank 16);
* ``mlp_layer_types``: hash_moe, hash_moe, moe, moe, moe: 8 experts 32 wide, top-2, ``sqrtsoftplus``
  scores, ``routed_scaling_factor`` 1.5, a shared expert; ``swiglu_limit`` 0.5 clamps experts and the
  shared expert; ``tid2eid`` a random table of 2 distinct experts per token id;
* hyper-connections: ``hc_mult`` 3 residual streams, 6 Sinkhorn iterations.

Layouts: ``per_expert`` is ``save_pretrained``'s original format (DeepSeek's own names, as the hub
stores V4: ``layers.L.attn.wq_a.weight``, ``layers.L.ffn.experts.E.w1.weight``, ...); ``packed`` is
transformers' runtime layout (``model.layers.L.self_attn.q_a_proj.weight``,
``mlp.experts.gate_up_proj``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import oracle
import torch
from oracle import PROMPT, Reference, _quiet, run_model
from transformers import AutoModelForCausalLM, DeepseekV4Config

LAYOUTS = ("per_expert", "packed")

CONFIG_FIELDS: dict[str, Any] = dict(
    vocab_size=512, hidden_size=64, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
    q_lora_rank=32, partial_rotary_factor=0.25, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
    n_shared_experts=1, scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, max_position_embeddings=256,
    rope_theta=10_000.0, compress_rope_theta=160_000.0,
    rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, beta_fast=32.0,
                         beta_slow=1.0),
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                 "compressed_sparse_attention", "heavily_compressed_attention"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe"],
    hc_mult=3, hc_sinkhorn_iters=6, hc_eps=1e-6, swiglu_limit=0.5, sliding_window=6, o_groups=2, o_lora_rank=16,
    index_n_heads=4, index_head_dim=16, index_topk=3, num_nextn_predict_layers=0, rms_norm_eps=1e-6,
    pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
)


def CONFIG() -> DeepseekV4Config:
    return DeepseekV4Config(**CONFIG_FIELDS)


@torch.no_grad()
def _reinit(model: Any, seed: int) -> None:
    """``oracle.reinit_hot``'s rules plus V4's own tensors: hyper-connection bases and scales
    (``base``/``hc_base`` 0.1 N, ``scale``/``hc_scale`` 1 + 0.3 N) and the hash table (2 distinct
    experts per token id)."""
    g = torch.Generator().manual_seed(seed + 1)
    held = {}
    for n, p in model.named_parameters():
        if n.endswith((".base", ".hc_base")):
            held[n] = 0.1 * torch.randn(p.shape, generator=g)
        elif n.endswith((".scale", ".hc_scale")):
            held[n] = 1 + 0.3 * torch.randn(p.shape, generator=g)
    for n, b in model.named_buffers():
        if n.endswith("tid2eid"):
            E, k = model.config.n_routed_experts, b.shape[1]
            held[n] = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(b.shape[0])])
    saved = {n: p.data.clone() for n, p in list(model.named_parameters()) + list(model.named_buffers()) if n in held}
    for n, p in list(model.named_parameters()) + list(model.named_buffers()):
        if n in held:  # keep reinit_hot from seeing a shape it has no rule for
            p.data = torch.zeros((1, 1), dtype=torch.float32)
    oracle.reinit_hot(model, seed)
    for n, p in list(model.named_parameters()) + list(model.named_buffers()):
        if n in held:
            p.data = held[n].to(saved[n].dtype)


def build_model(seed: int = 0) -> Any:
    with _quiet():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(CONFIG(), attn_implementation="eager", dtype=torch.float32,
                                                 experts_implementation="eager")
    model.eval()
    _reinit(model, seed)
    return model


def build_checkpoint(layout: str, out_dir: Path, seed: int = 0) -> Path:
    return oracle.save_in_layout(lambda: build_model(seed), layout, out_dir)


def load(folder: Path) -> Any:
    """The checkpoint as transformers loads it (fp32, eager), refusing an incomplete load."""
    return oracle.load_complete(AutoModelForCausalLM, folder, experts_implementation="eager")


def reference_run(folder: Path, prompt: list[int], n_decode: int = 8) -> Reference:
    return run_model(load(folder), prompt, n_decode)
