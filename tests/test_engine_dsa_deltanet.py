"""DeepSeek-V3.2 and GLM-5 (DSA: sparse attention over the indexer's top-k keys) and Qwen3.5-MoE
(gated DeltaNet linear attention + gated full attention, a vision tower the engine must not read)
against transformers 5.24 (fp32, eager).  ``test_engine_oracle.py`` runs the 16-token checks for
every architecture; this file adds what these mechanisms need: a Qwen3.5 prompt longer than one
64-token DeltaNet prefill chunk, prefill split across calls (the conv + recurrent state carried),
negative controls showing the indexer's top-k bites, the vision tower's bytes left on disk, and
the ``moeswarm generate`` CLI on each family's folder."""

from __future__ import annotations

import json
import mmap
import os
import struct
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from moeswarm.errors import ConfigError
from moeswarm.model import Model, SamplingParams, generate, load_model, load_weights
from moeswarm.model.speculative import generate_speculative

DSA = ("deepseek_v32", "glm_moe_dsa")
NEW = DSA + ("qwen3_5_moe",)
TOL = 1e-4


def run_engine(model, prompt, decode_tokens):  # type: ignore[no-untyped-def]
    cache = model.new_cache()
    prefill = model.forward(np.asarray([prompt]), cache)[0]
    decode = [model.forward(np.asarray([[t]]), cache)[0, -1] for t in decode_tokens]
    return prefill, np.stack(decode)


@pytest.fixture(scope="module")
def qwen_long(oracle_checkpoints):  # type: ignore[no-untyped-def]
    """Qwen3.5-MoE with an 80-token prompt (> one 64-token chunk): (folder, per layout) and the reference."""
    o = oracle_checkpoints.oracle
    prompt = [int(t) for t in np.random.default_rng(7).integers(3, 512, o.QWEN3_5_PROMPT_LEN)]
    folders = {layout: oracle_checkpoints.get("qwen3_5_moe", layout)[0] for layout in ("per_expert", "packed")}
    return folders, o.reference_run(folders["per_expert"], prompt)


@pytest.mark.parametrize("layout", ["per_expert", "packed"])
def test_qwen3_5_long_prompt_matches_transformers(qwen_long, layout: str) -> None:
    folders, ref = qwen_long
    assert len(ref.prompt_ids) > 64
    model = load_model(folders[layout], backend="eager")
    prefill, decode = run_engine(model, ref.prompt_ids, ref.decode_tokens)
    assert np.abs(prefill - ref.prefill_logits).max() <= TOL
    assert np.abs(decode - ref.decode_logits).max() <= TOL
    tokens = list(generate(model, ref.prompt_ids, SamplingParams(max_new_tokens=len(ref.greedy_tokens))))
    assert tokens == ref.greedy_tokens


def test_qwen3_5_prefill_split_across_calls_carries_the_state(qwen_long) -> None:
    """Prefill in three calls (conv inputs and the delta-rule state handed over), then decode."""
    folders, ref = qwen_long
    model = load_model(folders["packed"])
    cache = model.new_cache()
    parts = [ref.prompt_ids[:37], ref.prompt_ids[37:70], ref.prompt_ids[70:]]
    logits = np.concatenate([model.forward(np.asarray([p]), cache)[0] for p in parts])
    assert np.abs(logits - ref.prefill_logits).max() <= TOL
    decode = np.stack([model.forward(np.asarray([[t]]), cache)[0, -1] for t in ref.decode_tokens])
    assert np.abs(decode - ref.decode_logits).max() <= TOL
    # the carried state matters: restarting the third part from an empty cache gives other logits
    fresh = model.forward(np.asarray([parts[2]]), model.new_cache())[0]
    assert np.abs(fresh - ref.prefill_logits[70:]).max() > 0.1


