"""DBRX (``dbrx``) through GGUF, under the names and keys llama.cpp's ``gguf`` package gives its ``dbrx``
architecture: the fused ``Wqkv`` kept whole as ``attn_qkv`` (the engine reads q, k and v as its row
ranges), ``norm_2`` as ``attn_output_norm``, the flat experts stacked per layer.  llama.cpp's own file of
the same checkpoint: tests/gguf/test_gguf_llama_cpp_files.py."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
from engine_support import assert_same_weights
from gguf_reference import LOGIT_TOL, dequantised

from moeswarm.model import Model, load_weights
from moeswarm.model._safetensors import open_folder
from moeswarm.model.gguf import (
    GGUF_ARCH,
    NAME_MAP,
    GGUFFile,
    QuantizedTensor,
    convert_to_gguf,
)


def run_logits(model: Model, ref) -> np.ndarray:  # type: ignore[no-untyped-def]
    cache = model.new_cache()
    out = [model.forward(np.asarray([ref.prompt_ids]), cache)[0]]
    out += [model.forward(np.asarray([[t]]), cache)[0] for t in ref.decode_tokens]
    return np.concatenate(out)


def test_convert_gguf_round_trips_dbrx(family_oracles, tmp_path: Path) -> None:
    folder, ref = family_oracles.get("oracle_dbrx")
    path = tmp_path / "dbrx.gguf"
    done = subprocess.run([sys.executable, "-m", "moeswarm.cli", "convert-gguf", "--model", str(folder), "--out",
                           str(path), "--type", "F32", "--no-sidecar", "-q"], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    f = GGUFFile(path)
    assert f.architecture == GGUF_ARCH["dbrx"] == gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.DBRX]
    cfg = f.config()
    H, kv = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
    assert tuple(reversed(f.tensors["blk.0.attn_qkv.weight"].shape)) == (H + 2 * kv, H)
    assert not any(".attn_q." in name or ".attn_k." in name for name in f.tensors)
    source, exact = load_weights(folder), load_weights(path)
    assert_same_weights(source, exact)
    expected = np.concatenate([ref.prefill_logits, ref.decode_logits])
    assert np.abs(run_logits(Model(exact), ref) - expected).max() <= 1e-4

    q8 = convert_to_gguf(folder, tmp_path / "dbrx-q8.gguf", weight_type="Q8_0", sidecar=False).path
    w = load_weights(q8)
    q = w.tensors["0.attn.k"]  # a row range of the Q8_0 attn_qkv, decoded alone
    assert isinstance(q, QuantizedTensor) and q.shape == (kv, H)
    assert np.abs(np.asarray(q) - source.tensors["0.attn.k"]).max() <= np.abs(source.tensors["0.attn.k"]).max() / 100
    got = run_logits(Model(w), ref)  # the quantized kernels, q / k / v cut from one Q8_0 tensor
    decoded = run_logits(dequantised(load_weights(q8)), ref)  # every weight decoded by gguf-py, float32 numpy
    assert np.abs(got - decoded).max() <= LOGIT_TOL * np.abs(decoded).max()
    assert np.abs(got - expected).max() <= 0.5 * np.abs(expected).max()
    assert (got.argmax(-1) == expected.argmax(-1)).mean() >= 0.75


def test_name_map_covers_the_checkpoint_and_agrees_with_gguf_py(family_oracles) -> None:
    folder, _ = family_oracles.get("oracle_dbrx")
    assert {row.hf.format(L=L) for row in NAME_MAP["dbrx"] for L in range(2)} == set(open_folder(folder))
    known = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DBRX, 2)
    for row in NAME_MAP["dbrx"]:
        hf = row.hf.format(L=0)
        theirs = known.get_name(hf if hf.endswith(".weight") else hf + ".weight", try_suffixes=(".weight",))
        assert theirs is not None and row.gguf.format(L=0) == theirs and not row.invented, (hf, row.gguf, theirs)


def test_llama_cpp_keys_alone_rebuild_the_config(family_oracles, tmp_path: Path) -> None:
    folder, _ = family_oracles.get("oracle_dbrx")
    f = GGUFFile(convert_to_gguf(folder, tmp_path / "dbrx.gguf", weight_type="F16", sidecar=False).path)
    exact = f.config()
    assert exact.clip_qkv == 0.5 and exact.norm == "layer"
    f.meta = {k: v for k, v in f.meta.items() if not k.startswith("moeswarm.")}  # as from another converter
    rebuilt = f.config()
    assert {x.name for x in dataclasses.fields(exact) if getattr(exact, x.name) != getattr(rebuilt, x.name)} == {"raw"}
