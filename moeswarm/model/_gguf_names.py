"""The HF -> GGUF name map: one declarative table per architecture.

Each row ties three names together:

* ``hf``: the Hugging Face key in the hub's per-expert layout (``{L}`` layer, ``{E}`` expert).
  Packed layouts (transformers 5 ``experts.gate_up_proj``, gpt-oss) reach the same canonical
  names through ``convert.RULES``; the converter reads canonical tensors, so it handles all.
* ``canonical``: the engine's name (see ``convert.py``).
* ``gguf``: the llama.cpp tensor name.  Rows whose canonical name holds ``{E}`` are stacked over
  the experts into one tensor: ``[E, I, H]`` for gate/up, ``[E, H, I]`` for down (ggml ``ne`` is
  the reverse), ``[E, n]`` for expert biases.

Names follow llama.cpp's ``convert_hf_to_gguf.py`` / gguf-py ``TensorNameMap``.  Where llama.cpp
has no tensor for an architecture we reuse its generic name and say so (``invented=True``):

* ``blk.N.ffn_{gate,up,down}.weight`` for the dense layers of qwen2_moe / qwen3_moe
  (``mlp_only_layers``): llama.cpp's qwen2moe/qwen3moe graphs have no dense layers; these are its
  names for a dense FFN in every other architecture (e.g. deepseek2's leading dense blocks).

No other name is ours: the tests check every non-expert row against gguf-py's ``TensorNameMap``.
DeepSeek's ``e_score_correction_bias`` becomes ``blk.N.exp_probs_b.bias`` (llama.cpp renames it
to ``e_score_correction.bias`` before mapping) and gpt-oss's ``self_attn.sinks`` becomes
``blk.N.attn_sinks.weight`` (llama.cpp appends ``.weight``).

Mixtral is llama.cpp's ``llama`` architecture, whose rotary embedding pairs adjacent dimensions,
so llama.cpp permutes the rows of ``attn_q`` / ``attn_k`` per head; we do the same (``permute``)
and undo it when reading.  DeepSeek's ``kv_b_proj`` is kept whole as ``attn_kv_b`` (llama.cpp's
original name, read by ik_llama.cpp); recent llama.cpp additionally splits it into
``attn_k_b`` / ``attn_v_b`` at conversion time, which we do not write.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .config import ModelConfig

# moeswarm architecture -> GGUF ``general.architecture``
GGUF_ARCH = {
    "mixtral": "llama",
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
    "olmoe": "olmoe",
    "deepseek_v3": "deepseek2",
    "gpt_oss": "gpt-oss",
}


@dataclass(frozen=True)
class NameRow:
    canonical: str  # engine name template, e.g. "{L}.experts.{E}.gate"
    gguf: str  # GGUF tensor name template, e.g. "blk.{L}.ffn_gate_exps.weight"
    hf: str  # Hugging Face key template (per-expert hub layout)
    permute: str | None = None  # "heads" / "kv_heads": llama.cpp's rotary row permutation (llama arch)
    invented: bool = False  # no llama.cpp tensor of this name in this architecture
    fused: int | None = None  # place among the rows of one GGUF tensor several canonical ones share (DBRX's attn_qkv)

    @property
    def stacked(self) -> bool:
        return "{E}" in self.canonical


def _rows(*rows: tuple) -> tuple[NameRow, ...]:  # type: ignore[type-arg]
    return tuple(NameRow(*r) for r in rows)


_P = "model.layers.{L}."
_BACKBONE = _rows(
    ("embed", "token_embd.weight", "model.embed_tokens.weight"),
    ("final_norm", "output_norm.weight", "model.norm.weight"),
    ("lm_head", "output.weight", "lm_head.weight"),
    ("{L}.attn_norm", "blk.{L}.attn_norm.weight", _P + "input_layernorm.weight"),
)
_FFN_NORM = _rows(("{L}.mlp_norm", "blk.{L}.ffn_norm.weight", _P + "post_attention_layernorm.weight"))
_GQA = _rows(
    ("{L}.attn.q", "blk.{L}.attn_q.weight", _P + "self_attn.q_proj.weight"),
    ("{L}.attn.k", "blk.{L}.attn_k.weight", _P + "self_attn.k_proj.weight"),
    ("{L}.attn.v", "blk.{L}.attn_v.weight", _P + "self_attn.v_proj.weight"),
    ("{L}.attn.o", "blk.{L}.attn_output.weight", _P + "self_attn.o_proj.weight"),
)
_QKV_BIAS = _rows(
    ("{L}.attn.q_bias", "blk.{L}.attn_q.bias", _P + "self_attn.q_proj.bias"),
    ("{L}.attn.k_bias", "blk.{L}.attn_k.bias", _P + "self_attn.k_proj.bias"),
    ("{L}.attn.v_bias", "blk.{L}.attn_v.bias", _P + "self_attn.v_proj.bias"),
)
_O_BIAS = _rows(("{L}.attn.o_bias", "blk.{L}.attn_output.bias", _P + "self_attn.o_proj.bias"))
_QK_NORM = _rows(
    ("{L}.attn.q_norm", "blk.{L}.attn_q_norm.weight", _P + "self_attn.q_norm.weight"),
    ("{L}.attn.k_norm", "blk.{L}.attn_k_norm.weight", _P + "self_attn.k_norm.weight"),
)
_MLA = _rows(
    ("{L}.attn.q", "blk.{L}.attn_q.weight", _P + "self_attn.q_proj.weight"),  # q_lora_rank = None
    ("{L}.attn.q_a", "blk.{L}.attn_q_a.weight", _P + "self_attn.q_a_proj.weight"),
    ("{L}.attn.q_a_norm", "blk.{L}.attn_q_a_norm.weight", _P + "self_attn.q_a_layernorm.weight"),
    ("{L}.attn.q_b", "blk.{L}.attn_q_b.weight", _P + "self_attn.q_b_proj.weight"),
    ("{L}.attn.kv_a", "blk.{L}.attn_kv_a_mqa.weight", _P + "self_attn.kv_a_proj_with_mqa.weight"),
    ("{L}.attn.kv_a_norm", "blk.{L}.attn_kv_a_norm.weight", _P + "self_attn.kv_a_layernorm.weight"),
    ("{L}.attn.kv_b", "blk.{L}.attn_kv_b.weight", _P + "self_attn.kv_b_proj.weight"),
    ("{L}.attn.o", "blk.{L}.attn_output.weight", _P + "self_attn.o_proj.weight"),
)


def _dense(invented: bool) -> tuple[NameRow, ...]:
    return tuple(
        NameRow(f"{{L}}.mlp.{p}", f"blk.{{L}}.ffn_{p}.weight", _P + f"mlp.{p}_proj.weight", invented=invented)
        for p in ("gate", "up", "down")
    )


def _experts(prefix: str, hf: dict[str, str], bias: bool = False) -> tuple[NameRow, ...]:
    rows = [NameRow(f"{{L}}.experts.{{E}}.{p}", f"blk.{{L}}.ffn_{p}_exps.weight", _P + prefix + hf[p])
            for p in ("gate", "up", "down")]
    if bias:
        rows += [NameRow(f"{{L}}.experts.{{E}}.{p}_bias", f"blk.{{L}}.ffn_{p}_exps.bias",
                         _P + prefix + hf[p].replace(".weight", ".bias")) for p in ("gate", "up", "down")]
    return tuple(rows)


_PROJ = {p: f"experts.{{E}}.{p}_proj.weight" for p in ("gate", "up", "down")}
_ROUTER = _rows(("{L}.router", "blk.{L}.ffn_gate_inp.weight", _P + "mlp.gate.weight"))
_SHARED = tuple(
    NameRow(f"{{L}}.shared.{p}", f"blk.{{L}}.ffn_{p}_shexp.weight", _P + f"mlp.{{s}}.{p}_proj.weight")
    for p in ("gate", "up", "down")
)


def _shared(module: str) -> tuple[NameRow, ...]:
    return tuple(NameRow(r.canonical, r.gguf, r.hf.replace("{s}", module)) for r in _SHARED)


def _permuted(rows: tuple[NameRow, ...]) -> tuple[NameRow, ...]:
    kinds = {"{L}.attn.q": "heads", "{L}.attn.k": "kv_heads"}
    return tuple(NameRow(r.canonical, r.gguf, r.hf, kinds.get(r.canonical), r.invented) for r in rows)


NAME_MAP: dict[str, tuple[NameRow, ...]] = {
    "mixtral": _BACKBONE + _FFN_NORM + _permuted(_GQA)
    + _rows(("{L}.router", "blk.{L}.ffn_gate_inp.weight", _P + "block_sparse_moe.gate.weight"))
    + _experts("block_sparse_moe.", {"gate": "experts.{E}.w1.weight", "up": "experts.{E}.w3.weight",
                                     "down": "experts.{E}.w2.weight"}),
    "qwen2_moe": _BACKBONE + _FFN_NORM + _GQA + _QKV_BIAS + _ROUTER + _experts("mlp.", _PROJ)
    + _shared("shared_expert")
    + _rows(("{L}.shared_gate", "blk.{L}.ffn_gate_inp_shexp.weight", _P + "mlp.shared_expert_gate.weight"))
    + _dense(invented=True),
    "qwen3_moe": _BACKBONE + _FFN_NORM + _GQA + _QKV_BIAS + _O_BIAS + _QK_NORM + _ROUTER + _experts("mlp.", _PROJ)
    + _dense(invented=True),
    "olmoe": _BACKBONE + _FFN_NORM + _GQA + _QKV_BIAS + _O_BIAS + _QK_NORM + _ROUTER + _experts("mlp.", _PROJ),
    "deepseek_v3": _BACKBONE + _FFN_NORM + _MLA + _ROUTER
    + _rows(("{L}.router_score_bias", "blk.{L}.exp_probs_b.bias", _P + "mlp.gate.e_score_correction_bias"))
    + _experts("mlp.", _PROJ) + _shared("shared_experts") + _dense(invented=False),
    "gpt_oss": _BACKBONE + _GQA + _QKV_BIAS + _O_BIAS
    + _rows(
        ("{L}.mlp_norm", "blk.{L}.post_attention_norm.weight", _P + "post_attention_layernorm.weight"),
        ("{L}.attn.sinks", "blk.{L}.attn_sinks.weight", _P + "self_attn.sinks"),
        ("{L}.router", "blk.{L}.ffn_gate_inp.weight", _P + "mlp.router.weight"),
        ("{L}.router_bias", "blk.{L}.ffn_gate_inp.bias", _P + "mlp.router.bias"),
    )
    + _experts("mlp.", _PROJ, bias=True),
}

_LAYER = re.compile(r"^(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def template(canonical: str) -> tuple[str, int | None, int | None]:
    """``"3.experts.5.gate"`` -> ``("{L}.experts.{E}.gate", 3, 5)``."""
    layer = expert = None
    m = _LAYER.match(canonical)
    if m:
        layer = int(m.group(1))
        canonical = "{L}." + canonical[m.end():]
    m = _EXPERT.search(canonical)
    if m:
        expert = int(m.group(1))
        canonical = canonical[: m.start()] + ".experts.{E}." + canonical[m.end():]
    return canonical, layer, expert


def rows_by_canonical(arch: str) -> dict[str, NameRow]:
    return {r.canonical: r for r in NAME_MAP[arch]}


def gguf_name(arch: str, canonical: str) -> tuple[NameRow, str]:
    """The table row and the concrete GGUF name of a canonical tensor (experts: the stacked tensor)."""
    tmpl, layer, _ = template(canonical)
    row = rows_by_canonical(arch)[tmpl]  # KeyError: the table lacks a row (a bug, caught by the tests)
    return row, row.gguf.format(L=layer)


def rope_permutation(rows: int, heads: int) -> np.ndarray:
    """llama.cpp's ``permute`` of q/k rows as an index: ``stored = original[perm]``.

    Within each head the halves layout (HF rotate_half) becomes pairs of adjacent rows.
    """
    idx = np.arange(rows).reshape(heads, 2, rows // heads // 2).swapaxes(1, 2).reshape(rows)
    return idx


# MiniMax M2 (llama.cpp ``minimax-m2``) and Kimi K2.5's text model (llama.cpp converts it as
# ``deepseek2``; its HF keys sit under ``language_model.``).  MiniMax M3 has no llama.cpp architecture.
GGUF_ARCH.update({"minimax_m2": "minimax-m2", "kimi_k25": "deepseek2"})
NAME_MAP["minimax_m2"] = (
    _BACKBONE + _FFN_NORM + _GQA + _QK_NORM
    + _rows(("{L}.router", "blk.{L}.ffn_gate_inp.weight", _P + "block_sparse_moe.gate.weight"),
            ("{L}.router_score_bias", "blk.{L}.exp_probs_b.bias", _P + "block_sparse_moe.e_score_correction_bias"))
    + _experts("block_sparse_moe.", {"gate": "experts.{E}.w1.weight", "up": "experts.{E}.w3.weight",
                                     "down": "experts.{E}.w2.weight"})
)


def _under_language_model(rows: tuple[NameRow, ...]) -> tuple[NameRow, ...]:
    return tuple(NameRow(r.canonical, r.gguf, "language_model." + r.hf, r.permute, r.invented) for r in rows)


NAME_MAP["kimi_k25"] = _under_language_model(NAME_MAP["deepseek_v3"])


def model_type_of(garch: str) -> str | None:
    """The moeswarm architecture a GGUF ``general.architecture`` reads as (the first listed:
    ``deepseek2`` is DeepSeek-V3, though Kimi K2.5 writes it too)."""
    return next((k for k, v in GGUF_ARCH.items() if v == garch), None)
# ---------------------------------------------------------------- GLM-5 (glm-dsa) and Qwen3.5-MoE (qwen35moe)
# llama.cpp's gguf package has no DeepSeek-V3.2 architecture (its deepseek2 has no indexer), so
# deepseek_v32 has no GGUF form here.
#
# Qwen3.5 as llama.cpp's convert_hf_to_gguf.py writes it (Qwen3NextModel, _LinearAttentionVReorderBase):
# ``A_log`` is stored as ``ssm_a = -exp(A_log)`` (the engine's canonical ``attn.A`` already is),
# ``dt_bias`` as ``ssm_dt.bias``, the conv kernel squeezed to [C, K], every RMSNorm but the
# DeltaNet's output norm with the +1 folded in (as canonical), and, when there are more value than
# key heads, the value heads reordered from grouped-by-key-head to tiled (``v_*`` permutations).

GGUF_ARCH.update(glm_moe_dsa="glm-dsa", qwen3_5_moe="qwen35moe")

_INDEXER_ROWS = _rows(
    ("{L}.attn.idx_q_b", "blk.{L}.indexer.attn_q_b.weight", _P + "self_attn.indexer.wq_b.weight"),
    ("{L}.attn.idx_k", "blk.{L}.indexer.attn_k.weight", _P + "self_attn.indexer.wk.weight"),
    ("{L}.attn.idx_k_norm", "blk.{L}.indexer.k_norm.weight", _P + "self_attn.indexer.k_norm.weight"),
    ("{L}.attn.idx_k_norm_bias", "blk.{L}.indexer.k_norm.bias", _P + "self_attn.indexer.k_norm.bias"),
    ("{L}.attn.idx_w", "blk.{L}.indexer.proj.weight", _P + "self_attn.indexer.weights_proj.weight"),
)


def _in_language_model(rows: tuple[NameRow, ...]) -> tuple[NameRow, ...]:
    """HF names under a vision-language checkpoint's ``model.language_model.`` (lm_head stays)."""
    return tuple(NameRow(r.canonical, r.gguf, r.hf.replace("model.", "model.language_model.", 1)
                         if r.hf.startswith("model.") else r.hf, r.permute, r.invented) for r in rows)