def test_qwen3_5_layer_pattern_is_linear_full_linear(oracle_checkpoints) -> None:
    cfg = load_model(oracle_checkpoints.get("qwen3_5_moe", "packed")[0]).config
    assert cfg.deltanet is not None and cfg.deltanet.layers == (True, False, True)
    assert cfg.deltanet.num_v_heads > cfg.deltanet.num_k_heads  # grouped value heads are exercised
    assert cfg.rope.dim < cfg.head_dim  # partial rotary


@pytest.mark.parametrize("arch", DSA)
def test_indexer_top_k_really_selects(oracle_checkpoints, arch: str) -> None:
    """With index_topk >= the sequence, transformers' logits move well beyond the tolerance (so the
    sparse match above is not a dense match), and the engine follows the oracle there too."""
    o = oracle_checkpoints.oracle
    folder, ref = oracle_checkpoints.get(arch, "packed")
    cfg = load_model(folder).config
    assert cfg.dsa is not None and cfg.dsa.topk < len(ref.prompt_ids)
    dense_ref = o.run_model(o.load_model(folder, index_topk=256), ref.prompt_ids, n_decode=len(ref.decode_tokens))
    gap = np.abs(dense_ref.prefill_logits - ref.prefill_logits).max()
    assert gap > 100 * TOL
    dense_cfg = replace(cfg, dsa=replace(cfg.dsa, topk=256))
    model = Model(load_weights(folder, config=dense_cfg))
    prefill, decode = run_engine(model, dense_ref.prompt_ids, dense_ref.decode_tokens)
    assert np.abs(prefill - dense_ref.prefill_logits).max() <= TOL
    assert np.abs(decode - dense_ref.decode_logits).max() <= TOL


def test_glm5_shared_layers_have_no_indexer_and_dense_layers_no_router(oracle_checkpoints) -> None:
    w = load_model(oracle_checkpoints.get("glm_moe_dsa", "per_expert")[0]).weights
    cfg = w.config
    assert cfg.dsa is not None and cfg.dsa.shared == (False, True, False, True)
    assert cfg.moe_layers == (False, True, False, True)
    assert [f"{L}.attn.idx_w" in w.tensors for L in range(4)] == [True, False, True, False]
    assert [f"{L}.router" in w.tensors for L in range(4)] == [False, True, False, True]


def test_deltanet_cache_refuses_rollback(oracle_checkpoints) -> None:
    folder, ref = oracle_checkpoints.get("qwen3_5_moe", "packed")
    model = load_model(folder)
    with pytest.raises(ConfigError, match="speculative decoding is not supported"):
        list(generate_speculative(model, ref.prompt_ids * 2, SamplingParams(max_new_tokens=8), k=4))


# ---------------------------------------------------------------- the vision tower stays on disk
# This machine reads ahead up to 8 MB around a page fault, so the page cache (mincore) says little
# about what a process read.  What the process itself mapped does: /proc/self/pagemap's "present"
# bit per virtual page of the checkpoint's memory map (fault-around maps at most 64 KB around a touch).


def _present(addr: int, start: int, end: int) -> float:
    """Share of the pages wholly inside [start, end) of a file mapped at ``addr`` that this process maps."""
    page = mmap.PAGESIZE
    first, last = -(-(addr + start) // page), (addr + end) // page
    if last <= first:
        raise AssertionError("range shorter than a page")
    with open("/proc/self/pagemap", "rb") as fh:
        fh.seek(first * 8)
        entries = np.frombuffer(fh.read((last - first) * 8), dtype="<u8")
    return float(((entries >> np.uint64(63)) & np.uint64(1)).mean())


def _file_map_address(a: np.ndarray) -> int:
    """Address of byte 0 of the file whose memory map ``a`` is a view into."""
    while isinstance(a.base, np.ndarray):  # the root is the np.memmap of the whole file (offset 0)
        a = a.base
    assert isinstance(a, np.memmap) and a.offset == 0 and a.size == os.path.getsize(a.filename)
    return int(a.__array_interface__["data"][0])


def _tensor_ranges(path: Path) -> dict[str, tuple[int, int]]:
    """name -> (start, end) byte offsets in a .safetensors file, read from its header."""
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
    return {k: (8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1])
            for k, v in header.items() if k != "__metadata__"}


