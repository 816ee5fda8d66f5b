"""Test-side writers of quantised checkpoints in the layout their families publish them in.

Test-only (torch, transformers, compressed-tensors); the engine never imports it.  Each writer takes
a tiny float32 checkpoint from ``oracle.build_checkpoint`` and writes a copy whose weights are
quantised the way the hub checkpoints are:

* ``write_fp8(src, dst, block)``: DeepSeek-V3 / V3.2, GLM-5, MiniMax M2/M3. Every linear weight of
  the decoder layers (attention, dense MLP, shared and routed experts) becomes
  ``X.weight`` float8_e4m3fn + ``X.weight_scale_inv`` float32 ``[R/br, C/bc]`` (the per-block
  scale, max |w| / 448); embeddings, LM head, norms and the router stay float32.
  ``quantization_config = {quant_method: fp8, fmt: e4m3, activation_scheme: dynamic,
  weight_block_size: [br, bc]}``.
* ``write_mxfp4(src_packed, dst)``: gpt-oss. ``mlp.experts.gate_up_proj`` ``[E, H, 2I]`` becomes
  ``gate_up_proj_blocks`` uint8 ``[E, 2I, H/32, 16]`` + ``gate_up_proj_scales`` uint8
  ``[E, 2I, H/32]`` (out-major, gate/up rows interleaved as in the packed tensor's last axis), and
  ``down_proj`` ``[E, I, H]`` likewise ``[E, H, I/32, 16]`` + ``[E, H, I/32]``; each group of 32
  inputs gets an e8m0 exponent and e2m1 codes, two per byte, low nibble first. Biases, attention,
  router, embeddings stay. ``quantization_config = {quant_method: mxfp4, modules_to_not_convert: ...}``.
* ``write_int4(src, dst, group)``: Kimi K2.x. Routed experts' weights become compressed-tensors
  ``pack-quantized``: ``weight_packed`` int32 ``[R, C/8]`` (compressed-tensors' own
  ``pack_to_int32``), ``weight_scale`` bf16 ``[R, C/group]``, ``weight_shape`` int32 ``[2]``;
  symmetric 4-bit, scales rounded to bf16 as published. compressed-tensors dequantises in bf16,
  rounding q * scale (8 significant bits of the scale times 4 of q) to bf16; the engine computes it
  exactly in float32.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from oracle import read_tensors  # type: ignore[import-not-found]

FP8_MAX = 448.0
FP4_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])

_FP8_TARGETS = re.compile(
    r"model\.layers\.\d+\.(self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
    r"|mlp\.(gate_proj|up_proj|down_proj)|mlp\.shared_experts\.(gate|up|down)_proj"
    r"|(mlp|block_sparse_moe)\.experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3))\.weight")
_EXPERT_WEIGHT = re.compile(r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight")


def _copy_side_files(src: Path, dst: Path) -> dict:
    dst.mkdir(parents=True, exist_ok=False)
    for f in src.iterdir():
        if not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    return json.loads((src / "config.json").read_text())


def _write(dst: Path, tensors: dict[str, torch.Tensor], config: dict) -> None:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config, indent=2))


def fp8_block_quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales ``[ceil(R/br), ceil(C/bc)]``: a matrix smaller than a block (DeepSeek's 128 x 128 on a
    tiny model) or not a multiple of it gets partial blocks at its edges, as DeepSeek's own
    ``weight_dequant`` reads them."""
    R, C = w.shape
    br, bc = block
    nr, nc = -(-R // br), -(-C // bc)
    padded = torch.zeros(nr * br, nc * bc)
    padded[:R, :C] = w.float()
    scale = padded.reshape(nr, br, nc, bc).abs().amax(dim=(1, 3)) / FP8_MAX  # (ceil(R/br), ceil(C/bc))
    per_weight = scale.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:R, :C]
    q = (w.float() / per_weight).to(torch.float8_e4m3fn)
    return q, scale.float()