_DELTANET = _rows(
    ("{L}.attn.qkv", "blk.{L}.attn_qkv.weight", _P + "linear_attn.in_proj_qkv.weight", "v_qkv"),
    ("{L}.attn.z", "blk.{L}.attn_gate.weight", _P + "linear_attn.in_proj_z.weight", "v_rows"),
    ("{L}.attn.b", "blk.{L}.ssm_beta.weight", _P + "linear_attn.in_proj_b.weight", "v_heads"),
    ("{L}.attn.a", "blk.{L}.ssm_alpha.weight", _P + "linear_attn.in_proj_a.weight", "v_heads"),
    ("{L}.attn.conv", "blk.{L}.ssm_conv1d.weight", _P + "linear_attn.conv1d.weight", "v_qkv"),
    ("{L}.attn.dt_bias", "blk.{L}.ssm_dt.bias", _P + "linear_attn.dt_bias", "v_heads"),
    ("{L}.attn.A", "blk.{L}.ssm_a", _P + "linear_attn.A_log", "v_heads"),
    ("{L}.attn.norm", "blk.{L}.ssm_norm.weight", _P + "linear_attn.norm.weight"),
    ("{L}.attn.out", "blk.{L}.ssm_out.weight", _P + "linear_attn.out_proj.weight", "v_cols"),
)