def test_qwen3_5_vision_tower_is_never_read(oracle_checkpoints) -> None:
    folder, ref = oracle_checkpoints.get("qwen3_5_moe", "per_expert")
    ranges = _tensor_ranges(folder / "model.safetensors")
    vision = [r for k, r in ranges.items() if k.startswith("model.visual.")]
    text = [r for k, r in ranges.items() if not k.startswith("model.visual.")]
    v0, v1 = min(a for a, _ in vision), max(b for _, b in vision)
    t0, t1 = min(a for a, _ in text), max(b for _, b in text)
    assert t1 <= v0 and v1 - v0 > 5 * (t1 - t0)  # the tower is one block after the language model, 5x its size

    model = load_model(folder)
    assert not any(s.key.startswith("model.visual.") for s in model.weights.sources.values())
    addr = _file_map_address(model.weights["embed"])
    tokens = list(generate(model, ref.prompt_ids, SamplingParams(max_new_tokens=len(ref.greedy_tokens))))
    assert tokens == ref.greedy_tokens
    assert _present(addr, t0, t1) > 0.3  # the measurement sees what was read ...
    assert _present(addr, v0 + 64 * 1024, v1) == 0.0  # ... and no page of the tower (past fault-around) was


# ---------------------------------------------------------------- the CLI on each family's folder


@pytest.mark.parametrize("arch", NEW)
def test_generate_cli_on_each_family(oracle_checkpoints, arch: str) -> None:
    folder, ref = oracle_checkpoints.get(arch, "per_expert")
    expected = list(ref.greedy_tokens)
    if 2 in expected:  # eos (id 2) ends generation
        expected = expected[: expected.index(2) + 1]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OPENBLAS_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "moeswarm.cli", "generate", "--model", str(folder), "--prompt-ids",
         json.dumps(ref.prompt_ids), "--max-new-tokens", str(len(ref.greedy_tokens)), "--print-token-ids"],
        capture_output=True, text=True, env=env, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == expected


def test_generate_help_says_images_are_not_supported() -> None:
    from click.testing import CliRunner

    from moeswarm.cli import main

    result = CliRunner().invoke(main, ["generate", "--help"])
    assert result.exit_code == 0
    assert "images are not supported yet" in " ".join(result.output.split())


# ---------------------------------------------------------------- batches and published-scale configs


@pytest.mark.parametrize("arch", NEW)
def test_batch_rows_equal_single_rows(oracle_checkpoints, arch: str) -> None:
    model = load_model(oracle_checkpoints.get(arch, "packed")[0])
    rng = np.random.default_rng(3)
    batch = rng.integers(3, model.config.vocab_size, size=(3, 20))

    def run(rows: np.ndarray) -> np.ndarray:  # a prefill of 17 tokens, then 3 more (the caches carried)
        cache = model.new_cache()
        return np.concatenate([model.forward(rows[:, :17], cache), model.forward(rows[:, 17:], cache)], axis=1)

    together = run(batch)
    # rows are independent; only BLAS's blocking differs with the row count (51 vs 17 rows), which
    # Qwen3.5's hot (1 + weight) norms amplify to ~3e-5 on logits of ~8, so the oracle's 1e-4 bound
    for b in range(3):
        assert np.abs(together[b] - run(batch[b : b + 1])[0]).max() <= TOL


