"""GGUF files written by llama.cpp's own converter (``convert_hf_to_gguf.py``) for the families whose
transformers class it converts, read by the engine and run by llama.cpp (``llama_cpp_tools``: the converter
from llama-cpp-python 0.3.36's sdist, llama.cpp itself from llama-cpp-python in its own virtualenv).

For each family, on its tiny transformers oracle checkpoint (tests/oracle_*.py), F32:
* the engine on llama.cpp's file gives transformers' logits (whole prefill, then cached decode steps)
  within 1e-4 and its greedy tokens;
* llama.cpp on the same file gives the same greedy tokens, and logits after the prompt within 1e-3 of the
  largest (it computes the same model: its own kernels, another summation order);
* ``convert-gguf``'s file holds the same tensors bit for bit (names, GGML types, bytes) and every
  hyper-parameter key llama.cpp's converter writes, with its value.

Not here: Llama 4 (llama.cpp fixes the attention chunk, NoPE interval and temperature its keys do not carry,
so the tiny checkpoint's values cannot be written for it; tests/llama4/test_llama4_gguf.py), Mistral 4
(llama.cpp converts it only inside ``Mistral3ForConditionalGeneration``).
"""

from __future__ import annotations

from pathlib import Path

import llama_cpp_tools
import numpy as np
import pytest

from moeswarm.model import SamplingParams, generate, load_model
from moeswarm.model.gguf import GGUFFile, convert_to_gguf

TOL = 1e-4
LLAMA_CPP_REL = 1e-3  # llama.cpp's F32 logits against transformers', relative to the largest

CASES = {
    "glm4_moe": ("oracle_glm4", "glm4_moe", "per_expert"),
    "granitemoe": ("oracle_granite", "granitemoe", "per_expert"),
    "granitemoeshared": ("oracle_granite", "granitemoeshared", "per_expert"),
    "dbrx": ("oracle_dbrx",),
}


def engine_logits(path: Path, ref) -> np.ndarray:  # type: ignore[no-untyped-def]
    model = load_model(path)
    cache = model.new_cache()
    out = [model.forward(np.asarray([ref.prompt_ids]), cache)[0]]
    out += [model.forward(np.asarray([[t]]), cache)[0] for t in ref.decode_tokens]
    return np.concatenate(out)


def _value(v):  # type: ignore[no-untyped-def]
    return v if isinstance(v, str) else np.asarray(v, dtype=np.float64)


@pytest.mark.parametrize("family", list(CASES))
def test_llama_cpp_converter_file(family_oracles, family: str, tmp_path: Path) -> None:
    folder, ref = family_oracles.get(*CASES[family])
    theirs = llama_cpp_tools.convert(folder, tmp_path / "llama.cpp.gguf")

    expected = np.concatenate([ref.prefill_logits, ref.decode_logits])
    assert np.abs(engine_logits(theirs, ref) - expected).max() <= TOL
    model = load_model(theirs)
    assert list(generate(model, ref.prompt_ids, SamplingParams(max_new_tokens=len(ref.greedy_tokens)))) == \
        ref.greedy_tokens

    tokens, first = llama_cpp_tools.greedy(theirs, list(ref.prompt_ids), len(ref.greedy_tokens))
    assert tokens == ref.greedy_tokens
    last = ref.prefill_logits[-1]
    assert np.abs(np.asarray(first) - last).max() <= LLAMA_CPP_REL * np.abs(last).max()

    ours = convert_to_gguf(folder, tmp_path / "ours.gguf", weight_type="F32", sidecar=False).path
    f, g = GGUFFile(ours), GGUFFile(theirs)
    assert f.architecture == g.architecture
    assert set(f.tensors) == set(g.tensors)
    for name, t in g.tensors.items():
        mine = f.tensors[name]
        assert mine.tensor_type == t.tensor_type and np.array_equal(np.asarray(mine.data), np.asarray(t.data)), name
    for key, value in g.meta.items():
        if key.startswith(("general.", "tokenizer.", "GGUF.")):
            continue
        assert key in f.meta, key
        assert np.array_equal(_value(f.meta[key]), _value(value)) or np.allclose(_value(f.meta[key]), _value(value)), \
            (key, f.meta[key], value)