def write_fp8(src: Path, dst: Path, block: tuple[int, int] = (8, 16)) -> Path:
    config = _copy_side_files(Path(src), Path(dst))
    out: dict[str, torch.Tensor] = {}
    for name, t in read_tensors(Path(src)).items():
        if _FP8_TARGETS.fullmatch(name):
            q, s = fp8_block_quantize(t, block)
            out[name], out[name + "_scale_inv"] = q, s
        else:
            out[name] = t
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    _write(Path(dst), out, config)
    return Path(dst)


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w ``(.., R, C)`` -> blocks uint8 ``(.., R, C/32, 16)``, scales uint8 ``(.., R, C/32)``."""
    *lead, R, C = w.shape
    g = w.float().reshape(*lead, R, C // 32, 32)
    amax = g.abs().amax(dim=-1).clamp_min(2.0**-100)
    exp = torch.ceil(torch.log2(amax / 6.0))  # 6 * 2**exp >= amax
    x = g / torch.exp2(exp)[..., None]
    mag = (x.abs()[..., None] - FP4_GRID).abs().argmin(dim=-1)  # nearest e2m1 magnitude, 0..7
    codes = (mag | ((x < 0).to(torch.int64) << 3)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exp + 127).to(torch.uint8)


def write_mxfp4(src_packed: Path, dst: Path) -> Path:
    config = _copy_side_files(Path(src_packed), Path(dst))
    out: dict[str, torch.Tensor] = {}
    for name, t in read_tensors(Path(src_packed)).items():
        if name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
            blocks, scales = mxfp4_quantize(t.transpose(1, 2))  # [E, in, out] -> [E, out, in]
            out[name + "_blocks"], out[name + "_scales"] = blocks, scales
        else:
            out[name] = t
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                   "lm_head"],
    }
    _write(Path(dst), out, config)
    return Path(dst)


def int4_quantize(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric 4-bit groups with bf16 scales amax / 7, rounded to bf16 as published files hold
    them (so q * scale is generally not exact in bf16: compressed-tensors' bf16 decoding rounds it)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    R, C = w.shape
    g = w.float().reshape(R, C // group, group)
    scale = (g.abs().amax(dim=-1) / 7.0).to(torch.bfloat16)
    q = torch.clamp(torch.round(g / scale.float()[..., None]), -8, 7).reshape(R, C).to(torch.int8)
    return pack_to_int32(q, 4), scale


def write_int4(src: Path, dst: Path, group: int = 16) -> Path:
    config = _copy_side_files(Path(src), Path(dst))
    out: dict[str, torch.Tensor] = {}
    for name, t in read_tensors(Path(src)).items():
        if _EXPERT_WEIGHT.fullmatch(name):
            stem = name[: -len(".weight")]
            packed, scale = int4_quantize(t, group)
            out[stem + ".weight_packed"], out[stem + ".weight_scale"] = packed, scale
            out[stem + ".weight_shape"] = torch.tensor(list(t.shape), dtype=torch.int32)
        else:
            out[name] = t
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "kv_cache_scheme": None,
        "config_groups": {"group_0": {
            "targets": ["Linear"], "input_activations": None, "output_activations": None,
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group,
                        "dynamic": False, "actorder": None, "observer": "minmax", "observer_kwargs": {},
                        "block_structure": None},
        }},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
                   r"re:.*mlp\.gate$"],
    }
    _write(Path(dst), out, config)
    return Path(dst)


def transformers_reference(model_dir: Path, prompt: list[int], n_decode: int = 8):  # type: ignore[no-untyped-def]
    """``oracle.Reference`` of transformers 5.24 loading the quantised checkpoint on the CPU, where it
    dequantises every weight at load (FP8 and MXFP4 to the float32 asked for; compressed-tensors to
    its bf16 scale dtype, q * scale rounded to bf16, then widened to float32)."""
    import oracle  # type: ignore[import-not-found]

    model = oracle.load_model(model_dir)
    with torch.no_grad():
        for module in model.modules():
            for _, p in module.named_parameters(recurse=False):
                if p.dtype != torch.float32:
                    p.data = p.data.float()
    return oracle.run_model(model, prompt, n_decode)
