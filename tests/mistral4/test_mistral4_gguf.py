"""Mistral Small 4 (``mistral4``) through GGUF, under the names and keys llama.cpp's ``gguf`` package gives
its ``mistral4`` architecture: DeepSeek-V3's (deepseek2) tensor names, a softmax expert gate
(``expert_gating_func``), ``llama_4_scaling_beta`` and its length as ``attention.temperature_scale`` /
``attention.temperature_length``."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np
from engine_support import assert_same_weights

from moeswarm.model import Model, load_model, load_weights
from moeswarm.model.gguf import GGUF_ARCH, NAME_MAP, GGUFFile, convert_to_gguf


def run_logits(model: Model, ref) -> np.ndarray:  # type: ignore[no-untyped-def]
    cache = model.new_cache()
    out = [model.forward(np.asarray([ref.prompt_ids]), cache)[0]]
    out += [model.forward(np.asarray([[t]]), cache)[0] for t in ref.decode_tokens]
    return np.concatenate(out)


def test_convert_and_load_round_trips(mistral4_checkpoint, tmp_path: Path) -> None:
    folder, ref = mistral4_checkpoint.get()
    path = tmp_path / "mistral4.gguf"
    convert_to_gguf(folder, path, weight_type="F32", sidecar=False)
    f = GGUFFile(path)
    assert f.architecture == GGUF_ARCH["mistral4"] == gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MISTRAL4]
    assert f.meta["mistral4.expert_gating_func"] == gguf.ExpertGatingFuncType.SOFTMAX
    assert (f.meta["mistral4.attention.temperature_scale"], f.meta["mistral4.attention.temperature_length"]) == (0.5, 4)
    source, exact = load_weights(folder), load_weights(path)
    assert_same_weights(source, exact)
    expected = np.concatenate([ref.prefill_logits, ref.decode_logits])
    assert np.abs(run_logits(Model(exact), ref) - expected).max() <= 1e-4
    f.meta = {k: v for k, v in f.meta.items() if not k.startswith("moeswarm.")}  # as from another converter
    rebuilt, want = f.config(), exact.config
    differ = {x.name for x in dataclasses.fields(want) if getattr(want, x.name) != getattr(rebuilt, x.name)}
    assert differ <= {"raw", "model_id", "pad_token_id"}, differ
    q8 = tmp_path / "mistral4-q8.gguf"
    convert_to_gguf(folder, q8, weight_type="F16", experts_type="Q8_0", sidecar=False)
    assert (run_logits(load_model(q8), ref).argmax(-1) == expected.argmax(-1)).mean() >= 0.75


def test_name_map_agrees_with_gguf_py() -> None:
    known = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MISTRAL4, 4)
    for row in NAME_MAP["mistral4"]:
        hf = row.hf.format(L=0, E=0).replace("e_score_correction_bias", "e_score_correction.bias")
        if row.stacked:  # gguf-py knows the stacked experts without the expert index
            hf = hf.replace("experts.0.", "experts.")
        theirs = known.get_name(hf, try_suffixes=(".weight", ".bias"))
        assert theirs is not None and row.gguf.format(L=0) == theirs, (hf, row.gguf, theirs)
