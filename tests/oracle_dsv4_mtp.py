"""Test-side oracle for DeepSeek-V4's multi-token-prediction layer (``mtp.0.*``).

transformers 5.24 does not build V4's MTP layer (``DeepseekV4PreTrainedModel`` ignores ``mtp.*`` on
load), so the oracle composes it from 5.24's own V4 classes, wired as the specification says:

* the specification: DeepSeek's ``inference/model.py`` (``MTPBlock``, ``ParallelHead.hc_head``,
  ``Transformer.__init__``), shipped in the hub repos deepseek-ai/DeepSeek-V4-Flash and -Pro and
  read here from its copy in github.com/Nicooo-Wang/DeepSeek-V4-Pro-code (commit
  0ec3a03c2fc34f29b2e72696ceaed9ae7a373aeb, ``inference/model.py``); vLLM's
  ``vllm/model_executor/models/deepseek_v4_mtp.py`` (vllm-project/vllm, commit
  023da1fc828eb07787cf0734a1ba32f0a0f11887) reads the same keys and computes the same;
* the block's math: ``DeepseekV4DecoderLayer`` (attention, MoE, both hyper-connections),
  ``DeepseekV4RMSNorm`` (enorm, hnorm, norm) and ``DeepseekV4HyperHead`` (the layer's own
  ``hc_head``), from transformers 5.24, and ``nn.Linear`` for ``e_proj`` / ``h_proj``.

The MTP layer is layer n of a config with n + 1 layers: its attention ``sliding_attention`` (the
hub's ``compress_ratios`` has n + 1 entries, the last 0) and its MoE ``moe`` (score-routed:
``Gate.hash = layer_id < n_hash_layers``).  ``build_mtp_checkpoint`` saves ``oracle_dsv4``'s tiny
model in DeepSeek's own names (``save_pretrained``'s original format, as the hub stores V4) with
the MTP layer's tensors under ``mtp.0.`` as the hub names them (``mtp.0.attn.wq_a.weight``,
``mtp.0.ffn.experts.E.w1.weight``, ``mtp.0.hc_attn_fn``, ``mtp.0.e_proj.weight``,
``mtp.0.enorm.weight``, ``mtp.0.norm.weight``, ``mtp.0.hc_head_fn``, ...), and config.json
``num_nextn_predict_layers: 1``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from oracle import _quiet
from oracle_dsv4 import CONFIG_FIELDS, _reinit, build_model
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.masking_utils import create_sliding_window_causal_mask
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4DecoderLayer,
    DeepseekV4HyperHead,
    DeepseekV4RMSNorm,
)

N = CONFIG_FIELDS["num_hidden_layers"]


def longer_config() -> DeepseekV4Config:
    """The model's config with the MTP layer as layer n (sliding attention, a score-routed MoE)."""
    fields = dict(CONFIG_FIELDS, num_hidden_layers=N + 1, layer_types=[*CONFIG_FIELDS["layer_types"], "sliding_attention"],
                  mlp_layer_types=[*CONFIG_FIELDS["mlp_layer_types"], "moe"])
    return DeepseekV4Config(**fields)


