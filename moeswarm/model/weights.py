"""Open a Hugging Face model folder as canonical, memory-mapped, shape-checked tensors.

Opening reads ``config.json`` and the safetensors headers, never the tensors' bytes: every
tensor is a view into the file's memory map, paged in by the kernel on first touch.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import CheckpointError
from ._config_minimax_kimi import extra_shapes
from ._safetensors import TensorRef, open_folder
from ._stored import StoredTensor, combine_stored
from .config import ModelConfig
from .convert import convert
from .mtp import mtp_shapes, rules as mtp_rules, stored_keys, stored_mtp_layers, with_mtp


@dataclass(frozen=True)
class ExpertWeights:
    """One routed expert, ``nn.Linear`` orientation: gate/up ``[I, H]``, down ``[H, I]``."""

    gate: np.ndarray
    up: np.ndarray
    down: np.ndarray
    gate_bias: np.ndarray | None = None
    up_bias: np.ndarray | None = None
    down_bias: np.ndarray | None = None

    def arrays(self) -> list[np.ndarray]:
        return [a for a in (self.gate, self.up, self.down, self.gate_bias, self.up_bias, self.down_bias) if a is not None]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())


@dataclass
class Weights:
    config: ModelConfig
    folder: str
    tensors: dict[str, np.ndarray]  # canonical name -> view
    sources: dict[str, TensorRef]
    experts: dict[int, dict[int, ExpertWeights]] = field(default_factory=dict)  # layer -> expert -> weights

    def __getitem__(self, name: str) -> np.ndarray:
        return self.tensors[name]

    def get(self, name: str) -> np.ndarray | None:
        return self.tensors.get(name)


Shapes = dict[str, tuple[int, ...]]
# a registered attention kind's own tensors of layer L (else GQA's), and a family's tensors beyond the
# generic ones (keyed by ``ModelConfig.arch``): filled by the family modules (DeepSeek-V4's)
ATTENTION_SHAPES: dict[str, Callable[[ModelConfig, int], Shapes]] = {}
EXTRA_SHAPES: dict[str, Callable[[ModelConfig], Shapes]] = {}
INDEX_TABLES = (".router_table",)  # integer tensors (DeepSeek-V4's token -> experts table), not weights
# families whose layers hold other tensors than attention + MLP (``ModelConfig.arch`` -> all their
# shapes, in place of the generic ones): filled by the family modules (LongCat-Flash's, MiMo-V2-Flash's)
FAMILY_SHAPES: dict[str, Callable[[ModelConfig], Shapes]] = {}


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape that ``cfg`` implies, for every non-expert tensor."""
    if cfg.arch in FAMILY_SHAPES:
        return FAMILY_SHAPES[cfg.arch](cfg)
    H, V, nh, nkv, hd = cfg.hidden_size, cfg.vocab_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    s: dict[str, tuple[int, ...]] = {"embed": (V, H), "final_norm": (H,)}
    if not cfg.tie_word_embeddings:
        s["lm_head"] = (V, H)
    if cfg.lm_head_bias:
        s["lm_head_bias"] = (V,)
    if cfg.norm_bias:
        s["final_norm_bias"] = (H,)
    for L in range(cfg.all_layers):  # the MTP layers' decoder layers too (model/mtp.py)
        p = f"{L}."
        s[p + "attn_norm"] = s[p + "mlp_norm"] = (H,)
        if cfg.norm_bias:
            s[p + "attn_norm_bias"] = s[p + "mlp_norm_bias"] = (H,)
        if cfg.attention in ATTENTION_SHAPES:
            s.update(ATTENTION_SHAPES[cfg.attention](cfg, L))
        elif cfg.attention == "qwen3_5":
            s.update(_qwen3_5_attention_shapes(cfg, L))
        elif cfg.attention in ("mla", "dsa"):
            if cfg.dsa is not None and not cfg.dsa.shared[L]:
                s.update(_indexer_shapes(cfg, L))
            qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
            if cfg.q_lora_rank:
                s[p + "attn.q_a"] = (cfg.q_lora_rank, H)
                s[p + "attn.q_a_norm"] = (cfg.q_lora_rank,)
                s[p + "attn.q_b"] = (nh * qk, cfg.q_lora_rank)
            else:
                s[p + "attn.q"] = (nh * qk, H)
            s[p + "attn.kv_a"] = (cfg.kv_lora_rank + cfg.qk_rope_head_dim, H)
            s[p + "attn.kv_a_norm"] = (cfg.kv_lora_rank,)
            s[p + "attn.kv_b"] = (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
            s[p + "attn.o"] = (H, nh * cfg.v_head_dim)
        else:
            s[p + "attn.q"], s[p + "attn.k"], s[p + "attn.v"] = (nh * hd, H), (nkv * hd, H), (nkv * hd, H)
            s[p + "attn.o"] = (H, nh * hd)
            if cfg.qkv_bias:
                s[p + "attn.q_bias"], s[p + "attn.k_bias"], s[p + "attn.v_bias"] = (nh * hd,), (nkv * hd,), (nkv * hd,)
            if cfg.o_bias:
                s[p + "attn.o_bias"] = (H,)
            if cfg.qk_norm in ("head", "head_after_rope"):
                s[p + "attn.q_norm"] = s[p + "attn.k_norm"] = (hd,)
            elif cfg.qk_norm == "full":
                s[p + "attn.q_norm"], s[p + "attn.k_norm"] = (nh * hd,), (nkv * hd,)
            if cfg.sinks:
                s[p + "attn.sinks"] = (nh,)
        if not cfg.moe_layers[L]:
            inter = cfg.dense_intermediate_size
            s[p + "mlp.gate"] = s[p + "mlp.up"] = (inter, H)
            s[p + "mlp.down"] = (H, inter)
            continue
        s[p + "router"] = (cfg.num_experts, H)
        if cfg.router == "topk_softmax" and cfg.expert_bias:  # gpt-oss's router has a bias; Granite's has none
            s[p + "router_bias"] = (cfg.num_experts,)
        if cfg.router == "sigmoid_group" or cfg.choice_bias:
            s[p + "router_score_bias"] = (cfg.num_experts,)
        if cfg.shared_intermediate_size:
            inter = cfg.shared_intermediate_size
            s[p + "shared.gate"] = s[p + "shared.up"] = (inter, H)
            s[p + "shared.down"] = (H, inter)
        if cfg.shared_expert_gate:
            s[p + "shared_gate"] = (1, H)
    s.update(extra_shapes(cfg))  # MiniMax M3's lightning indexer
    s.update(mtp_shapes(cfg))
    if cfg.arch in EXTRA_SHAPES:
        s.update(EXTRA_SHAPES[cfg.arch](cfg))
    return s


def _indexer_shapes(cfg: ModelConfig, L: int) -> dict[str, tuple[int, ...]]:
    """The DSA lightning indexer of layer L (DeepSeek-V3.2, GLM-5)."""
    assert cfg.dsa is not None and cfg.q_lora_rank
    H, nh, D, p = cfg.hidden_size, cfg.dsa.n_heads, cfg.dsa.head_dim, f"{L}.attn."
    return {p + "idx_q_b": (nh * D, cfg.q_lora_rank), p + "idx_k": (D, H), p + "idx_k_norm": (D,),
            p + "idx_k_norm_bias": (D,), p + "idx_w": (nh, H)}


def _qwen3_5_attention_shapes(cfg: ModelConfig, L: int) -> dict[str, tuple[int, ...]]:
    """Qwen3.5 / Qwen3-Next: gated DeltaNet on linear-attention layers, gated full attention on the others."""
    dn, H, p = cfg.deltanet, cfg.hidden_size, f"{L}.attn."
    assert dn is not None
    if dn.layers[L]:
        if cfg.arch == "qwen3_next":  # two matrices grouped per key head (see _attn_deltanet._projections)
            inputs = {p + "qkvz": (dn.conv_dim + dn.value_dim, H), p + "ba": (2 * dn.num_v_heads, H)}
        else:
            inputs = {p + "qkv": (dn.conv_dim, H), p + "z": (dn.value_dim, H), p + "b": (dn.num_v_heads, H),
                      p + "a": (dn.num_v_heads, H)}
        return {**inputs, p + "conv": (dn.conv_dim, dn.conv_kernel), p + "dt_bias": (dn.num_v_heads,),
                p + "A": (dn.num_v_heads,), p + "norm": (dn.v_head_dim,), p + "out": (H, dn.value_dim)}
    nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    s = {p + "q": (2 * nh * hd, H), p + "k": (nkv * hd, H), p + "v": (nkv * hd, H), p + "o": (H, nh * hd),
         p + "q_norm": (hd,), p + "k_norm": (hd,)}
    if cfg.qkv_bias:
        s.update({p + "q_bias": (2 * nh * hd,), p + "k_bias": (nkv * hd,), p + "v_bias": (nkv * hd,)})
    if cfg.o_bias:
        s[p + "o_bias"] = (H,)
    return s


def expert_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    s = {"gate": (I, H), "up": (I, H), "down": (H, I)}
    if cfg.expert_bias:
        s.update(gate_bias=(I,), up_bias=(I,), down_bias=(H,))
    return s


def stored_expert_bytes(cfg: ModelConfig, bytes_per_value: int = 2) -> int:
    """Bytes of one routed expert as the checkpoint stores it: codes plus scales when
    ``quantization_config`` says how (biases stay 16-bit floats), else ``bytes_per_value`` per weight."""
    total = 0
    for name, shape in expert_shapes(cfg).items():
        if cfg.quant is not None and len(shape) == 2:
            total += cfg.quant.matrix_bytes(*shape)
        else:
            total += bytes_per_value * int(np.prod(shape))
    return total


def _check_expert_table(a: np.ndarray, cfg: ModelConfig, src: TensorRef) -> None:
    """A token -> experts table (DeepSeek-V4's ``tid2eid``): integers naming distinct experts per token."""
    if a.dtype.kind not in "iu":
        raise CheckpointError(f"dtype {a.dtype} for a token -> experts table (integers)", path=src.path, tensor=src.key)
    table = np.asarray(a)
    if table.size and (table.min() < 0 or table.max() >= cfg.num_experts):
        raise CheckpointError(f"the token -> experts table names experts outside 0..{cfg.num_experts - 1}",
                              path=src.path, tensor=src.key)
    ordered = np.sort(table, axis=-1)
    if np.any(ordered[:, 1:] == ordered[:, :-1]):
        raise CheckpointError("the token -> experts table repeats an expert for one token", path=src.path, tensor=src.key)


def load_safetensors(
    folder: str | os.PathLike[str],
    *,
    config: ModelConfig | None = None,
    keep_expert: Callable[[int, int], bool] | None = None,
) -> Weights:
    """Map a safetensors model folder.  ``keep_expert(layer, expert)`` selects the experts to hold."""
    folder = str(folder)
    if not Path(folder).is_dir():
        raise CheckpointError("model folder not found", path=folder)
    cfg = config or ModelConfig.from_folder(folder)
    keys = open_folder(folder)
    if cfg.quant is not None:  # (codes, scale) pairs -> one StoredTensor each, kept in the stored format
        keys = combine_stored(keys, cfg.quant)
    keys = stored_keys(cfg, keys)  # Qwen3.5's mtp.* under the layer numbers after the decoder's
    if config is None:  # the MTP layers stored (a given config says itself whether to read them)
        cfg = with_mtp(cfg, stored_mtp_layers(cfg, keys))
    conv = convert(cfg.arch, keys, keep=keep_expert, num_layers=cfg.all_layers, num_experts=cfg.num_experts, extra=mtp_rules(cfg.arch))
    w = Weights(cfg, folder, {}, conv.sources)

    def check(name: str, shape: tuple[int, ...]) -> np.ndarray:
        a = conv.tensors.get(name)
        if a is None:
            raise CheckpointError(f"missing tensor {name!r} required by config.json", path=folder)
        if a.shape != shape:
            src = conv.sources[name]
            raise CheckpointError(
                f"shape {list(a.shape)} does not match config.json, which implies {list(shape)}",
                path=src.path,
                tensor=src.key,
            )
        if name.endswith(INDEX_TABLES):
            _check_expert_table(a, cfg, conv.sources[name])
            return a
        if not isinstance(a, StoredTensor) and a.dtype.kind != "f" and a.dtype.name != "bfloat16":
            src = conv.sources[name]
            raise CheckpointError(f"unsupported dtype {a.dtype} for a weight", path=src.path, tensor=src.key)
        return a

    for name, shape in expected_shapes(cfg).items():
        w.tensors[name] = check(name, shape)
    if cfg.tie_word_embeddings:
        w.tensors["lm_head"] = w.tensors["embed"]
    eshapes = expert_shapes(cfg)
    for L in range(cfg.all_layers):
        if not cfg.moe_layers[L]:
            continue
        layer: dict[int, ExpertWeights] = {}
        for e in range(cfg.num_experts):
            if keep_expert is not None and not keep_expert(L, e):
                continue
            parts = {k: check(f"{L}.experts.{e}.{k}", shape) for k, shape in eshapes.items()}
            layer[e] = ExpertWeights(**parts)
        w.experts[L] = layer
    return w
