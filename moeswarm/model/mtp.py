"""Multi-token prediction (MTP) layers: read as the checkpoint stores them, run as the draft.

Where each family stores them (``LAYOUT``, a small per-family key map that new families extend):

* ``"layers"`` -- DeepSeek-V3/V3.2, GLM-5 (and the demo checkpoint): after the decoder layers, as
  ``model.layers.{N}.*`` with N = num_hidden_layers, ...: a decoder layer (attention + MoE) plus
  ``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head.norm``; ``shared_head.head`` and
  ``embed_tokens`` repeat the model's own LM head and embedding and are not read.
* ``"mtp"`` -- Qwen3.5-MoE: ``mtp.fc`` (= eh_proj), ``mtp.pre_fc_norm_embedding`` / ``_hidden``
  (= enorm / hnorm), ``mtp.norm`` (= shared_head.norm) and ``mtp.layers.{k}.*`` (a full-attention
  decoder layer); its norms scale by ``1 + w`` like the rest of the model.
* ``"blocks"`` -- DeepSeek-V4: ``mtp.{k}.*``, a decoder layer in the family's own names (``attn.*``,
  ``ffn.*``, ``hc_attn_*``, ``hc_ffn_*``, ...) plus ``e_proj``, ``h_proj``, ``enorm``, ``hnorm``, ``norm``
  and the layer's own ``hc_head_{fn,base,scale}`` (DeepSeek's ``inference/model.py``, ``MTPBlock``;
  vLLM's ``deepseek_v4_mtp.py`` reads the same keys); embedding and LM head are the model's.

Canonical names: MTP layer k is layer ``num_layers + k`` (``{L}.attn.*``, ``{L}.router``,
``{L}.experts.{E}.*`` -- its experts are experts, a swarm serves them like any layer's) plus
``{L}.mtp.{enorm,hnorm,eh_proj,norm}`` (DeepSeek-V4: ``e_proj``, ``h_proj`` and ``hc_head_*`` for
``eh_proj``).  ``ModelConfig.mtp_layers`` says how many were loaded.

One MTP step (transformers' ``MtpLayer``): slot j takes the model's final-normed hidden state h_j
at position j and the embedding of token j+1; x = eh_proj([enorm(e), hnorm(h)]); x = the layer
at position j+1 over the MTP layer's own cache; g = norm(x); lm_head(g) predicts token j+2.
Drafting further feeds g back as the hidden state with the drafted token (the same layer again).
DeepSeek-V4 (``MTPBlock.forward``): h is the model's ``hc_mult`` streams before its ``hc_head``
(T, n, H); x = e_proj(enorm(e)) added to each stream of h_proj(hnorm(h)); the layer runs on the
streams; its own ``hc_head`` collapses them, then norm and the LM head; g is the layer's output
streams (what vLLM feeds back for a further draft).
``_mtp_run.py`` runs them (this module is the loader, below the engine in the import graph).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, TypeVar

from ._config_dsv4 import mtp_settings
from .config import ModelConfig
from .convert import Rule, plus_one

# family -> how its checkpoints store MTP layers ("layers": model.layers.N; "mtp": under mtp.)
LAYOUT: dict[str, str] = {"deepseek_v3": "layers", "deepseek_v32": "layers", "glm_moe_dsa": "layers",
                          "mixtral": "layers", "qwen3_5_moe": "mtp", "deepseek_v4": "blocks"}
# config.json fields that declare the count (top level, or in text_config)
DECLARED = ("num_nextn_predict_layers", "num_mtp_layers", "mtp_num_hidden_layers")
# the "mtp" layout's own names -> the "layers" layout's, under model.layers.{num_layers}.
_MTP_NAMES = {"fc.weight": "eh_proj.weight", "pre_fc_norm_embedding.weight": "enorm.weight",
              "pre_fc_norm_hidden.weight": "hnorm.weight", "norm.weight": "shared_head.norm.weight"}
_ONE_PLUS_W = ("qwen3_5_moe",)  # families whose RMSNorms scale by 1 + w (the MTP norms too)

K = TypeVar("K")


def declared_mtp_layers(raw: Mapping[str, Any]) -> int | None:
    """The MTP layer count config.json declares, or None when it says nothing."""
    for where in (raw, raw.get("text_config") or {}):
        for key in DECLARED:
            if where.get(key) is not None:
                return int(where[key])
    return None


def stored_keys(cfg: ModelConfig, keys: dict[str, K]) -> dict[str, K]:
    """The checkpoint's keys with the ``"mtp"`` layout renamed to the ``"layers"`` one, so that the
    family's own rules read the MTP decoder layer (``mtp.layers.{k}.`` -> ``model.layers.{n + k}.``;
    ``"blocks"``: ``mtp.{k}.`` -> ``layers.{n + k}.``, DeepSeek's own names for every layer)."""
    layout = LAYOUT.get(cfg.arch)
    if layout not in ("mtp", "blocks"):
        return keys
    n, out = cfg.num_layers, {}
    for key, value in keys.items():
        if layout == "blocks" and (m := re.match(r"mtp\.(\d+)\.(.*)", key)):
            key = f"layers.{n + int(m.group(1))}.{m.group(2)}"
        elif key.startswith("mtp."):
            rest = key[4:]
            m = re.match(r"layers\.(\d+)\.(.*)", rest)
            key = (f"model.layers.{n + int(m.group(1))}.{m.group(2)}" if m else
                   f"model.layers.{n}.{_MTP_NAMES.get(rest, rest)}")
        out[key] = value
    return out


