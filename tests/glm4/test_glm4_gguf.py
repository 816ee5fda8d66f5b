"""GLM-4.5 (``glm4_moe``) through GGUF, under the names and keys llama.cpp's ``gguf`` package gives
its ``glm4moe`` architecture.  GLM-4.7-Flash (``glm4_moe_lite``) is llama.cpp's ``deepseek2``:
tests/gguf/test_gguf_families.py and test_gguf_llama_cpp_files.py."""

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


def run_logits(model: Model, ref) -> np.ndarray:  # type: ignore[no-untyped-def]
    cache = model.new_cache()
    out = [model.forward(np.asarray([ref.prompt_ids]), cache)[0]]
    out += [model.forward(np.asarray([[t]]), cache)[0] for t in ref.decode_tokens]
    return np.concatenate(out)


def _convert(folder: Path, out: Path, weight_type: str, experts_type: str | None = None) -> Path:
    convert_to_gguf(folder, out, weight_type=weight_type, experts_type=experts_type, sidecar=False)
    return out


@pytest.mark.parametrize("layout", ["per_expert", "packed"])
def test_convert_and_load_round_trips(glm4_checkpoints, layout: str, tmp_path: Path) -> None:
    folder, ref = glm4_checkpoints.get("glm4_moe", layout)
    path = _convert(folder, tmp_path / "glm.gguf", "F32")
    f = GGUFFile(path)
    assert f.architecture == GGUF_ARCH["glm4_moe"] == gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.GLM4_MOE]
    source, exact = load_weights(folder), load_weights(path)
    assert exact.config.arch == "glm4_moe"
    assert_same_weights(source, exact)
    expected = np.concatenate([ref.prefill_logits, ref.decode_logits])
    assert np.abs(run_logits(Model(exact), ref) - expected).max() <= 1e-4
    q8 = run_logits(load_model(_convert(folder, tmp_path / "glm-q8.gguf", "F16", "Q8_0")), ref)
    assert np.abs(q8 - expected).max() <= 0.5 * np.abs(expected).max()
    assert (q8.argmax(-1) == expected.argmax(-1)).mean() >= 0.75


def test_name_map_covers_the_checkpoint_and_agrees_with_gguf_py(glm4_checkpoints) -> None:
    folder, _ = glm4_checkpoints.get("glm4_moe")
    weights = load_weights(folder)
    cfg = weights.config
    rows = {}
    for row in NAME_MAP["glm4_moe"]:
        for L in range(cfg.num_layers) if "{L}" in row.hf else [0]:
            for E in range(cfg.num_experts) if "{E}" in row.hf else [0]:
                canonical = row.canonical.format(L=L, E=E)
                if canonical in weights.tensors or (row.stacked and weights.experts.get(L, {}).get(E) is not None):
                    rows[row.hf.format(L=L, E=E)] = row.gguf.format(L=L)
    assert set(rows) == set(open_folder(folder))
    known = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GLM4_MOE, cfg.num_layers)
    for row in NAME_MAP["glm4_moe"]:
        if row.stacked:
            continue
        hf = row.hf.format(L=0).replace("e_score_correction_bias", "e_score_correction.bias")
        theirs = known.get_name(hf, try_suffixes=(".weight", ".bias"))
        assert theirs is not None and row.gguf.format(L=0) == theirs and not row.invented, (hf, row.gguf, theirs)


def test_llama_cpp_keys_alone_rebuild_the_config(glm4_checkpoints, tmp_path: Path) -> None:
    folder, _ = glm4_checkpoints.get("glm4_moe")
    f = GGUFFile(_convert(folder, tmp_path / "glm.gguf", "F16"))
    exact = f.config()
    assert exact.rope.dim == 8 and exact.qk_norm == "head" and exact.qkv_bias
    f.meta = {k: v for k, v in f.meta.items() if not k.startswith("moeswarm.")}  # as from another converter
    rebuilt = f.config()
    assert {x.name for x in dataclasses.fields(exact) if getattr(exact, x.name) != getattr(rebuilt, x.name)} == {"raw"}
    assert f.meta[f"glm4moe.{gguf.Keys.Rope.DIMENSION_COUNT.split('.', 1)[1]}"] == 8
