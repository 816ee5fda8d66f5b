"""The files our converter writes, read by independent code: gguf-py's own ``GGUFReader`` and
``TensorNameMap`` (llama.cpp's names), safetensors, and llama.cpp's q/k permutation written out here."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import gguf
import ml_dtypes
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from safetensors import safe_open

from moeswarm.model import ARCHITECTURES, SamplingParams, Tokenizer, generate, load_model
from moeswarm.model._safetensors import open_folder
from moeswarm.model._qkernels import KernelExpert
from moeswarm.model.experts import F32Cache, f32
from moeswarm.model.gguf import GGUF_ARCH, NAME_MAP, GGUFFile, QuantizedTensor, embedded_file, hf_to_gguf
from moeswarm.model import ExpertWeights, load_weights


#: every architecture llama.cpp's gguf package names (not deepseek_v32: its deepseek2 has no DSA indexer)
GGUF_ARCHITECTURES = tuple(a for a in ARCHITECTURES if a in GGUF_ARCH)


def test_only_deepseek_v32_lacks_a_gguf_architecture() -> None:
    assert set(ARCHITECTURES) - set(GGUF_ARCH) == {"deepseek_v32"}
    assert "deepseek32" not in gguf.MODEL_ARCH_NAMES.values()  # revisit when gguf-py names it


def hf_tensor(folder: Path, key: str) -> np.ndarray:
    with safe_open(folder / "model.safetensors", "np") as f:
        return f.get_tensor(key)


def model_arch(arch: str) -> gguf.MODEL_ARCH:
    return {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[GGUF_ARCH[arch]]


def test_gguf_reader_sees_llama_cpp_names_and_hparams(oracle_checkpoints, gguf_checkpoints) -> None:
    folder, _ = oracle_checkpoints.get("qwen2_moe", "per_expert")
    path = gguf_checkpoints.get("qwen2_moe", "F16", "Q8_0")
    cfg = json.loads((folder / "config.json").read_text())
    reader = gguf.GGUFReader(path)
    meta = {name: f.contents() for name, f in reader.fields.items()}
    assert meta["general.architecture"] == "qwen2moe"
    for key, value in {
        "block_count": cfg["num_hidden_layers"], "embedding_length": cfg["hidden_size"],
        "expert_count": cfg["num_experts"], "expert_used_count": cfg["num_experts_per_tok"],
        "expert_feed_forward_length": cfg["moe_intermediate_size"],
        "expert_shared_feed_forward_length": cfg["shared_expert_intermediate_size"],
        "attention.head_count": cfg["num_attention_heads"], "attention.head_count_kv": cfg["num_key_value_heads"],
        "context_length": cfg["max_position_embeddings"], "rope.freq_base": cfg["rope_parameters"]["rope_theta"],
    }.items():
        assert meta[f"qwen2moe.{key}"] == value, key
    assert json.loads(meta["moeswarm.hf_config"]) == cfg
    # Every HF tensor under the name gguf-py's TensorNameMap gives it; per-expert tensors stacked per layer;
    # layer 1 is dense (mlp_only_layers), which llama.cpp's qwen2moe lacks: its generic ffn_* names.
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2MOE, cfg["num_hidden_layers"])
    expected = set()
    for key in open_folder(folder):
        if m := re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight", key):
            expected.add(f"blk.{m[1]}.ffn_{m[2]}_exps.weight")
        elif m := re.fullmatch(r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight", key):
            expected.add(f"blk.{m[1]}.ffn_{m[2]}.weight")
        else:
            expected.add(names.get_name(key, try_suffixes=(".weight", ".bias")))
    tensors = {t.name: t for t in reader.tensors}
    assert set(tensors) == expected
    H, I, E = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts"]
    gate = tensors["blk.2.ffn_gate_exps.weight"]
    assert gate.tensor_type == Q.Q8_0 and [int(d) for d in gate.shape] == [H, I, E]  # ggml ne order
    assert [int(d) for d in tensors["blk.2.ffn_down_exps.weight"].shape] == [I, H, E]
    w = hf_tensor(folder, "model.layers.2.mlp.experts.5.gate_proj.weight")
    one = dequantize(gate.data[5], Q.Q8_0)  # one expert's contiguous bytes, nothing else
    assert one.shape == w.shape and np.abs(one - w).max() <= np.abs(w).max() / 127  # Q8_0: half a step per block
    router = tensors["blk.2.ffn_gate_inp.weight"]
    assert router.tensor_type == Q.F32
    assert np.array_equal(router.data, hf_tensor(folder, "model.layers.2.mlp.gate.weight"))
    q = tensors["blk.0.attn_q.weight"]
    assert q.tensor_type == Q.F16
    assert np.array_equal(q.data, hf_tensor(folder, "model.layers.0.self_attn.q_proj.weight").astype(np.float16))


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py ``LlamaModel.permute``: rotary halves -> adjacent pairs, per head."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_mixtral_is_llama_arch_with_permuted_q_k(oracle_checkpoints, gguf_checkpoints) -> None:
    folder, _ = oracle_checkpoints.get("mixtral", "per_expert")
    cfg = json.loads((folder / "config.json").read_text())
    reader = gguf.GGUFReader(gguf_checkpoints.get("mixtral", "F32"))
    assert reader.fields["general.architecture"].contents() == "llama"
    tensors = {t.name: t.data for t in reader.tensors}
    for L in range(cfg["num_hidden_layers"]):
        q = hf_tensor(folder, f"model.layers.{L}.self_attn.q_proj.weight")
        k = hf_tensor(folder, f"model.layers.{L}.self_attn.k_proj.weight")
        assert np.array_equal(tensors[f"blk.{L}.attn_q.weight"], llama_cpp_permute(q, cfg["num_attention_heads"]))
        assert np.array_equal(tensors[f"blk.{L}.attn_k.weight"], llama_cpp_permute(k, cfg["num_key_value_heads"]))
        w3 = hf_tensor(folder, f"model.layers.{L}.block_sparse_moe.experts.6.w3.weight")
        assert np.array_equal(tensors[f"blk.{L}.ffn_up_exps.weight"][6], w3)
    # ... and the engine undoes it: same tensors as the safetensors checkpoint
    ours = load_weights(gguf_checkpoints.get("mixtral", "F32"))
    assert np.array_equal(np.asarray(ours["1.attn.q"]), hf_tensor(folder, "model.layers.1.self_attn.q_proj.weight"))


@pytest.mark.parametrize("arch", GGUF_ARCHITECTURES)
def test_name_map_covers_the_checkpoint_and_agrees_with_gguf_py(oracle_checkpoints, arch: str) -> None:
    folder, _ = oracle_checkpoints.get(arch, "per_expert")
    weights = load_weights(folder)
    cfg = weights.config
    rows = {}
    for row in NAME_MAP[arch]:
        for L in range(cfg.num_layers) if "{L}" in row.hf else [0]:
            for E in range(cfg.num_experts) if "{E}" in row.hf else [0]:
                canonical = row.canonical.format(L=L, E=E)
                held = weights.experts.get(L, {}).get(E)
                if canonical in weights.tensors or (row.stacked and held and getattr(held, canonical.split(".")[-1])
                                                    is not None):
                    rows[row.hf.format(L=L, E=E)] = row.gguf.format(L=L)
    hub = {k for k in open_folder(folder) if not k.startswith("model.visual.")}  # vision towers are not converted
    assert set(rows) == hub  # the table's HF column is exactly the hub layout
    known = gguf.get_tensor_name_map(model_arch(arch), cfg.num_layers)
    for row in NAME_MAP[arch]:  # every row, also those this tiny checkpoint does not use (e.g. o_proj.bias)
        if row.stacked:
            continue  # per-expert HF tensors are stacked by the converter; gguf-py maps only merged ones
        hf, name = row.hf.format(L=0), row.gguf.format(L=0)
        hf = hf.replace("model.language_model.", "model.")  # llama.cpp strips a VL checkpoint's prefix first
        theirs = known.get_name(hf.replace("e_score_correction_bias", "e_score_correction.bias")
                                .replace("linear_attn.dt_bias", "linear_attn.dt_proj.bias"),  # llama.cpp renames it
                                try_suffixes=(".weight", ".bias"))
        if theirs is None:
            assert row.invented, hf
        else:  # gguf-py leaves suffix-less HF names (attention sinks) without one; llama.cpp adds .weight
            assert name in (theirs, theirs + ".weight") and not row.invented, (hf, name, theirs)
    assert hf_to_gguf(arch)  # the public view of the table


@pytest.mark.parametrize("arch", GGUF_ARCHITECTURES + ("deepseek_v3_no_q_lora",))
def test_llama_cpp_keys_alone_rebuild_the_config(gguf_checkpoints, arch: str) -> None:
    f = GGUFFile(gguf_checkpoints.get(arch, "F16", "Q8_0"))
    exact = f.config()
    f.meta = {k: v for k, v in f.meta.items() if not k.startswith("moeswarm.")}  # as from another converter
    rebuilt = f.config()
    differ = {x.name for x in dataclasses.fields(exact) if getattr(exact, x.name) != getattr(rebuilt, x.name)}
    # llama.cpp has no key for gpt-oss's clamp (it hard-codes 7.0, the hub value; the oracle uses 1.5)
    assert differ <= ({"raw", "swiglu_limit"} if arch == "gpt_oss" else {"raw"})


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS, Q.IQ4_NL, Q.MXFP4, Q.Q8_0])
def test_one_expert_dequantises_from_its_own_bytes(tmp_path: Path, qtype: Q) -> None:
    """Formats gguf can only decode (K-quants, IQ4) as llama.cpp would write them: random blocks."""
    E, rows, cols = 3, 4, 256
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(int(qtype))
    raw = rng.integers(0, 0x40, (E, rows, cols // block * size), dtype=np.uint8)  # every fp16 scale finite
    path = tmp_path / "k.gguf"
    w = gguf.GGUFWriter(path, "qwen3moe")
    w.add_tensor("blk.0.ffn_up_exps.weight", raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = GGUFFile(path)
    full = dequantize(f.tensors["blk.0.ffn_up_exps.weight"].data, qtype).reshape(E, rows, cols)
    expert = f.experts("blk.0.ffn_up_exps.weight", (rows, cols), E)
    for e in range(E):
        qt = expert(e)
        assert isinstance(qt, QuantizedTensor) and qt.nbytes == raw[e].nbytes and qt.shape == (rows, cols)
        assert np.shares_memory(qt.raw, f.reader.data)  # a view of the map, not a copy
        assert np.array_equal(f32(qt), full[e])
        cached = F32Cache().get((0, e), ExpertWeights(qt, qt, qt))
        if qt.kernel_format:  # computed on the repacked kernel: the same weights (to float32 rounding)
            assert isinstance(cached, KernelExpert)
            assert np.abs(qt.packed().dequantize() - full[e]).max() <= 1e-6 * np.abs(full[e]).max()
        else:  # no kernel for this type: a float32 copy
            assert cached.up.dtype == np.float32 and np.array_equal(cached.up, full[e])
    assert np.array_equal(expert(1)[[3, 0]], full[1][[3, 0]])  # row lookups decode only those rows


def test_bf16_tensors_are_zero_copy_views(oracle_checkpoints, gguf_checkpoints) -> None:
    _, ref = oracle_checkpoints.get("qwen3_moe", "per_expert")
    model = load_model(gguf_checkpoints.get("qwen3_moe", "BF16"))
    gate = model.weights.experts[0][2].gate
    assert gate.dtype == ml_dtypes.bfloat16 and gate.shape == (32, 64) and not gate.flags.writeable
    base = gate
    while base is not None and not isinstance(base, np.memmap):
        base = base.base
    assert base is not None  # a view into the file's memory map, not an owned copy
    tokens = list(generate(model, ref.prompt_ids, SamplingParams(max_new_tokens=len(ref.greedy_tokens))))
    assert tokens[:4] == ref.greedy_tokens[:4]


def test_tokenizer_travels_with_the_gguf(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from moeswarm.demo import CHECKPOINT
    from moeswarm.model.gguf_cli import convert_gguf

    out = tmp_path / "demo" / "demo.gguf"
    result = CliRunner().invoke(convert_gguf, ["--model", str(CHECKPOINT), "--out", str(out),
                                               "--experts-type", "Q8_0", "--quiet"])
    assert result.exit_code == 0, result.output
    print(result.output)
    assert "one routed expert" in result.output and "tokenizer.json" in result.output
    assert embedded_file(out, "tokenizer.json") == (Path(CHECKPOINT) / "tokenizer.json").read_text()
    assert embedded_file(out, "config.json") == (Path(CHECKPOINT) / "config.json").read_text()
    # byte-identical beside it too: the swarm's model id (a hash of config.json) stays the same
    assert (out.parent / "config.json").read_bytes() == (Path(CHECKPOINT) / "config.json").read_bytes()
    assert sorted(p.name for p in out.parent.iterdir()) == sorted(
        ["demo.gguf", "config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"])
    tok = Tokenizer.from_folder(out.parent)
    ids = tok.encode("And it came to pass")
    ours = list(generate(load_model(out.parent), ids, SamplingParams(max_new_tokens=16)))
    theirs = list(generate(load_model(CHECKPOINT), ids, SamplingParams(max_new_tokens=16)))
    print(tok.decode(ours))
    assert ours == theirs  # a trained model: its greedy margins survive Q8_0 experts


def test_a_gguf_alone_re_encodes_with_its_embedded_files(tmp_path: Path) -> None:
    from moeswarm.demo import CHECKPOINT
    from moeswarm.model.gguf import convert_to_gguf

    first = convert_to_gguf(CHECKPOINT, tmp_path / "a" / "demo.f16.gguf", sidecar=False)
    assert not (tmp_path / "a" / "tokenizer.json").exists()
    second = convert_to_gguf(first.path, tmp_path / "b" / "demo.q8.gguf", weight_type="Q8_0")
    assert sorted(second.sidecars) == ["config.json", "generation_config.json", "tokenizer.json",
                                       "tokenizer_config.json"]
    assert (tmp_path / "b" / "tokenizer.json").read_bytes() == (Path(CHECKPOINT) / "tokenizer.json").read_bytes()
    kinds = {p.qtype.name for p in second.tensors if p.name == "blk.0.ffn_down_exps.weight"}
    assert kinds == {"Q8_0"}
    ids = Tokenizer.from_folder(tmp_path / "b").encode("And it came to pass")
    assert len(list(generate(load_model(tmp_path / "b"), ids, SamplingParams(max_new_tokens=4)))) == 4


def test_keep_expert_sources_and_byte_ranges(gguf_checkpoints) -> None:
    """A node holding some experts: only those are built; each names its slice of the stack, whose bytes
    (for madvise / fadvise) are exactly that expert's."""
    path = gguf_checkpoints.get("qwen2_moe", "F16", "Q8_0")
    w = load_weights(path, keep_expert=lambda L, e: e % 4 == 1)
    assert {L: sorted(layer) for L, layer in w.experts.items()} == {0: [1, 5, 9, 13], 2: [1, 5, 9, 13]}
    assert w.sources["2.experts.9.down"].key == "blk.2.ffn_down_exps.weight[9]"
    f = GGUFFile(path)
    start, end = f.byte_range("blk.2.ffn_down_exps.weight", 9)
    down = w.experts[2][9].down
    assert isinstance(down, QuantizedTensor) and end - start == down.nbytes
    assert bytes(np.asarray(f.reader.data[start:end])) == down.raw.tobytes()


def test_a_qwen3moe_file_without_the_norm_key_renormalises_as_llama_cpp_does(gguf_checkpoints) -> None:
    """llama.cpp's converter writes no ``expert_weights_norm`` for qwen3moe and its graph always renormalises the
    chosen experts' weights (src/models/qwen3moe.cpp, build_moe_ffn's norm_w = true, llama.cpp 0.3.36); read as
    not renormalised (the default before), benchmarks/llamacpp.py's real-depth Qwen3-30B-A3B-shaped F16 file gave
    logits correlated 0.963 with llama.cpp's and no greedy token in common."""
    f = GGUFFile(gguf_checkpoints.get("qwen3_moe", "F16", "Q8_0"))
    assert f.config().norm_topk_prob  # the oracle's, written by convert-gguf
    f.meta = {k: v for k, v in f.meta.items() if not k.startswith("moeswarm.") and not k.endswith("expert_weights_norm")}
    assert f.config().norm_topk_prob
