"""Granite MoE through GGUF, under the names and keys llama.cpp's ``gguf`` package gives its
``granitemoe`` architecture (q/k rows and biases permuted to adjacent rotary pairs, as llama.cpp's
LlamaModel does; the four Granite scalars as ``attention.scale``, ``embedding_scale``,
``residual_scale``, ``logit_scale``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np
import pytest
from engine_support import assert_same_weights

from moeswarm.model import Model, load_model, load_weights
from moeswarm.model.gguf import GGUF_ARCH, NAME_MAP, GGUFFile, convert_to_gguf


def run_logits(model: Model, ref) -> np.ndarray:  # type: ignore[no-untyped-def]
    cache = model.new_cache()
    out = [model.forward(np.asarray([ref.prompt_ids]), cache)[0]]
    out += [model.forward(np.asarray([[t]]), cache)[0] for t in ref.decode_tokens]
    return np.concatenate(out)


@pytest.mark.parametrize(("arch", "layout"), [("granitemoe", "per_expert"), ("granitemoeshared", "packed")])
def test_convert_and_load_round_trips(granite_checkpoints, arch: str, layout: str, tmp_path: Path) -> None:
    folder, ref = granite_checkpoints.get(arch, layout)
    path = tmp_path / "granite.gguf"
    convert_to_gguf(folder, path, weight_type="F32", sidecar=False)
    f = GGUFFile(path)
    assert f.architecture == GGUF_ARCH[arch] == gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.GRANITE_MOE]
    source, exact = load_weights(folder), load_weights(path)
    assert exact.config.arch == arch
    assert_same_weights(source, exact)
    expected = np.concatenate([ref.prefill_logits, ref.decode_logits])
    assert np.abs(run_logits(Model(exact), ref) - expected).max() <= 1e-4
    # the q rows as stored are llama.cpp's permutation of the checkpoint's (adjacent rotary pairs)
    q = np.asarray(f.tensor("blk.0.attn_q.weight", tuple(source.tensors["0.attn.q"].shape)))
    assert not np.array_equal(q, source.tensors["0.attn.q"])
    # the llama.cpp keys alone (no embedded config.json) rebuild the same configuration
    f.meta = {k: v for k, v in f.meta.items() if not k.startswith("moeswarm.")}
    rebuilt, want = f.config(), exact.config
    differ = {x.name for x in dataclasses.fields(want) if getattr(want, x.name) != getattr(rebuilt, x.name)}
    assert differ <= {"raw", "model_id", "pad_token_id"}, differ
    q8 = tmp_path / "granite-q8.gguf"
    convert_to_gguf(folder, q8, weight_type="F16", experts_type="Q8_0", sidecar=False)
    got = run_logits(load_model(q8), ref)
    assert (got.argmax(-1) == expected.argmax(-1)).mean() >= 0.75


def test_name_map_agrees_with_gguf_py() -> None:
    """Every row gguf-py's TensorNameMap knows maps the same; the split ``input_linear`` halves (which
    llama.cpp's converter names itself, with no TensorNameMap entry) are the ``*_exps`` / ``*_shexp`` names."""
    known = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GRANITE_MOE, 4)
    for row in NAME_MAP["granitemoeshared"]:
        theirs = known.get_name(row.hf.format(L=0), try_suffixes=(".weight", ".bias"))
        if "input_linear" in row.hf:
            assert theirs is None and row.gguf.format(L=0) in (
                "blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight", "blk.0.ffn_gate_shexp.weight",
                "blk.0.ffn_up_shexp.weight")
        else:
            assert theirs is not None and row.gguf.format(L=0) == theirs and not row.invented, (row.hf, theirs)
