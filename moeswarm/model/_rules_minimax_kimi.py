"""Checkpoint-key rules for MiniMax M2, MiniMax M3 and Kimi K2.5 (see ``convert.py`` for ``Rule``).

The two vision-language checkpoints keep their language model under a prefix:
``language_model.model.layers.*`` / ``language_model.lm_head`` as published (and as
``save_pretrained`` writes them), ``model.language_model.layers.*`` / ``lm_head`` in transformers'
runtime layout.  transformers 5.24 saves Kimi K2.5's layers as ``language_model.model.blocks.*``
(its load-time rename ``blocks -> layers`` runs backwards on save); that is read too.  Every other
key (``vision_tower.*``, ``mm_projector.*``, ``multi_modal_projector.*``, ``patch_merge_mlp.*``)
matches no rule, so it is left unmatched and its bytes are never touched.

MiniMax-specific keys:

* ``block_sparse_moe.e_score_correction_bias`` (hub), ``mlp.e_score_correction_bias`` (M2 packed),
  ``mlp.gate.e_score_correction_bias`` (M3 packed): the router's score-correction bias.
* M3 dense layers and shared experts: ``gate_proj``/``up_proj``/``down_proj`` on the hub,
  one ``gate_up_proj [2I, H]`` (gate rows first) in the runtime layout.
* M3 lightning indexer: ``self_attn.index_{q,k}_{proj,norm}`` on the hub,
  ``self_attn.indexer.{q,k}_{proj,norm}`` in the runtime layout.
"""

from __future__ import annotations

from .convert import _BACKBONE, _PACKED, _PER_EXPERT, RULES, Rule, chunk

_VL_MODEL = r"(?:language_model\.model|model\.language_model|model)\."
_VL_HEAD = r"(?:language_model\.)?lm_head\.weight"


def _vision_language(rules: tuple[Rule, ...]) -> tuple[Rule, ...]:
    """The same rules with the language model's key prefixes."""
    out = []
    for r in rules:
        pattern = r.pattern
        if pattern.startswith(r"model\."):
            pattern = _VL_MODEL + pattern[len(r"model\.") :].replace(r"layers\.", r"(?:layers|blocks)\.", 1)
        elif pattern == r"lm_head\.weight":
            pattern = _VL_HEAD
        out.append(Rule(pattern, r.target, r.ops))
    return tuple(out)


_L = r"model\.layers\.(?P<L>\d+)\."
_SCORE_BIAS = (
    Rule(_L + r"(?:block_sparse_moe|mlp)\.e_score_correction_bias", "{L}.router_score_bias"),
)
_M3 = _SCORE_BIAS + (
    Rule(_L + r"block_sparse_moe\.shared_experts\.(?P<p>gate|up|down)_proj\.weight", "{L}.shared.{p}"),
    Rule(_L + r"mlp\.shared_experts\.gate_up_proj\.weight", "{L}.shared.{p}", (chunk("p", ("gate", "up")),)),
    Rule(_L + r"mlp\.gate_up_proj\.weight", "{L}.mlp.{p}", (chunk("p", ("gate", "up")),)),
    Rule(_L + r"self_attn\.index_(?P<p>[qk])_proj\.weight", "{L}.attn.index_{p}"),
    Rule(_L + r"self_attn\.indexer\.(?P<p>[qk])_proj\.weight", "{L}.attn.index_{p}"),
    Rule(_L + r"self_attn\.index_(?P<p>[qk])_norm\.weight", "{L}.attn.index_{p}_norm"),
    Rule(_L + r"self_attn\.indexer\.(?P<p>[qk])_norm\.weight", "{L}.attn.index_{p}_norm"),
)


def rules(backbone: tuple[Rule, ...], per_expert: tuple[Rule, ...], packed: tuple[Rule, ...]) -> dict[str, tuple[Rule, ...]]:
    return {
        "minimax_m2": backbone + _SCORE_BIAS + per_expert + packed,
        "minimax_m3_vl": _vision_language(backbone + _M3 + per_expert + packed),
        "kimi_k25": _vision_language(backbone + per_expert + packed),
    }


RULES.update(rules(_BACKBONE, _PER_EXPERT, _PACKED))  # registered when moeswarm.model is imported