NAME_MAP.update(
    glm_moe_dsa=NAME_MAP["deepseek_v3"] + _INDEXER_ROWS,
    qwen3_5_moe=_in_language_model(
        _BACKBONE + _GQA + _QK_NORM + _DELTANET + _ROUTER + _experts("mlp.", _PROJ) + _shared("shared_expert")
        + _rows(
            ("{L}.mlp_norm", "blk.{L}.post_attention_norm.weight", _P + "post_attention_layernorm.weight"),
            ("{L}.shared_gate", "blk.{L}.ffn_gate_inp_shexp.weight", _P + "mlp.shared_expert_gate.weight"),
        )
    ),
)


def v_head_permutation(kind: str, n: int, num_k_heads: int, num_v_heads: int, key_dim: int,
                       v_head_dim: int) -> np.ndarray:
    """llama.cpp's grouped -> tiled value-head order as an index over ``n`` rows (or columns):
    ``stored = original[perm]``.  ``v_qkv``: the value part of [q | k | v] rows (or conv channels);
    ``v_rows`` / ``v_cols``: value-dim rows / columns; ``v_heads``: one row per value head."""
    head = 1 if kind == "v_heads" else v_head_dim
    offset = 2 * key_dim if kind == "v_qkv" else 0
    rep = num_v_heads // num_k_heads
    tiled = np.arange(num_v_heads * head).reshape(num_k_heads, rep, head).swapaxes(0, 1).reshape(-1)
    return np.concatenate([np.arange(offset), offset + tiled]) if offset else tiled


