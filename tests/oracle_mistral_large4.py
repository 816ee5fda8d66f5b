"""Test-side oracle for Mistral Large 4 (``mistral_large4``): a tiny hot-initialised checkpoint built by
transformers 5.24 (``MistralLarge4ForConditionalGeneration``: the text model plus a one-layer Pixtral
vision tower, which the engine ignores) and reference logits from transformers (fp32, eager attention,
eager experts).  Test-only (imports torch + transformers); reuses ``oracle.py``'s prompt and reference run.

``TEXT`` switches every mechanism on (``tests/mistral_large4/test_mistral_large4_oracle.py`` switches
each off): vocab 512, hidden 64, 4 heads, MLA without a q LoRA (``kv_lora_rank=16``,
``qk_nope_head_dim=8``, ``qk_rope_head_dim=8``, ``v_head_dim=16``), four layers:

* ``no_rope_layers`` 1, 1, 0, 0: layers 2 and 3 are NoPE (their whole 16-wide qk head is "nope");
* ``kv_source_layers`` 0, 0, 2, 2: layer 1 attends over layer 0's latent KV, layer 3 over layer 2's
  (neither has a ``kv_a``);
* ``indexer_types`` full, shared, full, full: layer 1 reuses layer 0's top-k; 16 indexer heads of 16,
  ``index_topk=6`` (below the 16-token prompt: the indexer decides);
* YaRN factor 4 over 8 positions (``attention_factor`` 1) and LeRoPE ``alpha`` ~ 0.5 N (``_reinit``);
  ssmax ``s`` ~ 0.5 N, ``b`` ~ 1 + 0.2 N, the attention's and the indexer's;
* ``final_logit_softcapping=3`` (the hot logits reach well past it);
* layer 0 dense (128 wide), layers 1-3 MoE: 16 experts (32 wide) top-4 by softmax in ``n_group=4``
  groups of which ``topk_group=2`` compete, ``routed_scaling_factor=2.5``, one shared expert.

Layouts: ``packed`` is ``save_pretrained``'s runtime format (``model.language_model.layers.L.self_attn.
q_proj.weight``, ``mlp.experts.gate_up_proj``); ``native`` its original format
(``save_original_format=True``): the hub's Mistral names (``tok_embeddings``, ``layers.L.attention.wq``,
``wkv_a_with_mqa``, ``feed_forward.w1``, ``experts.E.w1``, ``ssmax_scaling.s``, ``lerope.alpha``,
``output``, ``vision_encoder.*``), which transformers loads back through ``conversion_mapping.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import oracle
import torch
from oracle import PROMPT, Reference, _quiet, run_model  # noqa: F401  (re-exported)
from transformers import MistralLarge4Config, MistralLarge4ForConditionalGeneration

LAYOUTS = ("packed", "native")

TEXT: dict[str, Any] = dict(
    vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=4,
    max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5,
    intermediate_size=128, moe_intermediate_size=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
    v_head_dim=16, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
    first_k_dense_replace=1, routed_scaling_factor=2.5, index_topk=6, index_head_dim=16, index_n_heads=16,
    no_rope_layers=[1, 1, 0, 0], kv_source_layers=[0, 0, 2, 2], indexer_types=["full", "shared", "full", "full"],
    final_logit_softcapping=3.0, tie_word_embeddings=False,
    rope_parameters=dict(rope_type="yarn", rope_theta=10_000.0, factor=4.0, original_max_position_embeddings=64,
                         beta_fast=32.0, beta_slow=1.0, attention_factor=1.0),
)
VISION: dict[str, Any] = dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                              num_attention_heads=2, head_dim=8, patch_size=4, image_size=16)


def CONFIG() -> MistralLarge4Config:
    with _quiet():
        return MistralLarge4Config(text_config=dict(TEXT), vision_config=dict(VISION), tie_word_embeddings=False)


@torch.no_grad()
def _reinit(model: Any, seed: int) -> None:
    """Every parameter from a generator seeded with ``seed``: ``oracle.reinit_hot``'s rules, plus LeRoPE's
    ``alpha`` (0.5 N), ssmax's ``scale`` (0.5 N) and ``bias`` (1 + 0.2 N), the vision tower's 1-D tensors
    (1 + 0.1 N) and its patch convolution."""
    g = torch.Generator().manual_seed(seed)

    def randn(p: torch.Tensor) -> torch.Tensor:
        return torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype)

    for n, p in model.named_parameters():
        if n.endswith(("rotary_emb.alpha", "softmax_scaling.scale")):
            p.copy_(0.5 * randn(p))
        elif n.endswith("softmax_scaling.bias"):
            p.copy_(1 + 0.2 * randn(p))
        elif n.endswith("norm.weight") or "layernorm" in n:
            p.copy_(1 + 0.1 * randn(p))
        elif n.endswith("bias"):
            p.copy_(0.1 * randn(p))
        elif "embed_tokens" in n:
            p.copy_(randn(p))
        elif p.dim() == 3:
            p.copy_(randn(p) / p.shape[2] ** 0.5)
        elif p.dim() == 2:
            p.copy_(randn(p) / p.shape[1] ** 0.5)
        elif p.dim() > 3:
            p.copy_(randn(p) / p[0].numel() ** 0.5)
        else:
            p.copy_(1 + 0.1 * randn(p))


def build_model(seed: int = 0) -> Any:
    with _quiet():
        torch.manual_seed(seed)
        model = MistralLarge4ForConditionalGeneration._from_config(
            CONFIG(), attn_implementation="eager", dtype=torch.float32, experts_implementation="eager")
    model.eval()
    _reinit(model, seed)
    return model


def build_checkpoint(layout: str, out_dir: Path, seed: int = 0) -> Path:
    """The model saved as ``packed`` (transformers' names) or ``native`` (the hub's Mistral names)."""
    return oracle.save_in_layout(lambda: build_model(seed), {"packed": "packed", "native": "per_expert"}[layout],
                                 out_dir)


def load(folder: Path) -> Any:
    """The checkpoint as transformers loads it (fp32, eager), refusing an incomplete load."""
    return oracle.load_complete(MistralLarge4ForConditionalGeneration, folder, experts_implementation="eager")


def reference_run(folder: Path, prompt: list[int], n_decode: int = 8) -> Reference:
    return run_model(load(folder), prompt, n_decode)
