"""GGUF files written by llama.cpp's own converter (``convert_hf_to_gguf.py``) for the families whose
transformers class it converts, read by the engine (``llama_cpp_tools``: the converter from llama-cpp-python
0.3.36's sdist, fetched from PyPI by the ``llama_cpp_src`` fixture).  llama.cpp's runtime on both converters'
files is checked out of the suite, by scripts/gguf_llama_cpp_check.py (it needs llama-cpp-python, ~8 minutes
of compiling).

For each family, on its tiny transformers oracle checkpoint (tests/oracle_*.py), F32:
* the engine on llama.cpp's file gives transformers' logits (whole prefill, then cached decode steps)
  within 1e-4 and its greedy tokens;
* ``convert-gguf``'s file holds the same tensors bit for bit (names, GGML types, bytes) and every
  hyper-parameter key llama.cpp's converter writes, with its value.

Llama 4: llama.cpp fixes the attention chunk, NoPE interval, temperature and q/k norm its keys do not carry,
so its checkpoint here (``oracle_llama4_llama_cpp``) takes llama.cpp's values; its llama3 RoPE scaling travels
as llama.cpp's ``rope_freqs`` tensor, which both converters write and the engine reads back.
dots1, ernie4_5_moe: checkpoints with what llama.cpp's architecture cannot express switched off
(``oracle_llama_cpp_variants``).
Mistral 4: llama.cpp's converter takes it as ``Mistral3ForConditionalGeneration`` (``as_mistral3``), without
its ``llama_4_scaling_beta`` (the checkpoint's original context is past the reference positions), and writes
MLA absorbed, as for DeepSeek-V3: the engine rebuilds ``kv_b`` from ``attn_k_b`` / ``attn_v_b`` and splits
``ffn_gate_up_exps``.
GLM-4.7-Flash: llama.cpp's converter writes it as ``deepseek2`` (absorbed, as DeepSeek-V3); the oracle's dense layer
after a MoE one (``glm4_moe_lite_dense_between``: llama.cpp's deepseek2 graph cannot run it) is read back from the
tensors.
Hunyuan-A13B, PhiMoE, Qwen3-Next, MiMo-V2-Flash: variants llama.cpp can express (``oracle_llama_cpp_variants``).
Qwen3-Next and MiMo-V2-Flash are converted ``--no-mtp``; MiMo-V2-Flash from the hub's remote-code config.json keys
(``mimo_hub_keys``, read as the file it is: ``--raw-config``), Kimi Linear likewise (``kimi_hub_keys``, its dense
layer's MLP under the hub's ``mlp.`` names: ``kimi_hub_tensor``); both converters write its MLA absorbed.
"""

from __future__ import annotations

import json
from pathlib import Path

import llama_cpp_tools
import numpy as np
import pytest

from moeswarm.model import SamplingParams, generate, load_model, load_weights
from moeswarm.model.gguf import GGUFFile, convert_to_gguf

TOL = 1e-4
# llama.cpp's converter writes MLA absorbed (attn_k_b / attn_v_b, key_length = kv_lora_rank + rope, one
# key-value head) and the experts' gate and up fused (ffn_gate_up_exps); convert-gguf writes attn_kv_b and
# the two apart, which llama.cpp runs too: the files agree as weights, not byte for byte
ABSORBED_MLA = {"mistral4", "deepseek_v3", "glm4_moe_lite", "glm4_moe_lite_dense_between"}
# keys whose llama.cpp value is not the checkpoint's: Kimi Linear's value_length is transformers' derived head_dim
# (qk_rope_head_dim) there; convert-gguf writes the absorbed latent's width, as for deepseek2 (llama.cpp runs both)
KEYS_DIFFER = {"kimi_linear": {"kimi-linear.attention.value_length"}}

CASES = {
    "glm4_moe": ("oracle_glm4", "glm4_moe", "per_expert"),
    "granitemoe": ("oracle_granite", "granitemoe", "per_expert"),
    "granitemoeshared": ("oracle_granite", "granitemoeshared", "per_expert"),
    "dbrx": ("oracle_dbrx",),
    "llama4": ("oracle_llama4_llama_cpp",),
    "dots1": ("oracle_llama_cpp_variants", "dots1"),
    "ernie4_5_moe": ("oracle_llama_cpp_variants", "ernie4_5_moe"),
    "mistral4": ("oracle_llama_cpp_variants", "mistral4"),
    "deepseek_v3": ("oracle", "deepseek_v3", "per_expert"),
    "glm4_moe_lite": ("oracle_llama_cpp_variants", "glm4_moe_lite"),
    "glm4_moe_lite_dense_between": ("oracle_glm4", "glm4_moe_lite", "per_expert"),  # llama.cpp's runtime refuses it
    "hunyuan_v1_moe": ("oracle_llama_cpp_variants", "hunyuan_v1_moe"),
    "phimoe": ("oracle_llama_cpp_variants", "phimoe"),
    "qwen3_next": ("oracle_llama_cpp_variants", "qwen3_next"),
    "mimo_v2_flash": ("oracle_llama_cpp_variants", "mimo_v2_flash"),
    "kimi_linear": ("oracle_llama_cpp_variants", "kimi_linear"),
}