def v_head_order(kind: str, cfg: "ModelConfig", shape: tuple[int, ...]) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(rows, columns) permutations that store a canonical Qwen3.5 tensor as llama.cpp does (None: as is)."""
    dn = cfg.deltanet
    if dn is None or dn.num_k_heads == dn.num_v_heads:
        return None, None
    n = shape[1] if kind == "v_cols" else shape[0]
    perm = v_head_permutation(kind, n, dn.num_k_heads, dn.num_v_heads, dn.key_dim, dn.v_head_dim)
    return (None, perm) if kind == "v_cols" else (perm, None)


# ---------------------------------------------------------------- GLM-4.5 / 4.6 (glm4moe)
# As llama.cpp's convert_hf_to_gguf.py (Glm4MoeModel) writes it: NeoX rotary (no q/k permutation),
# the pre-FFN norm as ``post_attention_norm``, DeepSeek-V3's router, shared-expert and dense-layer
# names; the multi-token-prediction layer is not written.  GLM-4.7-Flash (glm4_moe_lite) is llama.cpp's
# deepseek2 (below).
GGUF_ARCH["glm4_moe"] = "glm4moe"
NAME_MAP["glm4_moe"] = (
    _BACKBONE + _GQA + _QKV_BIAS + _QK_NORM + _ROUTER
    + _rows(("{L}.mlp_norm", "blk.{L}.post_attention_norm.weight", _P + "post_attention_layernorm.weight"),
            ("{L}.router_score_bias", "blk.{L}.exp_probs_b.bias", _P + "mlp.gate.e_score_correction_bias"))
    + _experts("mlp.", _PROJ) + _shared("shared_experts") + _dense(invented=False)
)


# ---------------------------------------------------------------- Llama 4 (llama4)
# As llama.cpp's convert_hf_to_gguf.py (Llama4Model) writes it: no q/k row permutation (Llama 4's
# RoPE already pairs adjacent dimensions, as llama.cpp's does), the packed experts as
# ffn_{gate,up,down}_exps, the router as ffn_gate_inp, the shared expert as ffn_*_shexp, the dense
# layers as ffn_*.  The hf names are those gguf-py's TensorNameMap knows (the experts after
# llama.cpp splits ``gate_up_proj``).  The llama3 RoPE scaling (Llama 4 Scout) travels as llama.cpp's
# ``rope_freqs`` tensor (``_gguf_meta.llama3_factors``), outside this table.
_F = "model.layers.{L}.feed_forward."
GGUF_ARCH["llama4_text"] = GGUF_ARCH["llama4"] = "llama4"  # llama4_text first: llama.cpp's files read as text-only
NAME_MAP["llama4_text"] = NAME_MAP["llama4"] = (
    _BACKBONE + _FFN_NORM + _GQA + _QKV_BIAS + _O_BIAS
    + _rows(("{L}.router", "blk.{L}.ffn_gate_inp.weight", _F + "router.weight"))
    + tuple(NameRow(f"{{L}}.experts.{{E}}.{p}", f"blk.{{L}}.ffn_{p}_exps.weight", _F + f"experts.{p}_proj.weight")
            for p in ("gate", "up", "down"))
    + tuple(NameRow(f"{{L}}.shared.{p}", f"blk.{{L}}.ffn_{p}_shexp.weight", _F + f"shared_expert.{p}_proj.weight")
            for p in ("gate", "up", "down"))
    + tuple(NameRow(f"{{L}}.mlp.{p}", f"blk.{{L}}.ffn_{p}.weight", _F + f"{p}_proj.weight")
            for p in ("gate", "up", "down"))
)


# ---------------------------------------------------------------- Granite MoE (granitemoe)
# As llama.cpp's convert_hf_to_gguf.py (GraniteMoeModel, a LlamaModel) writes it: q/k rows (and
# biases) permuted to adjacent rotary pairs, ``input_linear`` split into ffn_gate_exps / ffn_up_exps
# (llama.cpp names those two itself: gguf-py's TensorNameMap has no entry for input_linear), the shared
# MLP's likewise into ffn_{gate,up}_shexp.
_GB = _P + "block_sparse_moe."
_BIAS_PERMUTE = {"{L}.attn.q_bias": "heads", "{L}.attn.k_bias": "kv_heads"}
GGUF_ARCH["granitemoe"] = GGUF_ARCH["granitemoeshared"] = "granitemoe"
NAME_MAP["granitemoe"] = NAME_MAP["granitemoeshared"] = (
    _BACKBONE + _FFN_NORM + _permuted(_GQA) + _O_BIAS
    + tuple(NameRow(r.canonical, r.gguf, r.hf, _BIAS_PERMUTE.get(r.canonical)) for r in _QKV_BIAS)
    + _rows(("{L}.router", "blk.{L}.ffn_gate_inp.weight", _GB + "router.layer.weight"),
            ("{L}.experts.{E}.gate", "blk.{L}.ffn_gate_exps.weight", _GB + "input_linear.weight"),
            ("{L}.experts.{E}.up", "blk.{L}.ffn_up_exps.weight", _GB + "input_linear.weight"),
            ("{L}.experts.{E}.down", "blk.{L}.ffn_down_exps.weight", _GB + "output_linear.weight"),
            ("{L}.shared.gate", "blk.{L}.ffn_gate_shexp.weight", _P + "shared_mlp.input_linear.weight"),
            ("{L}.shared.up", "blk.{L}.ffn_up_shexp.weight", _P + "shared_mlp.input_linear.weight"),
            ("{L}.shared.down", "blk.{L}.ffn_down_shexp.weight", _P + "shared_mlp.output_linear.weight"))
)


# ---------------------------------------------------------------- Mistral Small 4 (mistral4)
# DeepSeek-V3's names (llama.cpp's mistral4 is its deepseek2 graph with a softmax gate and the
# position-scaled query); ``kv_b_proj`` kept whole as ``attn_kv_b``, as for deepseek2.
GGUF_ARCH["mistral4"] = "mistral4"
NAME_MAP["mistral4"] = NAME_MAP["deepseek_v3"]


# ---------------------------------------------------------------- DBRX (dbrx)
# As llama.cpp's convert_hf_to_gguf.py (DbrxModel) writes it: the fused ``Wqkv`` kept whole as attn_qkv (q,
# k, v rows; the engine's q / k / v are its row ranges, ``fused``), NeoX rotary (no permutation), norm_2 as
# attn_output_norm, the flat experts as ffn_{gate,up,down}_exps (w2 transposed per expert: [E, H, I]).
_D = "transformer.blocks.{L}."
GGUF_ARCH["dbrx"] = "dbrx"
NAME_MAP["dbrx"] = _rows(
    ("embed", "token_embd.weight", "transformer.wte.weight"),
    ("final_norm", "output_norm.weight", "transformer.norm_f.weight"),
    ("lm_head", "output.weight", "lm_head.weight"),
    ("{L}.attn_norm", "blk.{L}.attn_norm.weight", _D + "norm_attn_norm.norm_1.weight"),
    ("{L}.mlp_norm", "blk.{L}.attn_output_norm.weight", _D + "norm_attn_norm.norm_2.weight"),
    ("{L}.attn.q", "blk.{L}.attn_qkv.weight", _D + "norm_attn_norm.attn.Wqkv.weight", None, False, 0),
    ("{L}.attn.k", "blk.{L}.attn_qkv.weight", _D + "norm_attn_norm.attn.Wqkv.weight", None, False, 1),
    ("{L}.attn.v", "blk.{L}.attn_qkv.weight", _D + "norm_attn_norm.attn.Wqkv.weight", None, False, 2),
    ("{L}.attn.o", "blk.{L}.attn_output.weight", _D + "norm_attn_norm.attn.out_proj.weight"),
    ("{L}.router", "blk.{L}.ffn_gate_inp.weight", _D + "ffn.router.layer.weight"),
    ("{L}.experts.{E}.gate", "blk.{L}.ffn_gate_exps.weight", _D + "ffn.experts.mlp.w1"),
    ("{L}.experts.{E}.up", "blk.{L}.ffn_up_exps.weight", _D + "ffn.experts.mlp.v1"),
    ("{L}.experts.{E}.down", "blk.{L}.ffn_down_exps.weight", _D + "ffn.experts.mlp.w2"),
)


def fused_siblings(arch: str, row: NameRow) -> tuple[NameRow, ...]:
    """The rows sharing ``row``'s GGUF tensor, in their order inside it (just ``row`` when not fused)."""
    if row.fused is None:
        return (row,)
    return tuple(sorted((r for r in NAME_MAP[arch] if r.gguf == row.gguf), key=lambda r: r.fused or 0))