def test_published_scale_configs_parse() -> None:
    """transformers' default configs are the published models' (DeepSeek-V3.2-Exp, GLM-5, Qwen3.5-35B-A3B)."""
    from transformers import DeepseekV32Config, GlmMoeDsaConfig, Qwen3_5MoeConfig

    from moeswarm.model import ModelConfig

    v32 = ModelConfig.from_hf(DeepseekV32Config().to_dict())
    assert (v32.num_layers, v32.num_experts, v32.top_k) == (61, 256, 8)
    assert v32.moe_layers[:4] == (False, False, False, True) and v32.dsa is not None
    assert (v32.dsa.topk, v32.dsa.n_heads, v32.dsa.head_dim, v32.dsa.rope_interleaved) == (2048, 64, 128, False)
    glm = ModelConfig.from_hf(GlmMoeDsaConfig().to_dict())
    assert (glm.num_layers, glm.num_experts, glm.kv_lora_rank, glm.v_head_dim) == (78, 256, 512, 256)
    assert glm.dsa is not None and glm.dsa.rope_interleaved and not any(glm.dsa.shared)
    shared = ModelConfig.from_hf({**GlmMoeDsaConfig().to_dict(), "indexer_types": None, "index_topk_pattern": "FSSF" * 20})
    assert shared.dsa is not None and shared.dsa.shared[:4] == (False, True, True, False)
    qwen = ModelConfig.from_hf(Qwen3_5MoeConfig().to_dict())
    assert qwen.deltanet is not None and qwen.deltanet.layers == (True, True, True, False) * 10
    assert (qwen.num_experts, qwen.top_k, qwen.rope.dim, qwen.head_dim) == (256, 8, 64, 256)
    assert (qwen.deltanet.num_k_heads, qwen.deltanet.num_v_heads, qwen.deltanet.conv_dim) == (16, 32, 8192)
    with pytest.raises(Exception, match="linear_attention"):
        ModelConfig.from_hf({**Qwen3_5MoeConfig().to_dict(), "text_config": {
            **Qwen3_5MoeConfig().to_dict()["text_config"], "layer_types": ["mamba"] * 40}})


@pytest.mark.parametrize("arch", DSA)
def test_speculative_decoding_rolls_back_the_indexer_keys(oracle_checkpoints, arch: str) -> None:
    from moeswarm.model.speculative import SpeculativeStats

    folder, ref = oracle_checkpoints.get(arch, "packed")
    model = load_model(folder)
    prompt = ref.prompt_ids + ref.prompt_ids[:10]  # repetition, so drafts are proposed
    params = SamplingParams(max_new_tokens=12)
    stats = SpeculativeStats()
    assert list(generate_speculative(model, prompt, params, k=4, stats=stats)) == list(generate(model, prompt, params))
    assert stats.drafted > stats.accepted  # some drafts were rejected: caches (incl. indexer keys) were cut back


@pytest.mark.parametrize("arch", DSA)
def test_indexer_top_k_boundary_is_not_a_near_tie(oracle_checkpoints, arch: str) -> None:
    """transformers' own index scores: the k-th and (k+1)-th best key of every query that has more
    than k causal keys differ by far more than fp noise, so equal top-k sets above are robust."""
    import torch

    o = oracle_checkpoints.oracle
    folder, ref = oracle_checkpoints.get(arch, "packed")
    k = load_model(folder).config.dsa.topk  # type: ignore[union-attr]
    seen: list[torch.Tensor] = []
    original = torch.Tensor.topk

    def recording(self, n, *args, **kwargs):  # type: ignore[no-untyped-def]
        if n == k:  # the indexer (the routers ask for other k)
            seen.append(self.detach().clone())
        return original(self, n, *args, **kwargs)

    torch.Tensor.topk = recording  # type: ignore[method-assign]
    try:
        o.run_model(o.load_model(folder), ref.sequence_ids, n_decode=0)
    finally:
        torch.Tensor.topk = original  # type: ignore[method-assign]
    assert seen  # one per full indexer layer
    gaps = []
    for scores in seen:  # (B, S, S), causally masked with the dtype's minimum
        for t in range(k, scores.shape[1]):  # query t has t + 1 causal keys
            top = torch.sort(scores[0, t, : t + 1], descending=True).values
            gaps.append(float(top[k - 1] - top[k]))
    assert min(gaps) > 1e-4, min(gaps)
