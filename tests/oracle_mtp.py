"""Test-side oracle for multi-token prediction: tiny random checkpoints that carry an MTP layer as
each family stores it, and transformers' ``MtpModel`` (transformers/modeling_layers.py) as reference.

``build_mtp_checkpoint(arch, out_dir, seed)`` builds the family's tiny model (``oracle.CONFIGS``)
with ``num_mtp_layers = 1`` and a transformers ``MtpModel`` beside it (embedding and LM head tied
to the model's; its layer randomised like the rest), then saves:

* the decoder as ``save_pretrained`` writes it, and the MTP decoder layer in the same format as
  layer ``n`` (a model with n + 1 layers is saved, then config.json says n again): the stored key
  names are those the family's hub checkpoints use for every layer;
* "layers" families (DeepSeek-V3/V3.2, GLM-5, Mixtral for the demo): ``model.layers.{n}.enorm``,
  ``hnorm``, ``eh_proj``, ``shared_head.norm`` beside that layer, ``num_nextn_predict_layers: 1``;
* Qwen3.5-MoE: ``mtp.layers.0.*``, ``mtp.fc``, ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``,
  ``mtp.norm``, ``mtp_num_hidden_layers: 1`` in text_config.

transformers 5.24 declares ``num_mtp_layers`` (and so ``MtpModel`` / ``MTPCandidateGenerator``
support) for DeepSeek-V3 only of these families; for DeepSeek-V3.2, GLM-5 (glm_moe_dsa) and
Qwen3.5-MoE the field is set on the config here, and ``MtpModel`` builds its layer from the
family's own decoder-layer class and norm, as it does for DeepSeek-V3 (GLM-5's decoder layer
returns (hidden, top-k indices), which 5.24's ``MtpLayer`` does not unpack: a forward hook keeps
the hidden states).

``mtp_reference(mtp, main, ids)``: the model's final-normed hidden states (``hidden_states[-1]``,
what ``MTPCandidateGenerator`` hands the MTP model) and the MTP logits of every slot j =
(hidden j, token j + 1) at position j + 1, from ``MtpModel.forward_layer`` and its shared head.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import torch
from oracle import _model_class, _quiet, make_config, reinit_hot
from safetensors.torch import load_file, save_file
from transformers.modeling_layers import MtpModel

MTP_ARCHS = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa", "qwen3_5_moe", "mixtral")
_EXTRA = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "post_norm": "shared_head.norm"}
_QWEN_EXTRA = {"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "eh_proj": "fc", "post_norm": "norm"}


def _with_mtp(cfg):  # type: ignore[no-untyped-def]
    text = cfg.get_text_config()
    text.num_mtp_layers = 1
    if cfg.model_type == "qwen3_5_moe":  # the last layer full attention, as in Qwen3.5's own (MtpModel takes
        text.layer_types = ["linear_attention", "linear_attention", "full_attention"]  # its norm class there)
    if getattr(text, "layer_types", None) is not None:
        text.mtp_layer_types = ["full_attention"]
    if getattr(text, "mlp_layer_types", None) is not None:
        text.mtp_mlp_layer_types = ["sparse"]
    if getattr(text, "indexer_types", None) is not None:
        text.mtp_indexer_types = ["full"]
    return cfg


def _longer(cfg):  # type: ignore[no-untyped-def]
    """The config of the same model with the MTP layer as one more decoder layer (for saving)."""
    big = copy.deepcopy(cfg)
    text = big.get_text_config()
    text.num_hidden_layers += 1
    for field, extra in (("layer_types", "full_attention"), ("mlp_layer_types", "sparse"), ("indexer_types", "full")):
        if getattr(text, field, None) is not None:
            setattr(text, field, list(getattr(text, field)) + [extra])
    return big


@torch.no_grad()
def build_mtp_checkpoint(arch: str, out_dir: Path, seed: int = 0):  # type: ignore[no-untyped-def]
    """-> (folder, the transformers model, its MtpModel)."""
    cfg = _with_mtp(make_config(arch))
    torch.manual_seed(seed)
    with _quiet():
        kw = {"attn_implementation": "eager", "dtype": torch.float32, "experts_implementation": "eager"}
        main = _model_class(cfg).from_config(cfg, **kw).eval()
        reinit_hot(main, seed)
        mtp = MtpModel(main, 1).eval()
        holder = torch.nn.Module()
        holder.config = main.config  # type: ignore[assignment]  # reinit_hot reads config.model_type
        holder.layers = mtp.layers
        reinit_hot(holder, seed + 1)
        big = _model_class(_longer(cfg)).from_config(_longer(cfg), **kw).eval()
    n = cfg.get_text_config().num_hidden_layers
    state = {k: v for k, v in main.state_dict().items()}
    prefix = "model.language_model.layers." if arch == "qwen3_5_moe" else "model.layers."
    for k, v in mtp.layers[0].mtp_block.state_dict().items():
        state[f"{prefix}{n}.{k}"] = v
    missing, unexpected = big.load_state_dict(state, strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)
    out_dir = Path(out_dir)
    with _quiet():
        big.save_pretrained(out_dir)
    files = sorted(out_dir.glob("*.safetensors"))
    assert len(files) == 1, files
    tensors = load_file(files[0])
    extra = {name: getattr(mtp.layers[0], name).weight for name in _EXTRA}
    if arch == "qwen3_5_moe":
        stored = {}
        for k, v in tensors.items():
            if k.startswith(f"{prefix}{n}."):
                stored["mtp.layers.0." + k[len(f"{prefix}{n}."):]] = v
            else:
                stored[k] = v
        stored.update({f"mtp.{_QWEN_EXTRA[name]}.weight": w for name, w in extra.items()})
    else:
        stored = dict(tensors)
        stored.update({f"model.layers.{n}.{_EXTRA[name]}.weight": w for name, w in extra.items()})
    save_file({k: v.contiguous() for k, v in stored.items()}, str(files[0]), metadata={"format": "pt"})
    raw = json.loads((out_dir / "config.json").read_text())
    text = raw.get("text_config", raw)
    text["num_hidden_layers"] = n
    for field in ("layer_types", "mlp_layer_types", "indexer_types"):
        if field in text and isinstance(text[field], list):
            text[field] = text[field][:n]
    if arch == "qwen3_5_moe":
        text["mtp_num_hidden_layers"] = 1
    else:
        raw["num_nextn_predict_layers"] = 1
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2))
    return out_dir, main, mtp


@torch.no_grad()
def mtp_reference(mtp, main, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:  # type: ignore[no-untyped-def]
    """-> (hidden (T, H) float32, MTP logits (T - 1, V) float32 of slots 0 ... T - 2)."""
    with _quiet():
        x = torch.tensor([ids])
        hidden = main(x, output_hidden_states=True).hidden_states[-1]  # the final-normed states
        positions = torch.arange(1, len(ids))[None]
        # GLM-5's decoder layer returns (hidden, top-k indices); MtpLayer (5.24) expects the hidden only
        hook = mtp.layers[0].mtp_block.register_forward_hook(lambda m, i, o: o[0] if isinstance(o, tuple) else o)
        try:
            g = mtp.forward_layer(0, hidden[:, :-1], positions, None, input_ids=x[:, 1:])
        finally:
            hook.remove()
        logits = mtp._project_to_logits(g)
    return hidden[0].float().numpy(), logits[0].float().numpy()