# ---------------------------------------------------------------- dots.llm1 (dots1)
# As llama.cpp's convert_hf_to_gguf.py (Dots1Model, a DeepseekV2-style MoE over Qwen3's attention) writes
# it: NeoX rotary (no permutation), q/k norms, q/k/v/o biases, DeepSeek-V3's router, correction bias,
# shared expert and leading dense layers.  llama.cpp's dots1 has no sliding-window layers.
GGUF_ARCH["dots1"] = "dots1"
NAME_MAP["dots1"] = (
    _BACKBONE + _FFN_NORM + _GQA + _QKV_BIAS + _O_BIAS + _QK_NORM + _ROUTER
    + _rows(("{L}.router_score_bias", "blk.{L}.exp_probs_b.bias", _P + "mlp.gate.e_score_correction_bias"))
    + _experts("mlp.", _PROJ) + _shared("shared_experts") + _dense(invented=False)
)


# ---------------------------------------------------------------- ERNIE 4.5 MoE (ernie4_5-moe)
# As llama.cpp's convert_hf_to_gguf.py (Ernie4_5MoeModel) writes it: Llama's names, no q/k permutation
# (ERNIE's RoPE already pairs adjacent dimensions), the router's score bias (``moe_statics``) as
# exp_probs_b kept [1, E] as the hub stores it (``STORED_SHAPE``), DeepSeek-V3's shared-expert and dense names.
GGUF_ARCH["ernie4_5_moe"] = "ernie4_5-moe"
NAME_MAP["ernie4_5_moe"] = (
    _BACKBONE + _FFN_NORM + _GQA + _ROUTER
    + _rows(("{L}.router_score_bias", "blk.{L}.exp_probs_b.bias", _P + "mlp.moe_statics.e_score_correction_bias"))
    + _experts("mlp.", _PROJ) + _shared("shared_experts") + _dense(invented=False)
)
# (arch, canonical) -> the shape llama.cpp stores a tensor in (numpy order, same values in the same order)
STORED_SHAPE: dict[tuple[str, str], Callable[[tuple[int, ...]], tuple[int, ...]]] = {
    ("ernie4_5_moe", "{L}.router_score_bias"): lambda s: (1, *s),  # 1-D in the engine, [1, n] in llama.cpp
}


