"""Families whose GGUF form llama.cpp's architectures name, on their oracles' checkpoints (tests/oracle_*.py):
dots.llm1 (``dots1``: sliding-window layers, grouped key-value heads, q/k/v/o biases), ERNIE 4.5 MoE
(``ernie4_5-moe``: MoE on every other layer up to layer 3, tied embeddings), Hunyuan-A13B (``hunyuan-moe``: q/k
norms after RoPE, NTK alpha), PhiMoE (``phimoe``: LayerNorms with biases, LM-head bias, sparsemixer, longrope),
GLM-4.7-Flash (llama.cpp's ``deepseek2``: a dense layer between MoE ones), Qwen3-Next (``qwen3next``: gated
DeltaNet with in_proj_qkvz split as llama.cpp splits it, a dense layer), MiMo-V2-Flash (``mimo2``: per-layer
key-value heads, sliding layers with sinks and their own RoPE base, narrower values scaled) and Kimi Linear
(``kimi-linear``: KDA layers' convolutions and decay in llama.cpp's 4-D shapes, MLA without RoPE, absorbed).
What llama.cpp's architectures lack travels in the embedded config.json (and PhiMoE's jitter and long scale under ``moeswarm.phimoe.*``).
llama.cpp's own files: tests/gguf/test_gguf_llama_cpp_files.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np
import pytest
from test_gguf_numerics import (assert_every_weight_within_its_rounding, assert_within_precision, mismatch_report,
                                run_logits)

from moeswarm.model import Model, load_model, load_weights
from moeswarm.model._gguf_names import LEGACY_WHOLE
from moeswarm.model.gguf import GGUF_ARCH, NAME_MAP, GGUFFile, convert_to_gguf

ORACLES = {
    "dots1": ("oracle_families", "dots1", "per_expert"),
    "ernie4_5_moe": ("oracle_families", "ernie4_5_moe", "per_expert"),
    "hunyuan_v1_moe": ("oracle_families", "hunyuan_v1_moe", "per_expert"),
    "phimoe": ("oracle_phimoe", "per_expert"),
    "glm4_moe_lite": ("oracle_glm4", "glm4_moe_lite", "per_expert"),
    "qwen3_next": ("oracle_qwen3_next", "per_expert"),
    "mimo_v2_flash": ("oracle_mimo", "per_expert"),
    "kimi_linear": ("oracle_kimi_linear", "per_expert"),
}
# What llama.cpp's keys alone cannot say.  dots1: which layers slide.  hunyuan: the NTK-stretched base is a
# float32 key (1 ulp from the float64 one).  phimoe: sparsemixer's jitter (PhimoeConfig's 0.01 instead) and
# longrope's long scale (the short one instead) when our moeswarm.phimoe.* keys are dropped.
FROM_KEYS_ALONE_DIFFER = {"dots1": {"raw", "sliding_windows"}, "ernie4_5_moe": {"raw"},
                          "hunyuan_v1_moe": {"raw", "rope"}, "phimoe": {"raw", "family", "rope"},
                          "glm4_moe_lite": {"raw"}, "qwen3_next": {"raw"}, "mimo_v2_flash": {"raw"},
                          "kimi_linear": {"raw"}}
ARCH = {"dots1": gguf.MODEL_ARCH.DOTS1, "ernie4_5_moe": gguf.MODEL_ARCH.ERNIE4_5_MOE,
        "hunyuan_v1_moe": gguf.MODEL_ARCH.HUNYUAN_MOE, "phimoe": gguf.MODEL_ARCH.PHIMOE,
        "glm4_moe_lite": gguf.MODEL_ARCH.DEEPSEEK2, "qwen3_next": gguf.MODEL_ARCH.QWEN3NEXT,
        "mimo_v2_flash": gguf.MODEL_ARCH.MIMO2, "kimi_linear": gguf.MODEL_ARCH.KIMI_LINEAR}


@pytest.mark.parametrize("family", list(ORACLES))
def test_convert_gguf_round_trips(family_oracles, family: str, tmp_path: Path) -> None:
    folder, ref = family_oracles.get(*ORACLES[family])
    path = convert_to_gguf(folder, tmp_path / "model.gguf", weight_type="F32", sidecar=False).path
    f = GGUFFile(path)
    assert f.architecture == GGUF_ARCH[family] == gguf.MODEL_ARCH_NAMES[ARCH[family]]
    w = load_weights(path)
    source = load_weights(folder)
    assert set(w.tensors) == set(source.tensors)
    for name, a in source.tensors.items():
        assert np.array_equal(np.asarray(w.tensors[name]), a), name
    model = Model(w)
    expected = np.concatenate([ref.prefill_logits, ref.decode_logits])
    assert np.abs(run_logits(model, ref) - expected).max() <= 1e-4

    exact = f.config()
    f.meta = {k: v for k, v in f.meta.items() if not k.startswith("moeswarm.")}  # as from another converter
    rebuilt = f.config()
    differ = {x.name for x in dataclasses.fields(exact) if getattr(exact, x.name) != getattr(rebuilt, x.name)}
    assert differ == FROM_KEYS_ALONE_DIFFER[family]
    if family == "dots1":
        assert any(x is not None for x in exact.sliding_windows) and set(rebuilt.sliding_windows) == {None}
    if family in ("glm4_moe_lite", "qwen3_next"):  # a dense layer after a MoE one, found from the tensors
        assert rebuilt.moe_layers == exact.moe_layers and not all(exact.moe_layers) and exact.moe_layers[0]
    if family == "phimoe":
        assert np.allclose(rebuilt.rope.factors, exact.rope.factors, rtol=1e-7, atol=0)  # float32 tensor
        assert rebuilt.rope.long_mscale == rebuilt.rope.attention_factor != exact.rope.long_mscale
    if family == "hunyuan_v1_moe":
        assert rebuilt.rope.theta == pytest.approx(exact.rope.theta, rel=1e-7)


NEW = ["hunyuan_v1_moe", "phimoe", "glm4_moe_lite", "qwen3_next", "mimo_v2_flash", "kimi_linear"]


@pytest.mark.parametrize("family", NEW)
def test_f16_within_fp16_rounding(family_oracles, family: str, tmp_path: Path) -> None:
    """Every matrix F16: the logits within the type's bound of transformers' (test_gguf_numerics)."""
    folder, ref = family_oracles.get(*ORACLES[family])
    path = convert_to_gguf(folder, tmp_path / "model.gguf", weight_type="F16", sidecar=False).path
    assert_within_precision(run_logits(load_model(path), ref), ref, "F16", f"{family} F16")


# Teacher-forced greedy mismatches against the safetensors checkpoint over 8 prompts x 8 steps (the oracles
# are hot-initialised near ties: routers whose choice a 1/254 rounding flips; Qwen3-Next's 80-token prompt).
# Measured: F16 backbone + Q8_0 experts 1-4/64, every matrix Q8_0 2-15/64; every mismatch a near-tie.
Q8_0_MISMATCH_BOUND = {"F16": 0.1, "Q8_0": 0.3}


@pytest.mark.parametrize("family", NEW)
@pytest.mark.parametrize("weight_type", ["F16", "Q8_0"])
def test_q8_0_experts(family_oracles, family: str, weight_type: str, tmp_path: Path) -> None:
    """Q8_0 experts, the backbone ``weight_type``: every stored weight within Q8_0's rounding of the safetensors
    one as gguf-py decodes it (negative control: another expert's weights are caught), and every greedy
    mismatch a near-tie (a top-2 gap under twice the quantisation noise), at most the bound's rate."""
    folder, ref = family_oracles.get(*ORACLES[family])
    path = convert_to_gguf(folder, tmp_path / "model.gguf", weight_type=weight_type, experts_type="Q8_0",
                           sidecar=False).path
    assert_every_weight_within_its_rounding(path, folder, "Q8_0")
    rng = np.random.default_rng(0)
    prompts = [list(ref.prompt_ids)] + [rng.integers(3, 512, 16).tolist() for _ in range(7)]
    wrong, total, _, unexplained = mismatch_report(load_model(folder), load_model(path), prompts)
    print(f"{family} {weight_type}+Q8_0 experts: greedy mismatches {wrong}/{total}")
    assert wrong / total <= Q8_0_MISMATCH_BOUND[weight_type]
    assert not unexplained, unexplained


@pytest.mark.parametrize("family", list(ORACLES))
def test_name_map_agrees_with_gguf_py(family: str) -> None:
    """Every non-expert row is gguf-py's TensorNameMap's name for its HF key in llama.cpp's architecture; the
    rows we name ourselves (``invented``: Qwen3-Next's dense layers) are ones gguf-py has none for; Qwen3-Next's
    ``in_proj_qkvz`` is gguf-py's legacy ``ssm_in`` whole (read too), attn_qkv + attn_gate split."""
    known = gguf.get_tensor_name_map(ARCH[family], 6)
    for row in NAME_MAP[family]:
        if row.stacked:
            continue
        hf = row.hf.format(L=0).replace("e_score_correction_bias", "e_score_correction.bias")  # as llama.cpp
        hf = hf.replace(".dt_bias", ".dt_proj.bias")  # as llama.cpp renames it
        theirs = known.get_name(hf, try_suffixes=(".weight", ".bias"))
        if theirs is not None and theirs.endswith(".attn_sinks"):  # llama.cpp's converter appends .weight to it
            theirs += ".weight"
        if row.invented:
            assert theirs is None, (hf, theirs)
        elif (family, row.canonical) in LEGACY_WHOLE:
            assert theirs == LEGACY_WHOLE[family, row.canonical].format(L=0), (hf, theirs)
        else:
            assert theirs is not None and row.gguf.format(L=0) == theirs, (hf, row.gguf, theirs)


def test_qwen3_next_legacy_ssm_in_reads(family_oracles, tmp_path: Path) -> None:
    """llama.cpp's older Qwen3-Next files hold ``in_proj_qkvz`` whole, in the hub's order, as ``ssm_in`` (its
    qwen3next still runs them): convert-gguf's file with attn_qkv + attn_gate replaced by that tensor reads as the
    same weights; negative control: the same file with ssm_in's rows in llama.cpp's split order does not."""
    folder, _ = family_oracles.get(*ORACLES["qwen3_next"])
    ours = convert_to_gguf(folder, tmp_path / "model.gguf", weight_type="F32", sidecar=False).path
    source = load_weights(folder)

    def legacy(out: Path, split_order: bool) -> Path:
        src = gguf.GGUFReader(ours)
        writer = gguf.GGUFWriter(out, GGUF_ARCH["qwen3_next"])
        for field in src.fields.values():
            if field.name != gguf.Keys.General.ARCHITECTURE and not field.name.startswith("GGUF."):
                kind = field.types[0]
                writer.add_key_value(field.name, field.contents(), kind,
                                     sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
        tensors = {t.name: np.asarray(t.data) for t in src.tensors}
        for L in range(source.config.num_layers):
            if f"blk.{L}.attn_qkv.weight" in tensors:
                qkv, gate = tensors.pop(f"blk.{L}.attn_qkv.weight"), tensors.pop(f"blk.{L}.attn_gate.weight")
                tensors[f"blk.{L}.ssm_in.weight"] = np.concatenate([qkv, gate]) if split_order \
                    else np.asarray(source.tensors[f"{L}.attn.qkvz"])
        for name, a in tensors.items():
            writer.add_tensor(name, a)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return out

    w = load_weights(legacy(tmp_path / "legacy.gguf", split_order=False))
    assert "blk.0.ssm_in.weight" in GGUFFile(tmp_path / "legacy.gguf").tensors
    for name, a in source.tensors.items():
        assert np.array_equal(np.asarray(w.tensors[name]), a), name
    wrong = load_weights(legacy(tmp_path / "wrong.gguf", split_order=True))
    assert not np.array_equal(np.asarray(wrong.tensors["0.attn.qkvz"]), source.tensors["0.attn.qkvz"])
