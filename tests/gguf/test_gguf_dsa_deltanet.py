"""GLM-5 (llama.cpp ``glm-dsa``) and Qwen3.5-MoE (``qwen35moe``) through GGUF: converted, loaded and
run against transformers; the files read by gguf-py's own ``GGUFReader`` and checked against
llama.cpp's conversion rules (convert_hf_to_gguf.py: Qwen3NextModel, _LinearAttentionVReorderBase,
GlmMoeDsaModel) written out here from the safetensors checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors import safe_open

from moeswarm.model import SamplingParams, generate, load_model

TOL = 1e-4


def hf(folder: Path, key: str) -> np.ndarray:
    with safe_open(folder / "model.safetensors", "np") as f:
        return f.get_tensor(key)


def gguf_tensors(path: Path) -> tuple[dict[str, object], dict[str, np.ndarray]]:
    reader = gguf.GGUFReader(path)
    meta = {name: f.contents() for name, f in reader.fields.items()}
    return meta, {t.name: np.asarray(t.data) for t in reader.tensors}


def llama_cpp_v_reorder(a: np.ndarray, axis: int, nk: int, nv: int, head: int) -> np.ndarray:
    """llama.cpp ``_reorder_v_heads``: value heads grouped by key head -> tiled, along ``axis``."""
    a = np.moveaxis(a, axis, 0)
    shape = a.shape
    a = a.reshape(nk, nv // nk, head, *shape[1:]).swapaxes(0, 1).reshape(shape)
    return np.moveaxis(a, 0, axis)


@pytest.mark.parametrize("arch", ["glm_moe_dsa", "qwen3_5_moe"])
def test_f32_gguf_matches_transformers(oracle_checkpoints, gguf_checkpoints, arch: str) -> None:
    _, ref = oracle_checkpoints.get(arch, "per_expert")
    model = load_model(gguf_checkpoints.get(arch, "F32"))
    cache = model.new_cache()
    prefill = model.forward(np.asarray([ref.prompt_ids]), cache)[0]
    decode = np.stack([model.forward(np.asarray([[t]]), cache)[0, -1] for t in ref.decode_tokens])
    assert np.abs(prefill - ref.prefill_logits).max() <= TOL
    assert np.abs(decode - ref.decode_logits).max() <= TOL
    params = SamplingParams(max_new_tokens=len(ref.greedy_tokens))
    assert list(generate(model, ref.prompt_ids, params)) == ref.greedy_tokens


def test_qwen3_5_gguf_is_laid_out_as_llama_cpp_writes_it(oracle_checkpoints, gguf_checkpoints) -> None:
    folder, _ = oracle_checkpoints.get("qwen3_5_moe", "per_expert")
    text = json.loads((folder / "config.json").read_text())["text_config"]
    nk, nv = text["linear_num_key_heads"], text["linear_num_value_heads"]
    dk, dv = text["linear_key_head_dim"], text["linear_value_head_dim"]
    assert nv > nk  # the value-head reorder is exercised
    meta, t = gguf_tensors(gguf_checkpoints.get("qwen3_5_moe", "F32"))
    assert meta["general.architecture"] == "qwen35moe"
    for key, value in {"ssm.conv_kernel": text["linear_conv_kernel_dim"], "ssm.state_size": dk,
                       "ssm.group_count": nk, "ssm.time_step_rank": nv, "ssm.inner_size": nv * dv,
                       "full_attention_interval": 2, "expert_count": text["num_experts"],
                       "rope.dimension_count": int(text["head_dim"] * 0.25)}.items():
        assert meta[f"qwen35moe.{key}"] == value, key
    p = "model.language_model.layers."
    for L, kind in enumerate(text["layer_types"]):
        b = f"blk.{L}."
        assert np.array_equal(t[b + "attn_norm.weight"], hf(folder, f"{p}{L}.input_layernorm.weight") + 1)
        assert np.array_equal(t[b + "post_attention_norm.weight"],
                              hf(folder, f"{p}{L}.post_attention_layernorm.weight") + 1)
        if kind == "full_attention":
            assert np.array_equal(t[b + "attn_q.weight"], hf(folder, f"{p}{L}.self_attn.q_proj.weight"))
            assert np.array_equal(t[b + "attn_q_norm.weight"], hf(folder, f"{p}{L}.self_attn.q_norm.weight") + 1)
            assert b + "ssm_a" not in t
            continue
        la = f"{p}{L}.linear_attn."
        qkv = hf(folder, la + "in_proj_qkv.weight")
        v_rows = llama_cpp_v_reorder(qkv[2 * nk * dk:], 0, nk, nv, dv)
        assert np.array_equal(t[b + "attn_qkv.weight"], np.concatenate([qkv[: 2 * nk * dk], v_rows]))
        assert np.array_equal(t[b + "attn_gate.weight"], llama_cpp_v_reorder(hf(folder, la + "in_proj_z.weight"), 0, nk, nv, dv))
        assert np.array_equal(t[b + "ssm_beta.weight"], llama_cpp_v_reorder(hf(folder, la + "in_proj_b.weight"), 0, nk, nv, 1))
        assert np.array_equal(t[b + "ssm_alpha.weight"], llama_cpp_v_reorder(hf(folder, la + "in_proj_a.weight"), 0, nk, nv, 1))
        a = -np.exp(hf(folder, la + "A_log").astype(np.float32))
        assert np.allclose(t[b + "ssm_a"], llama_cpp_v_reorder(a, 0, nk, nv, 1), rtol=1e-6, atol=0)
        assert np.array_equal(t[b + "ssm_dt.bias"], llama_cpp_v_reorder(hf(folder, la + "dt_bias"), 0, nk, nv, 1))
        conv = hf(folder, la + "conv1d.weight").squeeze(1)
        conv_v = llama_cpp_v_reorder(conv[2 * nk * dk:], 0, nk, nv, dv)
        assert np.array_equal(t[b + "ssm_conv1d.weight"], np.concatenate([conv[: 2 * nk * dk], conv_v]))
        assert np.array_equal(t[b + "ssm_norm.weight"], hf(folder, la + "norm.weight"))  # no +1 here
        assert np.array_equal(t[b + "ssm_out.weight"], llama_cpp_v_reorder(hf(folder, la + "out_proj.weight"), 1, nk, nv, dv))
    assert not any("visual" in name or "vision" in name for name in t)


def test_glm5_gguf_has_the_indexer_under_llama_cpp_names(oracle_checkpoints, gguf_checkpoints) -> None:
    folder, _ = oracle_checkpoints.get("glm_moe_dsa", "per_expert")
    cfg = json.loads((folder / "config.json").read_text())
    meta, t = gguf_tensors(gguf_checkpoints.get("glm_moe_dsa", "F32"))
    assert meta["general.architecture"] == "glm-dsa"
    assert meta["glm-dsa.attention.indexer.head_count"] == cfg["index_n_heads"]
    assert meta["glm-dsa.attention.indexer.key_length"] == cfg["index_head_dim"]
    assert meta["glm-dsa.attention.indexer.top_k"] == cfg["index_topk"]
    for L, kind in enumerate(cfg["indexer_types"]):
        p, b = f"model.layers.{L}.self_attn.indexer.", f"blk.{L}.indexer."
        if kind == "shared":
            assert b + "proj.weight" not in t
            continue
        assert np.array_equal(t[b + "attn_q_b.weight"], hf(folder, p + "wq_b.weight"))
        assert np.array_equal(t[b + "attn_k.weight"], hf(folder, p + "wk.weight"))
        assert np.array_equal(t[b + "k_norm.weight"], hf(folder, p + "k_norm.weight"))
        assert np.array_equal(t[b + "k_norm.bias"], hf(folder, p + "k_norm.bias"))
        assert np.array_equal(t[b + "proj.weight"], hf(folder, p + "weights_proj.weight"))
    dense = [L for L, kind in enumerate(cfg["mlp_layer_types"]) if kind == "dense"]
    assert [L for L in range(cfg["num_hidden_layers"]) if f"blk.{L}.ffn_gate_inp.weight" not in t] == dense


@pytest.mark.parametrize("arch", ["glm_moe_dsa", "qwen3_5_moe"])
def test_convert_gguf_cli_then_generate_cli(oracle_checkpoints, tmp_path: Path, arch: str) -> None:
    folder, ref = oracle_checkpoints.get(arch, "per_expert")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "OPENBLAS_NUM_THREADS": "1"}
    out = tmp_path / "gguf" / "model.gguf"

    def cli(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "moeswarm.cli", *args], capture_output=True, text=True,
                              env=env, timeout=300, check=False)
        assert done.returncode == 0, done.stderr
        return done.stdout

    cli("convert-gguf", "--model", str(folder), "--out", str(out), "--type", "F32", "-q")
    expected = list(ref.greedy_tokens)
    if 2 in expected:  # eos ends generation
        expected = expected[: expected.index(2) + 1]
    got = cli("generate", "--model", str(out.parent), "--prompt-ids", json.dumps(ref.prompt_ids),
              "--max-new-tokens", str(len(ref.greedy_tokens)), "--print-token-ids")
    assert json.loads(got.strip().splitlines()[-1]) == expected