# ---------------------------------------------------------------- Hunyuan-A13B (hunyuan-moe)
# As llama.cpp's convert_hf_to_gguf.py (HunYuanMoEModel) writes it: NeoX rotary (no permutation), the q/k
# norms applied after RoPE (``query_layernorm`` / ``key_layernorm``) as attn_q_norm / attn_k_norm, the router
# ``mlp.gate.wg`` as ffn_gate_inp and the unweighted shared MLP as ffn_*_shexp.
GGUF_ARCH["hunyuan_v1_moe"] = "hunyuan-moe"
NAME_MAP["hunyuan_v1_moe"] = (
    _BACKBONE + _FFN_NORM + _GQA + _QKV_BIAS + _O_BIAS
    + _rows(("{L}.attn.q_norm", "blk.{L}.attn_q_norm.weight", _P + "self_attn.query_layernorm.weight"),
            ("{L}.attn.k_norm", "blk.{L}.attn_k_norm.weight", _P + "self_attn.key_layernorm.weight"),
            ("{L}.router", "blk.{L}.ffn_gate_inp.weight", _P + "mlp.gate.wg.weight"))
    + _experts("mlp.", _PROJ) + _shared("shared_mlp")
)


# ---------------------------------------------------------------- GLM-4.7-Flash (glm4_moe_lite, as deepseek2)
# llama.cpp's convert_hf_to_gguf.py (Glm4MoeLiteModel, a DeepseekV2Model) writes GLM-4.7-Flash as ``deepseek2``:
# DeepSeek-V3's names and keys.  llama.cpp's deepseek2 runs dense layers only before the first MoE one
# (leading_dense_block_count); which layers are dense is read back from the tensors (``_gguf_meta``).
GGUF_ARCH["glm4_moe_lite"] = "deepseek2"
NAME_MAP["glm4_moe_lite"] = NAME_MAP["deepseek_v3"]