def as_mistral3(config: dict) -> dict:
    """Mistral 4 as llama.cpp's converter takes it: it converts ``Mistral3ForConditionalGeneration`` only, and a
    text config of ``model_type`` mistral4 as Mistral 4 (``Mistral3Model.Mistral4Model``)."""
    return {**config, "architectures": ["Mistral3ForConditionalGeneration"]}


def mimo_hub_keys(config: dict) -> dict:
    """MiMo-V2-Flash's config.json as the hub's remote-code checkpoint has it (what llama.cpp's MimoV2Model reads:
    ``hybrid_layer_pattern``, the ``swa_*`` sizes, top-level RoPE keys), from transformers' form."""
    out = {k: v for k, v in config.items() if k != "rope_parameters"}
    full, sliding = config["rope_parameters"]["full_attention"], config["rope_parameters"]["sliding_attention"]
    kv = config["num_key_value_heads"]
    return {**out, "hybrid_layer_pattern": [int(t == "sliding_attention") for t in config["layer_types"]],
            "swa_head_dim": config["head_dim"], "swa_v_head_dim": config["v_head_dim"],
            "swa_num_attention_heads": config["num_attention_heads"], "swa_num_key_value_heads": 2 * kv,
            "topk_method": "noaux_tc", "layernorm_epsilon": config["rms_norm_eps"], "rope_theta": full["rope_theta"],
            "swa_rope_theta": sliding["rope_theta"], "partial_rotary_factor": full["partial_rotary_factor"]}


def kimi_hub_keys(config: dict) -> dict:
    """Kimi Linear's config.json as the hub's remote-code checkpoint has it (what llama.cpp's KimiLinearModel reads:
    ``linear_attn_config`` with 1-based layer lists, ``first_k_dense_replace``), from transformers' form."""
    full = [i + 1 for i, t in enumerate(config["layer_types"]) if t == "full_attention"]
    kda = [i + 1 for i, t in enumerate(config["layer_types"]) if t != "full_attention"]
    sparse = [t == "sparse" for t in config["mlp_layer_types"]]
    return {**config, "first_k_dense_replace": sparse.index(True), "mla_use_nope": True,
            "moe_router_activation_func": "sigmoid",
            "linear_attn_config": {"full_attn_layers": full, "kda_layers": kda, "num_heads": config["linear_num_heads"],
                                   "head_dim": config["linear_head_dim"],
                                   "short_conv_kernel_size": config["linear_conv_kernel_dim"]}}


def kimi_hub_tensor(name: str, config: dict) -> str:
    """The hub's name of a Kimi Linear tensor transformers 5.24 saved: its dense layers' MLP is ``mlp.*`` (transformers
    writes ``block_sparse_moe.*``, which llama.cpp's converter cannot name)."""
    parts = name.split(".")
    if parts[:2] == ["model", "layers"] and parts[3] == "block_sparse_moe" and \
            config["mlp_layer_types"][int(parts[2])] == "dense":
        return name.replace(".block_sparse_moe.", ".mlp.", 1)
    return name


# the config.json llama.cpp's converter is given, its tensors' names (else the checkpoint's), and its options
HUB_FORM = {"mistral4": as_mistral3, "mimo_v2_flash": mimo_hub_keys, "kimi_linear": kimi_hub_keys}
HUB_TENSORS = {"kimi_linear": kimi_hub_tensor}
CONVERTER_OPTIONS = {"qwen3_next": ("--no-mtp",),  # it otherwise expects Qwen3-Next's MTP layer
                     # as from the hub's remote-code config.json
                     "mimo_v2_flash": ("--no-mtp", "--raw-config"), "kimi_linear": ("--raw-config",)}


def for_converter(family: str, folder: Path, out: Path) -> Path:
    """The checkpoint as llama.cpp's converter reads ``family`` (``HUB_FORM``, ``HUB_TENSORS``)."""
    if family not in HUB_FORM:
        return folder
    from safetensors.numpy import load_file, save_file

    out.mkdir()
    config = json.loads((folder / "config.json").read_text())
    for f in folder.iterdir():
        if f.name == "config.json":
            (out / f.name).write_text(json.dumps(HUB_FORM[family](config)))
        elif f.suffix == ".safetensors" and family in HUB_TENSORS:
            tensors = load_file(f)
            save_file({HUB_TENSORS[family](k, config): v for k, v in tensors.items()}, out / f.name,
                      metadata={"format": "pt"})
        else:
            (out / f.name).symlink_to(f)
    return out


def engine_logits(path: Path, ref) -> np.ndarray:  # type: ignore[no-untyped-def]
    model = load_model(path)
    cache = model.new_cache()
    out = [model.forward(np.asarray([ref.prompt_ids]), cache)[0]]
    out += [model.forward(np.asarray([[t]]), cache)[0] for t in ref.decode_tokens]
    return np.concatenate(out)


