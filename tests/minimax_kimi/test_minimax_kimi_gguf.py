"""MiniMax M2 and Kimi K2.5 through GGUF, under the names llama.cpp's ``gguf`` package gives them
(``minimax-m2``; Kimi K2.5's text model is ``deepseek2``).  MiniMax M3 has no llama.cpp
architecture, so it has no GGUF form."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np
import pytest
from engine_support import assert_same_weights

from moeswarm.model import Model, load_model, load_weights
from moeswarm.model._safetensors import open_folder
from moeswarm.model.gguf import GGUF_ARCH, NAME_MAP, GGUFFile, convert_to_gguf

ARCHS = ("minimax_m2", "kimi_k25")
LLAMA_CPP = {"minimax_m2": gguf.MODEL_ARCH.MINIMAXM2, "kimi_k25": gguf.MODEL_ARCH.DEEPSEEK2}


def run_logits(model: Model, ref) -> np.ndarray:  # type: ignore[no-untyped-def]
    cache = model.new_cache()
    out = [model.forward(np.asarray([ref.prompt_ids]), cache)[0]]
    out += [model.forward(np.asarray([[t]]), cache)[0] for t in ref.decode_tokens]
    return np.concatenate(out)


def _convert(folder: Path, out: Path, weight_type: str, experts_type: str | None = None) -> Path:
    convert_to_gguf(folder, out, weight_type=weight_type, experts_type=experts_type, sidecar=False)
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_convert_and_load_round_trips(family_checkpoints, arch: str, tmp_path: Path) -> None:
    folder, ref = family_checkpoints.get(arch)
    path = _convert(folder, tmp_path / f"{arch}.gguf", "F32")
    f = GGUFFile(path)
    assert f.architecture == GGUF_ARCH[arch] == gguf.MODEL_ARCH_NAMES[LLAMA_CPP[arch]]
    source, exact = load_weights(folder), load_weights(path)
    assert exact.config.arch == arch
    assert_same_weights(source, exact)
    expected = np.concatenate([ref.prefill_logits, ref.decode_logits])
    assert np.abs(run_logits(Model(exact), ref) - expected).max() <= 1e-4
    q8 = run_logits(load_model(_convert(folder, tmp_path / f"{arch}-q8.gguf", "F16", "Q8_0")), ref)
    assert np.abs(q8 - expected).max() <= 0.5 * np.abs(expected).max()
    assert (q8.argmax(-1) == expected.argmax(-1)).mean() >= 0.75


@pytest.mark.parametrize("arch", ARCHS)
def test_name_map_covers_the_checkpoint_and_agrees_with_gguf_py(family_checkpoints, arch: str) -> None:
    folder, _ = family_checkpoints.get(arch)
    weights = load_weights(folder)
    cfg = weights.config
    rows = {}
    for row in NAME_MAP[arch]:
        for L in range(cfg.num_layers) if "{L}" in row.hf else [0]:
            for E in range(cfg.num_experts) if "{E}" in row.hf else [0]:
                canonical = row.canonical.format(L=L, E=E)
                if canonical in weights.tensors and not (canonical == "lm_head" and cfg.tie_word_embeddings) or (
                        row.stacked and weights.experts.get(L, {}).get(E) is not None):
                    rows[row.hf.format(L=L, E=E)] = row.gguf.format(L=L)
    # transformers 5.24 saves Kimi K2.5's layers as ``blocks`` (see _rules_minimax_kimi); the hub says ``layers``
    language = {k.replace(".model.blocks.", ".model.layers.") for k in open_folder(folder)
                if arch != "kimi_k25" or k.startswith("language_model.")}  # Kimi: not the vision tower
    assert set(rows) == language
    known = gguf.get_tensor_name_map(LLAMA_CPP[arch], cfg.num_layers)
    for row in NAME_MAP[arch]:
        if row.stacked:
            continue
        hf = row.hf.format(L=0).removeprefix("language_model.")
        hf = hf.replace("e_score_correction_bias", "e_score_correction.bias")
        theirs = known.get_name(hf, try_suffixes=(".weight", ".bias"))
        if hf.endswith("block_sparse_moe.e_score_correction.bias"):  # llama.cpp's M2 converter renames it first
            theirs = known.get_name(hf.replace("block_sparse_moe.", "mlp.gate."), try_suffixes=(".weight", ".bias"))
        assert theirs is not None and row.gguf.format(L=0) == theirs and not row.invented, (hf, row.gguf, theirs)


@pytest.mark.parametrize("arch", ARCHS)
def test_llama_cpp_keys_alone_rebuild_the_config(family_checkpoints, arch: str, tmp_path: Path) -> None:
    folder, _ = family_checkpoints.get(arch)
    f = GGUFFile(_convert(folder, tmp_path / f"{arch}.gguf", "F16"))
    exact = f.config()
    f.meta = {k: v for k, v in f.meta.items() if not k.startswith("moeswarm.")}  # as from another converter
    rebuilt = f.config()
    differ = {x.name for x in dataclasses.fields(exact) if getattr(exact, x.name) != getattr(rebuilt, x.name)}
    # a llama.cpp deepseek2 file does not say it came from Kimi K2.5: it reads as DeepSeek-V3, the same model
    assert differ <= ({"raw", "arch"} if arch == "kimi_k25" else {"raw"})


def test_minimax_m3_has_no_gguf_form_and_says_so(family_checkpoints, tmp_path: Path) -> None:
    from moeswarm.errors import ConfigError

    folder, _ = family_checkpoints.get("minimax_m3_vl")
    assert not any("MINIMAXM3" in a.name for a in gguf.MODEL_ARCH)  # re-check when gguf learns it
    with pytest.raises(ConfigError, match="minimax_m3_vl has no GGUF form"):
        convert_to_gguf(folder, tmp_path / "m3.gguf", weight_type="F32", sidecar=False)
    assert not (tmp_path / "m3.gguf").exists()