# ---------------------------------------------------------------- PhiMoE (phimoe)
# As llama.cpp's convert_hf_to_gguf.py (PhiMoeModel, a Phi3MiniModel) writes it: Mixtral's names without
# the q/k permutation (llama.cpp's phimoe is NeoX), the LayerNorms' biases as ``.bias`` beside their weights,
# the LM head's bias as output.bias.  The sparsemixer router is ffn_gate_inp (its jitter has no llama.cpp
# key: ``moeswarm.phimoe.router_jitter_noise``); longrope's factors travel as llama.cpp's rope_factors_short /
# rope_factors_long tensors (``_gguf_write``), outside this table.
GGUF_ARCH["phimoe"] = "phimoe"
NAME_MAP["phimoe"] = (
    _BACKBONE + _FFN_NORM + _GQA + _QKV_BIAS + _O_BIAS
    + _rows(("final_norm_bias", "output_norm.bias", "model.norm.bias"),
            ("lm_head_bias", "output.bias", "lm_head.bias"),
            ("{L}.attn_norm_bias", "blk.{L}.attn_norm.bias", _P + "input_layernorm.bias"),
            ("{L}.mlp_norm_bias", "blk.{L}.ffn_norm.bias", _P + "post_attention_layernorm.bias"),
            ("{L}.router", "blk.{L}.ffn_gate_inp.weight", _P + "block_sparse_moe.gate.weight"))
    + _experts("block_sparse_moe.", {"gate": "experts.{E}.w1.weight", "up": "experts.{E}.w3.weight",
                                     "down": "experts.{E}.w2.weight"})
)


# ---------------------------------------------------------------- Qwen3-Next (qwen3next)
# As llama.cpp's convert_hf_to_gguf.py (Qwen3NextModel) writes it: Qwen3.5's DeltaNet names without its
# value-head reordering (llama.cpp's qwen3next takes the heads grouped by key head, as the hub stores them),
# and ``in_proj_qkvz`` (per key head: q, k, v, z) split into attn_qkv (every head's q, then k, then v) and
# attn_gate (z): ``SPLIT`` / ``qkvz_rows``.  ``in_proj_ba`` stays grouped as ssm_ba.  llama.cpp also reads
# the hub's layout whole as ``ssm_in`` (its "legacy GGUF"), and so does the engine.  llama.cpp's qwen3next
# has no dense layers: ours (``mlp_only_layers``) take the generic ffn_* names (``invented``).
GGUF_ARCH["qwen3_next"] = "qwen3next"
_QWEN3_NEXT_DELTANET = _rows(
    ("{L}.attn.qkvz", "blk.{L}.attn_qkv.weight", _P + "linear_attn.in_proj_qkvz.weight"),
    ("{L}.attn.ba", "blk.{L}.ssm_ba.weight", _P + "linear_attn.in_proj_ba.weight"),
) + tuple(r for r in _DELTANET if r.canonical not in ("{L}.attn.qkv", "{L}.attn.z", "{L}.attn.b", "{L}.attn.a"))
NAME_MAP["qwen3_next"] = tuple(
    NameRow(r.canonical, r.gguf, r.hf, None, r.invented, r.fused)  # no value-head reordering
    for r in _BACKBONE + _GQA + _QK_NORM + _QWEN3_NEXT_DELTANET + _ROUTER + _experts("mlp.", _PROJ)
    + _shared("shared_expert")
    + _rows(("{L}.mlp_norm", "blk.{L}.post_attention_norm.weight", _P + "post_attention_layernorm.weight"),
            ("{L}.shared_gate", "blk.{L}.ffn_gate_inp_shexp.weight", _P + "mlp.shared_expert_gate.weight"))
) + _dense(invented=True)
# (arch, canonical) -> the GGUF tensors its rows are split into, in order (``qkvz_rows`` gives which rows)
SPLIT = {("qwen3_next", "{L}.attn.qkvz"): ("blk.{L}.attn_qkv.weight", "blk.{L}.attn_gate.weight")}
LEGACY_WHOLE = {("qwen3_next", "{L}.attn.qkvz"): "blk.{L}.ssm_in.weight"}  # the same tensor unsplit, as the hub's


def qkvz_rows(cfg: "ModelConfig") -> tuple[np.ndarray, np.ndarray]:
    """The rows of Qwen3-Next's ``in_proj_qkvz`` (per key head: q, k, then v and z of its value heads) that
    llama.cpp's attn_qkv (q of every head, then k, then v) and attn_gate (z) hold, in their order."""
    dn = cfg.deltanet
    assert dn is not None
    dk, vz = dn.k_head_dim, dn.num_v_heads // dn.num_k_heads * dn.v_head_dim
    base = np.arange(dn.num_k_heads)[:, None] * (2 * dk + 2 * vz)
    q, k = (base + np.arange(dk)).reshape(-1), (base + dk + np.arange(dk)).reshape(-1)
    v, z = (base + 2 * dk + np.arange(vz)).reshape(-1), (base + 2 * dk + vz + np.arange(vz)).reshape(-1)
    return np.concatenate([q, k, v]), z


# ---------------------------------------------------------------- MiMo-V2-Flash (mimo2)
# As llama.cpp's convert_hf_to_gguf.py (MimoV2Model) writes it: GQA names (NeoX rotary: no permutation) with
# each layer's own key-value heads (head_count_kv per layer), the sliding layers' sinks as attn_sinks (one per
# head), DeepSeek-V3's router and correction bias, the dense first layer as ffn_*.
GGUF_ARCH["mimo_v2_flash"] = "mimo2"
NAME_MAP["mimo_v2_flash"] = (
    _BACKBONE + _FFN_NORM + _GQA + _ROUTER
    + _rows(("{L}.attn.sinks", "blk.{L}.attn_sinks.weight", _P + "self_attn.attention_sink_bias"),
            ("{L}.router_score_bias", "blk.{L}.exp_probs_b.bias", _P + "mlp.gate.e_score_correction_bias"))
    + _experts("mlp.", _PROJ) + _dense(invented=False)
)


