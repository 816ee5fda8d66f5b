"""Llama 4 through GGUF, under the names and keys llama.cpp's ``gguf`` package gives its ``llama4``
architecture: ``convert-gguf`` of both checkpoint forms round-trips every tensor and the logits; the
name map agrees with gguf-py's; the llama.cpp keys alone rebuild the published configuration."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from engine_support import assert_same_weights

from moeswarm.model import Model, ModelConfig, load_model, load_weights
from moeswarm.model.gguf import GGUF_ARCH, NAME_MAP, GGUFFile, convert_to_gguf

CONFIGS = Path(__file__).resolve().parents[2] / "moeswarm" / "model" / "configs"


def run_logits(model: Model, ref) -> np.ndarray:  # type: ignore[no-untyped-def]
    cache = model.new_cache()
    out = [model.forward(np.asarray([ref.prompt_ids]), cache)[0]]
    out += [model.forward(np.asarray([[t]]), cache)[0] for t in ref.decode_tokens]
    return np.concatenate(out)


@pytest.mark.parametrize("layout", ["text", "vision"])
def test_convert_and_load_round_trips(llama4_checkpoints, layout: str, tmp_path: Path) -> None:
    folder, ref = llama4_checkpoints.get(layout)
    path = tmp_path / "llama4.gguf"
    done = subprocess.run([sys.executable, "-m", "moeswarm.cli", "convert-gguf", "--model", str(folder), "--out", str(path),
                           "--type", "F32"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    f = GGUFFile(path)
    assert f.architecture == GGUF_ARCH["llama4"] == gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA4]
    assert f.meta["llama4.interleave_moe_layer_step"] == 2
    source, exact = load_weights(folder), load_weights(path)
    assert exact.config.arch == source.config.arch
    assert_same_weights(source, exact)
    expected = np.concatenate([ref.prefill_logits, ref.decode_logits])
    assert np.abs(run_logits(Model(exact), ref) - expected).max() <= 1e-4
    q8 = tmp_path / "llama4-q8.gguf"
    convert_to_gguf(folder, q8, weight_type="F16", experts_type="Q8_0", sidecar=False)
    got = run_logits(load_model(q8), ref)
    assert np.abs(got - expected).max() <= 0.5 * np.abs(expected).max()
    assert (got.argmax(-1) == expected.argmax(-1)).mean() >= 0.75


def test_name_map_agrees_with_gguf_py() -> None:
    known = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA4, 4)
    for row in NAME_MAP["llama4"]:
        theirs = known.get_name(row.hf.format(L=0), try_suffixes=(".weight", ".bias"))
        assert theirs is not None and row.gguf.format(L=0) == theirs and not row.invented, (row.hf, row.gguf, theirs)
    assert NAME_MAP["llama4"] == NAME_MAP["llama4_text"]


@pytest.mark.parametrize("name", ["llama-4-maverick"])
def test_llama_cpp_keys_alone_rebuild_the_published_config(name: str, tmp_path: Path) -> None:
    """llama.cpp fixes what its keys do not carry (chunk 8192, NoPE every 4th layer, temperature floor
    8192 and scale 0.1, q/k norm unless 128 experts): for Maverick, the keys rebuild its config exactly."""
    from gguf import GGUFWriter

    from moeswarm.model._gguf_meta import _hparams, hf_config_from_metadata

    published = ModelConfig.from_hf(json.loads((CONFIGS / f"{name}.json").read_text()))
    writer = GGUFWriter(None, "llama4")
    _hparams(writer, published)
    meta = {k: v.value for k, v in writer.kv_data[0].items()}
    meta.update({"tokenizer.ggml.bos_token_id": 200000, "tokenizer.ggml.eos_token_id": 200001,
                 "tokenizer.ggml.padding_token_id": 200018})
    tensors = {f"blk.{i}.ffn_gate_inp.weight" for i in range(48) if published.moe_layers[i]} | {"output.weight"}
    rebuilt = ModelConfig.from_hf(hf_config_from_metadata(meta, tensors, "llama4"))
    differ = {x.name for x in dataclasses.fields(published) if getattr(published, x.name) != getattr(rebuilt, x.name)}
    assert differ == {"raw", "arch", "eos_token_ids"}  # llama4_text; llama.cpp keeps one eos id
    assert rebuilt.eos_token_ids == (200001,)
