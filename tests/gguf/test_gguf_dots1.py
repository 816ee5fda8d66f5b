"""dots.llm1 (``dots1``) through GGUF under llama.cpp's ``dots1`` names and keys, on the family oracle's
checkpoint (sliding-window layers, grouped key-value heads, q/k/v/o biases: what llama.cpp's dots1 lacks
travels in the embedded config.json).  llama.cpp's own file: tests/gguf/test_gguf_llama_cpp_files.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np

from moeswarm.model import Model, load_weights
from moeswarm.model.gguf import GGUF_ARCH, NAME_MAP, GGUFFile, convert_to_gguf


def test_convert_gguf_round_trips_dots1(family_oracles, tmp_path: Path) -> None:
    folder, ref = family_oracles.get("oracle_families", "dots1", "per_expert")
    path = convert_to_gguf(folder, tmp_path / "dots1.gguf", weight_type="F32", sidecar=False).path
    f = GGUFFile(path)
    assert f.architecture == GGUF_ARCH["dots1"] == gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.DOTS1]
    w = load_weights(path)
    assert any(x is not None for x in w.config.sliding_windows)
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
    assert differ == {"raw", "sliding_windows"}  # llama.cpp's dots1 has no sliding-window layers
    assert set(rebuilt.sliding_windows) == {None}


def test_name_map_agrees_with_gguf_py() -> None:
    known = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DOTS1, 3)
    for row in NAME_MAP["dots1"]:
        if row.stacked:
            continue
        hf = row.hf.format(L=0).replace("e_score_correction_bias", "e_score_correction.bias")
        theirs = known.get_name(hf, try_suffixes=(".weight", ".bias"))
        assert theirs is not None and row.gguf.format(L=0) == theirs and not row.invented, (hf, row.gguf, theirs)