# ---------------------------------------------------------------- Kimi Linear (kimi-linear)
# As llama.cpp's convert_hf_to_gguf.py (KimiLinearModel) writes it: the KDA layers' q/k/v as attn_q/k/v, their
# three causal convolutions as ssm_conv1d_{q,k,v} stored [1, C, 1, K] (ggml ne [K, 1, C, 1]), the decay
# ``A = -exp(A_log)`` as ssm_a stored [1, 1, h, 1], dt_bias as ssm_dt.bias, the forget and output gates'
# low-rank pairs as ssm_f_a / ssm_f_b and ssm_g_a / ssm_g_b, beta's projection as ssm_beta, the per-head output
# norm as ssm_norm; the MLA layers (no RoPE) with DeepSeek-V3's names, ``kv_b_proj`` kept whole as attn_kv_b
# split and absorbed as llama.cpp's converter writes it (attn_k_b [heads, rank, nope], attn_v_b [heads, v, rank]:
# ``WRITE_ABSORBED``; llama.cpp 0.3.36's kimi-linear crashes on the whole attn_kv_b it calls "legacy"); the hub's
# ``block_sparse_moe`` MoE names.
_KA = _P + "self_attn."
GGUF_ARCH["kimi_linear"] = "kimi-linear"
NAME_MAP["kimi_linear"] = (
    _BACKBONE + _FFN_NORM + _MLA
    + _rows(("{L}.attn.k", "blk.{L}.attn_k.weight", _KA + "k_proj.weight"),
            ("{L}.attn.v", "blk.{L}.attn_v.weight", _KA + "v_proj.weight"),
            ("{L}.attn.q_conv", "blk.{L}.ssm_conv1d_q.weight", _KA + "q_conv1d.weight"),
            ("{L}.attn.k_conv", "blk.{L}.ssm_conv1d_k.weight", _KA + "k_conv1d.weight"),
            ("{L}.attn.v_conv", "blk.{L}.ssm_conv1d_v.weight", _KA + "v_conv1d.weight"),
            ("{L}.attn.A", "blk.{L}.ssm_a", _KA + "A_log"),
            ("{L}.attn.dt_bias", "blk.{L}.ssm_dt.bias", _KA + "dt_bias"),
            ("{L}.attn.f_a", "blk.{L}.ssm_f_a.weight", _KA + "f_a_proj.weight"),
            ("{L}.attn.f_b", "blk.{L}.ssm_f_b.weight", _KA + "f_b_proj.weight"),
            ("{L}.attn.g_a", "blk.{L}.ssm_g_a.weight", _KA + "g_a_proj.weight"),
            ("{L}.attn.g_b", "blk.{L}.ssm_g_b.weight", _KA + "g_b_proj.weight"),
            ("{L}.attn.b", "blk.{L}.ssm_beta.weight", _KA + "b_proj.weight"),
            ("{L}.attn.o_norm", "blk.{L}.ssm_norm.weight", _KA + "o_norm.weight"),
            ("{L}.router", "blk.{L}.ffn_gate_inp.weight", _P + "block_sparse_moe.gate.weight"),
            ("{L}.router_score_bias", "blk.{L}.exp_probs_b.bias",
             _P + "block_sparse_moe.gate.e_score_correction_bias"))
    + _experts("block_sparse_moe.", {"gate": "experts.{E}.w1.weight", "up": "experts.{E}.w3.weight",
                                     "down": "experts.{E}.w2.weight"})
    + tuple(NameRow(r.canonical, r.gguf, r.hf.replace("mlp.{s}", "block_sparse_moe.shared_experts")) for r in _SHARED)
    + _dense(invented=False)
)
STORED_SHAPE.update({("kimi_linear", f"{{L}}.attn.{p}_conv"): (lambda s: (1, s[0], 1, s[1])) for p in "qkv"})
STORED_SHAPE[("kimi_linear", "{L}.attn.A")] = lambda s: (1, 1, *s, 1)

# (arch, canonical) -> the GGUF tensors MLA's kv_b is written as, absorbed (``absorbed_kv_b``)
WRITE_ABSORBED = {("kimi_linear", "{L}.attn.kv_b"): ("blk.{L}.attn_k_b.weight", "blk.{L}.attn_v_b.weight")}


def absorbed_kv_b(kv_b: np.ndarray, cfg: "ModelConfig") -> tuple[np.ndarray, np.ndarray]:
    """MLA's kv_b [heads * (nope + v), rank] as llama.cpp's converter splits it: attn_k_b [heads, rank, nope] (each
    head's key rows, transposed) and attn_v_b [heads, v, rank], float32 (``_gguf_read._kv_b_from_split`` undoes it)."""
    heads, nope, rank = cfg.num_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
    kv = np.asarray(kv_b, np.float32).reshape(heads, -1, rank)
    return np.ascontiguousarray(kv[:, :nope].transpose(0, 2, 1)), np.ascontiguousarray(kv[:, nope:])