def stored_mtp_layers(cfg: ModelConfig, keys: Mapping[str, Any]) -> int:
    """How many MTP layers the checkpoint holds: consecutive layers after the decoder's with an
    ``eh_proj`` (DeepSeek-V4: ``e_proj``; after ``stored_keys``), at most the count config.json declares."""
    if cfg.arch not in LAYOUT or cfg.mtp_layers:
        return cfg.mtp_layers
    found = 0
    prefix = re.compile(r"model\.(?:language_model\.)?layers\.(\d+)\.eh_proj\.weight" if LAYOUT[cfg.arch] != "blocks"
                        else r"(?:model\.)?layers\.(\d+)\.e_proj\.weight")
    layers = {int(m.group(1)) for k in keys if (m := prefix.fullmatch(k))}
    while cfg.num_layers + found in layers:
        found += 1
    declared = declared_mtp_layers(cfg.raw)
    return found if declared is None else min(found, declared)


def with_mtp(cfg: ModelConfig, count: int) -> ModelConfig:
    """``cfg`` with ``count`` MTP layers after the decoder's: MoE, full attention (DSA: its own indexer)."""
    if count <= 0 or cfg.mtp_layers:
        return cfg
    more = (False,) * count
    family = cfg.family
    if LAYOUT.get(cfg.arch) == "blocks":  # DeepSeek-V4: its settings say each layer's attention and router
        family = mtp_settings(cfg.family, cfg.raw, cfg.num_layers, count)
    return replace(
        cfg, mtp_layers=count, family=family, moe_layers=cfg.moe_layers + (True,) * count,
        sliding_windows=cfg.sliding_windows + (None,) * count,
        sparse_layers=cfg.sparse_layers + more if cfg.sparse_layers else (),
        dsa=replace(cfg.dsa, shared=cfg.dsa.shared + more) if cfg.dsa is not None else None,
        deltanet=replace(cfg.deltanet, layers=cfg.deltanet.layers + more) if cfg.deltanet is not None else None)


def rules(arch: str) -> tuple[Rule, ...]:
    """Checkpoint key -> canonical name for the MTP layers' own tensors (the decoder layer inside
    is read by the family's rules)."""
    if LAYOUT.get(arch) == "blocks":
        B = r"(?:model\.)?layers\.(?P<L>\d+)\."
        return (Rule(B + r"(?P<p>e|h)_proj\.weight", "{L}.mtp.{p}_proj"), Rule(B + r"(?P<p>e|h)norm\.weight", "{L}.mtp.{p}norm"),
                Rule(B + r"norm\.weight", "{L}.mtp.norm"), Rule(B + r"hc_head_(?P<p>fn|base|scale)", "{L}.mtp.hc_head_{p}"))
    ops = (plus_one(),) if arch in _ONE_PLUS_W else ()
    L = r"model\.(?:language_model\.)?layers\.(?P<L>\d+)\."
    return (Rule(L + r"enorm\.weight", "{L}.mtp.enorm", ops), Rule(L + r"hnorm\.weight", "{L}.mtp.hnorm", ops),
            Rule(L + r"eh_proj\.weight", "{L}.mtp.eh_proj"), Rule(L + r"shared_head\.norm\.weight", "{L}.mtp.norm", ops))


def mtp_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    H = cfg.hidden_size
    s: dict[str, tuple[int, ...]] = {}
    for L in range(cfg.num_layers, cfg.all_layers):
        if LAYOUT.get(cfg.arch) == "blocks":
            n = cfg.family.hc_mult
            s.update({f"{L}.mtp.enorm": (H,), f"{L}.mtp.hnorm": (H,), f"{L}.mtp.e_proj": (H, H), f"{L}.mtp.h_proj": (H, H),
                      f"{L}.mtp.norm": (H,), f"{L}.mtp.hc_head_fn": (n, n * H), f"{L}.mtp.hc_head_base": (n,),
                      f"{L}.mtp.hc_head_scale": (1,)})
            continue
        s.update({f"{L}.mtp.enorm": (H,), f"{L}.mtp.hnorm": (H,), f"{L}.mtp.eh_proj": (H, 2 * H),
                  f"{L}.mtp.norm": (H,)})
    return s
