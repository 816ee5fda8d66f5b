"""dots.llm1 (``dots1``) and ERNIE 4.5 MoE (``ernie4_5_moe``) through GGUF under llama.cpp's ``dots1`` and
``ernie4_5-moe`` names and keys, on the family oracles' checkpoints (dots1: sliding-window layers, grouped
key-value heads, q/k/v/o biases; ERNIE: MoE on every other layer up to layer 3, tied embeddings): what
llama.cpp's architectures lack travels in the embedded config.json.  llama.cpp's own files:
tests/gguf/test_gguf_llama_cpp_files.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np
import pytest

from moeswarm.model import Model, load_weights
from moeswarm.model.gguf import GGUF_ARCH, NAME_MAP, GGUFFile, convert_to_gguf

# llama.cpp's keys cannot say which of dots1's layers slide; ERNIE's are all there
FROM_KEYS_ALONE_DIFFER = {"dots1": {"raw", "sliding_windows"}, "ernie4_5_moe": {"raw"}}
ARCH = {"dots1": gguf.MODEL_ARCH.DOTS1, "ernie4_5_moe": gguf.MODEL_ARCH.ERNIE4_5_MOE}


@pytest.mark.parametrize("family", list(ARCH))
def test_convert_gguf_round_trips(family_oracles, family: str, tmp_path: Path) -> None:
    folder, ref = family_oracles.get("oracle_families", family, "per_expert")
    path = convert_to_gguf(folder, tmp_path / "model.gguf", weight_type="F32", sidecar=False).path
    f = GGUFFile(path)
    assert f.architecture == GGUF_ARCH[family] == gguf.MODEL_ARCH_NAMES[ARCH[family]]
    w = load_weights(path)
    source = load_weights(folder)
    assert set(w.tensors) == set(source.tensors)
    for name, a in source.tensors.items():
        assert np.array_equal(np.asarray(w.tensors[name]), a), name
    model = Model(w)
    cache = model.new_cache()
    got = [model.forward(np.asarray([ref.prompt_ids]), cache)[0]]
    got += [model.forward(np.asarray([[t]]), cache)[0] for t in ref.decode_tokens]
    expected = np.concatenate([ref.prefill_logits, ref.decode_logits])
    assert np.abs(np.concatenate(got) - expected).max() <= 1e-4

    exact = f.config()
    f.meta = {k: v for k, v in f.meta.items() if not k.startswith("moeswarm.")}  # as from another converter
    rebuilt = f.config()
    differ = {x.name for x in dataclasses.fields(exact) if getattr(exact, x.name) != getattr(rebuilt, x.name)}
    assert differ == FROM_KEYS_ALONE_DIFFER[family]
    if family == "dots1":
        assert any(x is not None for x in exact.sliding_windows) and set(rebuilt.sliding_windows) == {None}


@pytest.mark.parametrize("family", list(ARCH))
def test_name_map_agrees_with_gguf_py(family: str) -> None:
    known = gguf.get_tensor_name_map(ARCH[family], 6)
    for row in NAME_MAP[family]:
        if row.stacked:
            continue
        hf = row.hf.format(L=0).replace("e_score_correction_bias", "e_score_correction.bias")  # as llama.cpp
        theirs = known.get_name(hf, try_suffixes=(".weight", ".bias"))
        assert theirs is not None and row.gguf.format(L=0) == theirs and not row.invented, (hf, row.gguf, theirs)
