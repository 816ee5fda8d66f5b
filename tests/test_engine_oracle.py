"""The engine against Hugging Face transformers 5.24 (fp32, eager attention): six architectures,
both on-disk layouts, a 16-token prefill and 8 KV-cache decode steps."""

from __future__ import annotations

import numpy as np
import pytest
from engine_support import f16_matrices

from moeswarm.model import ARCHITECTURES, BACKENDS, SamplingParams, generate, get_backend, load_model
from moeswarm.model.routing import route

LAYOUTS = ("per_expert", "packed")
TOL = 1e-4


def run_engine(model, ref):  # type: ignore[no-untyped-def]
    cache = model.new_cache()
    prefill = model.forward(np.asarray([ref.prompt_ids]), cache)[0]
    decode = [model.forward(np.asarray([[t]]), cache)[0, -1] for t in ref.decode_tokens]
    return prefill, np.stack(decode)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arch", ARCHITECTURES + ("deepseek_v3_no_q_lora",))
def test_logits_and_greedy_tokens_match_transformers(oracle_checkpoints, arch: str, layout: str) -> None:
    folder, ref = oracle_checkpoints.get(arch, layout)
    model = load_model(folder, backend="eager")
    prefill, decode = run_engine(model, ref)
    assert np.abs(prefill - ref.prefill_logits).max() <= TOL
    assert np.abs(decode - ref.decode_logits).max() <= TOL
    tokens = list(generate(model, ref.prompt_ids, SamplingParams(max_new_tokens=len(ref.greedy_tokens))))
    assert tokens == ref.greedy_tokens


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_both_layouts_load_to_the_same_logits(oracle_checkpoints, arch: str) -> None:
    outs = []
    for layout in LAYOUTS:
        folder, ref = oracle_checkpoints.get(arch, layout)
        outs.append(run_engine(load_model(folder), ref))
    assert np.abs(outs[0][0] - outs[1][0]).max() <= 1e-5
    assert np.abs(outs[0][1] - outs[1][1]).max() <= 1e-5


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_backends_agree(oracle_checkpoints, arch: str) -> None:
    folder, _ = oracle_checkpoints.get(arch, "packed")
    model = load_model(folder)
    cfg = model.config
    layer = next(L for L in range(cfg.num_layers) if cfg.moe_layers[L])
    rng = np.random.default_rng(1)
    for tokens in (1, 3, 8, 33):
        x = rng.standard_normal((tokens, cfg.hidden_size)).astype(np.float32)
        w = model.weights
        ids, weights = route(cfg, x, w[f"{layer}.router"], w.get(f"{layer}.router_bias"), w.get(f"{layer}.router_score_bias"))
        outs = {name: get_backend(name)(w.experts[layer], x, ids, weights, cfg) for name in BACKENDS}
        for name, out in outs.items():
            assert np.abs(out - outs["eager"]).max() <= 1e-5, (tokens, name)
        assert np.abs(outs["eager"]).max() > 1e-2  # the layer really computes something


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_legacy_rope_config_gives_the_same_logits(oracle_checkpoints, arch: str) -> None:
    folder, ref = oracle_checkpoints.get(arch, "per_expert", legacy_rope=True)
    prefill, decode = run_engine(load_model(folder), ref)
    assert np.abs(prefill - ref.prefill_logits).max() <= TOL
    assert np.abs(decode - ref.decode_logits).max() <= TOL


def test_batch_rows_equal_single_rows(oracle_checkpoints) -> None:
    folder, ref = oracle_checkpoints.get("qwen2_moe", "packed")
    model = load_model(folder)
    rng = np.random.default_rng(2)
    batch = rng.integers(3, model.config.vocab_size, size=(3, 12))
    together = model.forward(batch, model.new_cache())
    for b in range(3):
        alone = model.forward(batch[b : b + 1], model.new_cache())
        assert np.abs(together[b] - alone[0]).max() <= 1e-5


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3"])
def test_a_bf16_checkpoint_matches_transformers_on_the_same_file(oracle_checkpoints, tmp_path, arch: str) -> None:
    """bf16 safetensors as published (every tensor bfloat16): transformers loads the same file (upcast
    to fp32, eager) as the oracle, so both sides compute with the same rounded weights."""
    import shutil

    import torch
    from oracle import read_tensors, reference_run
    from safetensors.torch import save_file

    folder, ref32 = oracle_checkpoints.get(arch, "per_expert")
    bf16 = tmp_path / "bf16"
    bf16.mkdir()
    for f in folder.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, bf16 / f.name)
    tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in read_tensors(folder).items()}
    save_file(tensors, str(bf16 / "model.safetensors"), metadata={"format": "pt"})
    ref = reference_run(bf16, ref32.prompt_ids)
    model = load_model(bf16, backend="eager")
    assert {str(a.dtype) for a in model.weights.tensors.values()} >= {"bfloat16"}  # stored bytes, mapped as is
    prefill, decode = run_engine(model, ref)
    assert np.abs(prefill - ref.prefill_logits).max() <= TOL
    assert np.abs(decode - ref.decode_logits).max() <= TOL
    assert np.abs(prefill - ref32.prefill_logits).max() > TOL  # the rounding is real: bf16 is not fp32
    as_stored, copies = f16_matrices(model)  # computed from the bf16 bytes (``_f16``), no float32 copy kept
    assert copies == 0 and as_stored > 3, (as_stored, copies)
    tokens = list(generate(model, ref.prompt_ids, SamplingParams(max_new_tokens=len(ref.greedy_tokens))))
    assert tokens == ref.greedy_tokens