class MtpBlock(nn.Module):
    """DeepSeek's ``MTPBlock`` (its parameters: ``MTPBlock.__init__``) over transformers' classes."""

    def __init__(self, config: DeepseekV4Config) -> None:
        super().__init__()
        self.config = config  # reinit_hot reads config.model_type
        H, eps = config.hidden_size, config.rms_norm_eps
        self.block = DeepseekV4DecoderLayer(config, N)  # MTPBlock(Block): Block(layer_id=n_layers)
        self.e_proj = nn.Linear(H, H, bias=False)  # self.e_proj = Linear(args.dim, args.dim)
        self.h_proj = nn.Linear(H, H, bias=False)  # self.h_proj = Linear(args.dim, args.dim)
        self.enorm = DeepseekV4RMSNorm(H, eps)  # self.enorm = RMSNorm(args.dim, args.norm_eps)
        self.hnorm = DeepseekV4RMSNorm(H, eps)  # self.hnorm = RMSNorm(args.dim, args.norm_eps)
        self.norm = DeepseekV4RMSNorm(H, eps)  # self.norm = RMSNorm(args.dim, args.norm_eps)
        self.hc_head = DeepseekV4HyperHead(config)  # hc_head_fn (n, n*H), hc_head_base (n,), hc_head_scale (1,)

    def forward(self, main: Any, streams: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """MTPBlock.forward: streams (1, T, n, H) the model's before its hc_head, ids (1, T) -> logits."""
        e = main.model.embed_tokens(ids)  # e = self.embed(input_ids)  (embed shared: Transformer.__init__)
        e = self.enorm(e)  # e = self.enorm(e)
        x = self.hnorm(streams)  # x = self.hnorm(x)
        x = self.e_proj(e).unsqueeze(2) + self.h_proj(x)  # x = self.e_proj(e).unsqueeze(2) + self.h_proj(x)
        # x = super().forward(x, start_pos, input_ids): the block at positions 1 ... T, as DeepseekV4Model
        # hands a layer its rope tables and sliding-window mask
        position_embeddings = {kind: main.model.rotary_emb(e, position_ids=positions, layer_type=kind)
                               for kind in ("main", "compress")}
        mask = create_sliding_window_causal_mask(config=self.config, inputs_embeds=e, attention_mask=None, cache=None,
                                                 position_ids=positions)
        x = self.block(x, position_embeddings=position_embeddings, position_ids=positions, attention_mask=mask,
                       input_ids=ids, cache=None)
        # logits = self.head(x, self.hc_head_fn, self.hc_head_scale, self.hc_head_base, self.norm):
        # ParallelHead.forward = hc_head, then norm, then the shared head weight (Transformer.__init__)
        return main.lm_head(self.norm(self.hc_head(x)))


@torch.no_grad()
def build_mtp_checkpoint(out_dir: Path, seed: int = 0) -> tuple[Path, Any, MtpBlock]:
    """-> (folder, the transformers model, its MTP block)."""
    main = build_model(seed)
    big_cfg = longer_config()
    with _quiet():
        mtp = MtpBlock(big_cfg).float().eval()
        _reinit(mtp, seed + 7)
        big = DeepseekV4ForCausalLM(big_cfg).float().eval()
    state = dict(main.state_dict())
    state.update({f"model.layers.{N}.{k}": v for k, v in mtp.block.state_dict().items()})
    missing, unexpected = big.load_state_dict(state, strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)
    out_dir = Path(out_dir)
    with _quiet():
        big.save_pretrained(out_dir, save_original_format=True)  # DeepSeek's own names, as the hub
    files = sorted(out_dir.glob("*.safetensors"))
    assert len(files) == 1, files
    stored = {}
    for k, v in load_file(files[0]).items():
        layer = f"model.layers.{N}."  # the hub: mtp.0.attn.wq_a.weight beside layers.0.attn.wq_a.weight
        stored[f"mtp.0.{k[len(layer):]}" if k.startswith(layer) else k] = v
    assert "mtp.0.attn.wq_a.weight" in stored and "mtp.0.ffn.gate.bias" in stored and "mtp.0.hc_ffn_fn" in stored
    stored.update({f"mtp.0.{name}.weight": getattr(mtp, name).weight for name in ("e_proj", "h_proj", "enorm", "hnorm", "norm")})
    stored.update({f"mtp.0.hc_head_{p}": getattr(mtp.hc_head, f"hc_{p}") for p in ("fn", "base", "scale")})
    save_file({k: v.contiguous() for k, v in stored.items()}, str(files[0]), metadata={"format": "pt"})
    raw = json.loads((out_dir / "config.json").read_text())
    raw.update(num_hidden_layers=N, layer_types=raw["layer_types"][:N], mlp_layer_types=raw["mlp_layer_types"][:N],
               num_nextn_predict_layers=1)
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2))
    return out_dir, main, mtp


@torch.no_grad()
def mtp_reference(main: Any, mtp: MtpBlock, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """-> (the model's streams before its hc_head (T, n, H), MTP logits (T - 1, V) of slots 0 ... T - 2:
    slot j = (streams j, token j + 1) at position j + 1)."""
    seen: list[torch.Tensor] = []
    hook = main.model.hc_head.register_forward_hook(lambda m, inputs, out: seen.append(inputs[0]))
    try:
        with _quiet():
            x = torch.tensor([ids])
            main(x)
    finally:
        hook.remove()
    streams = seen[0]  # (1, T, n, H)
    with _quiet():
        logits = mtp(main, streams[:, :-1], x[:, 1:], torch.arange(1, len(ids))[None])
    return streams[0].float().numpy(), logits[0].float().numpy()