def assert_same_weights(ours: Path, theirs: Path) -> None:
    """Both files read as the same engine weights, bit for bit."""
    a, b = load_weights(ours), load_weights(theirs)
    assert set(a.tensors) == set(b.tensors)
    for name, x in a.tensors.items():
        if name.endswith(".attn.A"):  # -exp(A_log): llama.cpp's in torch, ours in numpy (1 ulp apart)
            assert np.allclose(np.asarray(x), np.asarray(b.tensors[name]), rtol=1e-6, atol=0), name
        else:
            assert np.array_equal(np.asarray(x), np.asarray(b.tensors[name])), name
    for L, layer in a.experts.items():
        for e, x in layer.items():
            for part in ("gate", "up", "down"):
                assert np.array_equal(np.asarray(getattr(x, part)), np.asarray(getattr(b.experts[L][e], part))), (L, e)


def _value(v):  # type: ignore[no-untyped-def]
    return v if isinstance(v, str) else np.asarray(v, dtype=np.float64)


@pytest.mark.parametrize("family", list(CASES))
def test_llama_cpp_converter_file(family_oracles, llama_cpp_src: Path, family: str, tmp_path: Path) -> None:
    folder, ref = family_oracles.get(*CASES[family])
    source = for_converter(family, folder, tmp_path / "hub-form")
    theirs = llama_cpp_tools.convert(llama_cpp_src, source, tmp_path / "llama.cpp.gguf", "f32",
                                     *CONVERTER_OPTIONS.get(family, ()))

    expected = np.concatenate([ref.prefill_logits, ref.decode_logits])
    assert np.abs(engine_logits(theirs, ref) - expected).max() <= TOL
    model = load_model(theirs)
    assert list(generate(model, ref.prompt_ids, SamplingParams(max_new_tokens=len(ref.greedy_tokens)))) == \
        ref.greedy_tokens

    ours = convert_to_gguf(folder, tmp_path / "ours.gguf", weight_type="F32", sidecar=False).path
    f, g = GGUFFile(ours), GGUFFile(theirs)
    assert f.architecture == g.architecture
    if family in ABSORBED_MLA:
        assert_same_weights(ours, theirs)
        assert any(n.endswith(".attn_k_b.weight") for n in g.tensors) and \
            any(n.endswith(".attn_kv_b.weight") for n in f.tensors)
        return
    assert set(f.tensors) == set(g.tensors)
    for name, t in g.tensors.items():
        mine = f.tensors[name]
        assert mine.tensor_type == t.tensor_type, name
        if name == "rope_freqs.weight" or name.endswith(".ssm_a"):  # computed, not copied (ssm_a = -exp(A_log)):
            # llama.cpp in torch, ours in numpy (1 ulp apart)
            assert np.allclose(np.asarray(mine.data), np.asarray(t.data), rtol=1e-6, atol=0)
        else:
            assert np.array_equal(np.asarray(mine.data), np.asarray(t.data)), name
    for key, value in g.meta.items():
        if key.startswith(("general.", "tokenizer.", "GGUF.")) or key in KEYS_DIFFER.get(family, ()):
            continue
        assert key in f.meta, key
        assert np.array_equal(_value(f.meta[key]), _value(value)) or np.allclose(_value(f.meta[key]), _value(value)), \
            (key, f.meta[key], value)


def test_rope_freqs_read_back_as_llama3_scaling() -> None:
    """Llama 4 Scout's llama3 scaling (low = high factor: a step) and the oracle's (a band between), written
    as llama.cpp's rope_freqs, read back as the published parameters (Scout) or ones giving the same
    frequencies; divisors no llama3 scaling gives are refused, and so is one frequency between the bands."""
    import json
    from dataclasses import replace

    from moeswarm.model import ModelConfig
    from moeswarm.model._gguf_meta import llama3_factors, llama3_from_factors

    configs = Path(__file__).resolve().parents[2] / "moeswarm" / "model" / "configs"
    scout = ModelConfig.from_hf(json.loads((configs / "llama-4-scout.json").read_text())).rope
    factors = llama3_factors(scout)
    assert factors.max() == scout.factor and factors.min() == 1.0
    assert llama3_from_factors(factors, scout.theta, scout.dim) == {
        "rope_type": "llama3", "factor": scout.factor, "low_freq_factor": scout.low_freq_factor,
        "high_freq_factor": scout.high_freq_factor, "original_max_position_embeddings": scout.original_max_position}

    band = replace(scout, low_freq_factor=1.0, high_freq_factor=16.0, original_max_position=1024)
    factors = llama3_factors(band)
    params = llama3_from_factors(factors, band.theta, band.dim)
    assert (params["low_freq_factor"], params["high_freq_factor"]) == (8.0, 128.0)  # 1024 -> 8192: x 8
    bent = factors.copy()
    bent[np.flatnonzero((factors > 1) & (factors < band.factor))[0]] *= 1.01
    with pytest.raises(ValueError, match="not a llama3"):
        llama3_from_factors(bent, band.theta, band.dim)
    one = llama3_factors(replace(band, high_freq_factor=1.2))
    assert ((one > 1) & (one < band.factor)).sum() == 1
    with pytest.raises(ValueError, match="one frequency between"):
        llama3_from_factors(one, band.theta, band.dim)
