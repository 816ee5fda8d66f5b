"""GGUF checkpoints written by our converter, run by the engine, against the safetensors checkpoint and
Hugging Face transformers (the oracle's fp32 reference logits)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from engine_support import assert_same_weights, f16_matrices
from gguf_reference import LOGIT_TOL, dequantised

from moeswarm.model import (
    ARCHITECTURES,
    SamplingParams,
    generate,
    load_model,
    load_weights,
)
from moeswarm.model._f16 import StoredLinear
from moeswarm.model._qkernels import packable
from moeswarm.model.gguf import GGUF_ARCH, QuantizedTensor
from moeswarm.model.transformer import Model
from moeswarm.model.weights import Weights

FP16_EPS = 2.0**-11  # largest relative rounding error of one weight stored as fp16
# Each weight rounds by at most FP16_EPS relative; through the few matmuls of these 2-3 layer models
# the logit error measured 1.0-2.0 x FP16_EPS x max|logit| (2e-3 to 4e-3 on logits up to ~4).  8x leaves room
# while staying far below the gaps a wrong tensor would cause (~1).
F16_TOL_FACTOR = 8.0
# The worst rounding of one stored weight, relative to the largest |weight| of its block (F16/BF16: to
# itself), from gguf-py's encoders: Q8_0 d = amax/127 (error <= d/2); Q5_0 d = amax/16; Q4_0 d = amax/8; Q5_1 and
# Q4_1 d = (max - min)/31 and /15 <= 2 amax/31 and 2 amax/15.
WEIGHT_EPS = {"F32": 0.0, "F16": 2.0**-11, "BF16": 2.0**-8, "Q8_0": 1 / 254, "Q5_0": 1 / 32, "Q5_1": 1 / 31,
              "Q4_0": 1 / 16, "Q4_1": 1 / 15}
# Block-quantized matrices run on MatMulNBits with int8 activations (as llama.cpp's Q8 activations): one more
# rounding of amax/254 per block of activations.
ACT_EPS = 1 / 254
# The logits' error in units of (that precision x max|logit|), measured against transformers: 0.6-1.5 with only the
# experts quantized, 2.3-14.4 with every matrix (embeddings, attention, LM head) rounded.  16 leaves no room for
# a wrong tensor or block layout at 8 bits (errors of the logits' own size, 30-250 units).
QUANT_TOL_FACTOR = 16.0
# The same, per stored weight, including the clipping of the largest positive value (Q4_0 / Q5_0 scale the
# block by its largest-magnitude value d = m/-8 (-16), so a value of +amax lands on +8 (+16) and is clipped to
# 7 (15): an error of one whole step) and the fp16 rounding of the scale (and of Q4_1/Q5_1's minimum), at most
# 2 x 2^-11 x amax: each weight decoded from the file lies within WEIGHT_BOUND[type] x its block's amax of
# the safetensors weight it was written from. A wrong weight (another expert's, a transposed or shifted
# block) is off by the size of the weights themselves, ~ amax: far outside.
WEIGHT_BOUND = {"Q8_0": 1 / 254 + 2 * 2.0**-11, "Q5_0": 1 / 16 + 2 * 2.0**-11, "Q5_1": 1 / 62 * 2 + 2 * 2.0**-11,
                "Q4_0": 1 / 8 + 2 * 2.0**-11, "Q4_1": 1 / 30 * 2 + 2 * 2.0**-11}
FP32_NOISE = 1e-5  # same weights, different memory layout: matmul rounding only (pitfall 9)
N_RANDOM_PROMPTS = 15
N_NEW = 8


def run_logits(model: Model, ref) -> np.ndarray:  # type: ignore[no-untyped-def]
    """Prefill over the oracle prompt + the reference's decode steps -> (T + n_decode, V)."""
    cache = model.new_cache()
    prefill = model.forward(np.asarray([ref.prompt_ids]), cache)[0]
    decode = [model.forward(np.asarray([[t]]), cache)[0, -1] for t in ref.decode_tokens]
    return np.concatenate([prefill, np.stack(decode)])


def assert_within_precision(logits: np.ndarray, ref, weight_type: str, label: str) -> float:  # type: ignore[no-untyped-def]
    """Elementwise against transformers' fp32 logits: within ``QUANT_TOL_FACTOR`` x the type's precision x
    max|logit| (F32: matmul rounding only).  Returns the largest difference."""
    expected = np.concatenate([ref.prefill_logits, ref.decode_logits])
    diff = float(np.abs(logits - expected).max())
    eps = WEIGHT_EPS[weight_type] + (ACT_EPS if weight_type.startswith("Q") else 0.0)
    bound = QUANT_TOL_FACTOR * eps * float(np.abs(expected).max()) if eps else 1e-4
    print(f"{label}: max |logit diff| vs transformers fp32 {diff:.3g} = "
          f"{diff / (eps * np.abs(expected).max()) if eps else 0:.2f} x precision x max|logit| (bound {bound:.3g})")
    assert np.isfinite(logits).all()
    assert diff <= bound, (label, diff, bound)
    return diff


def worst_weight_error(source, stored, weight_type: str) -> tuple[float, int]:  # type: ignore[no-untyped-def]
    """Over every matrix stored as ``weight_type``: max |decoded - source| / (WEIGHT_BOUND x the block's
    amax) (<= 1 when every weight is within its format's rounding), and how many matrices were checked."""
    pairs = [(source.tensors[k], a) for k, a in stored.tensors.items()]
    pairs += [(getattr(source.experts[L][e], p), getattr(x, p)) for L, layer in stored.experts.items()
              for e, x in layer.items() for p in ("gate", "up", "down")]
    worst, checked = 0.0, 0
    for src, a in pairs:
        if isinstance(a, QuantizedTensor) and a.qtype.name == weight_type:
            blocks = np.asarray(src, np.float32).reshape(-1, 32)  # (blocks, 32): GGUF blocks run along rows
            amax = np.abs(blocks).max(axis=1, keepdims=True)
            err = np.abs(np.asarray(a, np.float32).reshape(-1, 32) - blocks)
            worst, checked = max(worst, float((err / (WEIGHT_BOUND[weight_type] * np.maximum(amax, 1e-30))).max())), \
                checked + 1
    return worst, checked


def assert_every_weight_within_its_rounding(path, folder, weight_type: str) -> Weights:  # type: ignore[no-untyped-def]
    """The bound a wrong weight breaks, for block-quantized files (whose logit bound against transformers is
    loose at 4-5 bits: 1.06 x max|logit| for Q4_0): every stored weight within its format's rounding of the
    safetensors weight. Negative control on the same data: expert 0's matrices read in place of expert 1's."""
    source, stored = load_weights(folder), load_weights(path)
    worst, checked = worst_weight_error(source, stored, weight_type)
    print(f"{weight_type}: {checked} matrices, worst stored weight {worst:.2f} x its bound")
    assert checked and worst <= 1.0, (weight_type, worst, checked)
    layer = next(iter(stored.experts.values()))
    wrong = replace(stored, experts={next(iter(stored.experts)): {**layer, 1: layer[0]}})
    assert worst_weight_error(source, wrong, weight_type)[0] > 2.0  # a wrong weight is caught
    return stored


def assert_exact_for_the_file(logits: np.ndarray, path, folder, ref,  # type: ignore[no-untyped-def]
                              weight_type: str) -> None:
    """Every weight within its rounding (above), and the engine's logits within LOGIT_TOL x max|logit| of
    the file decoded by gguf-py and run in float32 (negative control: all-zero logits are not)."""
    stored = assert_every_weight_within_its_rounding(path, folder, weight_type)
    reference = run_logits(dequantised(stored), ref)
    scale = float(np.abs(reference).max())
    print(f"{weight_type}: engine vs file decoded by gguf-py {np.abs(logits - reference).max() / scale:.2e} x "
          f"max|logit| (bound {LOGIT_TOL})")
    assert np.abs(logits - reference).max() <= LOGIT_TOL * scale
    assert np.abs(np.zeros_like(logits) - reference).max() > LOGIT_TOL * scale  # all-zero logits are caught


def rounded(folder, dtype=np.float16) -> Model:  # type: ignore[no-untyped-def]
    """The safetensors checkpoint with every matrix rounded to ``dtype``, except the routers: what an F16
    (BF16) GGUF must hold (norms, biases, sinks and routers stay fp32, as llama.cpp keeps them)."""
    w = load_weights(folder)
    keep = (".router", ".shared_gate")
    w.tensors = {k: (a.astype(dtype) if a.ndim == 2 and not k.endswith(keep) else a) for k, a in w.tensors.items()}
    w.experts = {L: {e: replace(x, gate=x.gate.astype(dtype), up=x.up.astype(dtype), down=x.down.astype(dtype))
                     for e, x in layer.items()} for L, layer in w.experts.items()}
    return Model(w)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_f16_matches_safetensors_within_fp16_rounding(oracle_checkpoints, gguf_checkpoints, arch: str) -> None:
    folder, ref = oracle_checkpoints.get(arch, "per_expert")
    model = load_model(gguf_checkpoints.get(arch, "F16"))
    logits = run_logits(model, ref)
    # 1. Exactly the fp16 rounding of the safetensors weights, nothing else.
    assert np.abs(logits - run_logits(rounded(folder), ref)).max() <= FP32_NOISE
    # 2. Against transformers' fp32 logits, within what fp16 rounding can explain.
    expected = np.concatenate([ref.prefill_logits, ref.decode_logits])
    diff = np.abs(logits - expected).max()
    bound = F16_TOL_FACTOR * FP16_EPS * np.abs(expected).max()
    print(f"{arch} F16: max |logit diff| vs transformers fp32 {diff:.2e} (bound {bound:.2e})")
    assert 0 < diff <= bound  # > 0: the weights really are fp16
    as_stored, copies = f16_matrices(model)  # computed from the F16 bytes (``_f16``), llama.cpp's q/k row order too
    assert copies == 0 and as_stored > 3, (as_stored, copies)
    tokens = list(generate(model, ref.prompt_ids, SamplingParams(max_new_tokens=len(ref.greedy_tokens))))
    assert tokens == ref.greedy_tokens


def test_bf16_is_exactly_bf16_rounding(oracle_checkpoints, gguf_checkpoints) -> None:
    import ml_dtypes

    folder, ref = oracle_checkpoints.get("qwen3_moe", "per_expert")
    logits = run_logits(load_model(gguf_checkpoints.get("qwen3_moe", "BF16")), ref)
    assert np.abs(logits - run_logits(rounded(folder, ml_dtypes.bfloat16), ref)).max() <= FP32_NOISE


def prompt_set(oracle) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """The oracle prompt plus seeded random prompts of the same length."""
    rng = np.random.default_rng(0)
    return [list(oracle.PROMPT)] + [rng.integers(3, 512, len(oracle.PROMPT)).tolist() for _ in range(N_RANDOM_PROMPTS)]


def mismatch_report(base: Model, quant: Model, prompts: list[list[int]]) -> tuple[int, int, int, list[str]]:
    """Teacher-forced on the fp32 greedy continuation: positions whose argmax differs, how many positions,
    how many free-running greedy sequences are identical, and any mismatch that is not a near-tie."""
    mismatches = positions = identical = 0
    unexplained: list[str] = []
    for p in prompts:
        greedy = list(generate(base, p, SamplingParams(max_new_tokens=N_NEW)))
        seq = np.asarray([p + greedy[:-1]])
        a = base.forward(seq, base.new_cache())[0, len(p) - 1 :]  # (N_NEW, V)
        b = quant.forward(seq, quant.new_cache())[0, len(p) - 1 :]
        top2 = np.sort(a, axis=-1)[:, -2:]
        margin = top2[:, 1] - top2[:, 0]
        noise = np.abs(a - b).max(axis=-1)
        for i in np.flatnonzero(a.argmax(-1) != b.argmax(-1)):
            mismatches += 1
            if margin[i] > 2 * noise[i]:  # quantisation noise cannot flip a gap this wide
                unexplained.append(f"prompt {p[:3]}... step {i}: margin {margin[i]:.3f} > 2 x noise {noise[i]:.3f}")
        positions += len(a)
        identical += list(generate(quant, p, SamplingParams(max_new_tokens=N_NEW))) == greedy
    return mismatches, positions, identical, unexplained


@pytest.mark.parametrize(("arch", "weight_type", "bound"), [
    ("mixtral", "F16", 0.02),  # F16 backbone, Q8_0 experts (the usual mix): measured 0/128
    ("mixtral", "Q8_0", 0.05),  # every matrix Q8_0: measured 2/128
    ("qwen2_moe", "F16", 0.02),  # measured 0/128
    ("qwen2_moe", "Q8_0", 0.05),  # measured 3/128
])
def test_q8_0_greedy_tokens_on_the_prompt_set(oracle_checkpoints, gguf_checkpoints, arch: str, weight_type: str,
                                              bound: float) -> None:
    folder, ref = oracle_checkpoints.get(arch, "per_expert")
    quant = load_model(gguf_checkpoints.get(arch, weight_type, "Q8_0"))
    some_expert = quant.weights.experts[0][0].gate
    assert isinstance(some_expert, QuantizedTensor) and some_expert.qtype.name == "Q8_0"
    prompts = prompt_set(oracle_checkpoints.oracle)
    wrong, total, identical, unexplained = mismatch_report(load_model(folder), quant, prompts)
    print(f"{arch} {weight_type}+Q8_0 experts: greedy mismatch rate {wrong}/{total} = {wrong / total:.3f} "
          f"(teacher-forced); identical greedy sequences {identical}/{len(prompts)}")
    assert wrong / total <= bound
    assert not unexplained, unexplained  # every flip is a near-tie, not a wrong weight


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_q4_0_experts_within_their_precision(oracle_checkpoints, gguf_checkpoints, arch: str) -> None:
    folder, ref = oracle_checkpoints.get(arch, "per_expert")
    path = gguf_checkpoints.get(arch, "F16", "Q4_0")
    model = load_model(path)
    gate = model.weights.experts[0][1].gate
    assert isinstance(gate, QuantizedTensor) and gate.nbytes == gate.size * 18 // 32  # 4.5 bits per weight
    logits = run_logits(model, ref)
    assert_within_precision(logits, ref, "Q4_0", f"{arch} F16 + Q4_0 experts")
    assert_exact_for_the_file(logits, path, folder, ref, "Q4_0")
    assert len(list(generate(model, ref.prompt_ids, SamplingParams(max_new_tokens=8)))) == 8


@pytest.mark.parametrize("arch", tuple(a for a in ARCHITECTURES if a in GGUF_ARCH) + ("deepseek_v3_no_q_lora",))
def test_every_architecture_round_trips(oracle_checkpoints, gguf_checkpoints, arch: str) -> None:
    """F32 GGUF == safetensors (every tensor through the name map and back); Q8_0 experts run."""
    folder, ref = oracle_checkpoints.get(arch, "per_expert")
    source = load_weights(folder)
    exact = load_weights(gguf_checkpoints.get(arch, "F32"))
    assert_same_weights(source, exact)
    expected = np.concatenate([ref.prefill_logits, ref.decode_logits])
    assert np.abs(run_logits(Model(exact), ref) - expected).max() <= 1e-4
    # Q8_0 experts: the engine on the file (MatMulNBits, int8 activations) against the same file decoded by
    # gguf-py and run in float32, elementwise (vs transformers, the rounding of the weights can flip a routing
    # choice or a sparse-attention pick: a discrete change no precision bound covers; measured 32 x precision on
    # glm_moe_dsa, 0.6-4.6 x on the others).
    path = gguf_checkpoints.get(arch, "F16", "Q8_0")
    q8, reference = run_logits(load_model(path), ref), run_logits(dequantised(load_weights(path)), ref)
    err = float(np.abs(q8 - reference).max() / np.abs(reference).max())
    print(f"{arch} F16 + Q8_0 experts vs its gguf-py dequantisation: max |diff| / max |logit| {err:.2e}")
    assert err <= LOGIT_TOL
    # > 0 where the experts ran on the int8 kernels; an intermediate size that is no multiple of 32 (glm_moe_dsa's
    # 48) keeps its down matrix F16, and such an expert is decoded to float32 once (exactly the reference)
    some = next(iter(next(iter(load_weights(path).experts.values())).values()))
    assert (err > 1e-5) == all(packable(a) for a in (some.gate, some.up, some.down))


@pytest.mark.parametrize("weight_type", ["F32", "F16", "BF16", "Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0"])
def test_every_writable_type_loads_and_runs(oracle_checkpoints, gguf_checkpoints, weight_type: str) -> None:
    import gguf

    _, ref = oracle_checkpoints.get("qwen3_moe", "per_expert")
    path = gguf_checkpoints.get("qwen3_moe", weight_type)
    reader = gguf.GGUFReader(path)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.1.ffn_up_exps.weight"] == types["blk.1.attn_v.weight"] == weight_type
    assert types["blk.1.ffn_gate_inp.weight"] == types["blk.1.attn_norm.weight"] == "F32"
    model = load_model(path)
    logits = run_logits(model, ref)
    diff = assert_within_precision(logits, ref, weight_type, f"qwen3_moe all-{weight_type} ({path.stat().st_size} bytes)")
    assert (diff > 1e-4) == (weight_type != "F32")  # every matrix really is stored as weight_type
    if weight_type.startswith("Q"):  # the bound above is loose at 4-5 bits (1.06 x max|logit| for Q4_0)
        assert_every_weight_within_its_rounding(path, oracle_checkpoints.get("qwen3_moe", "per_expert")[0],
                                                weight_type)
    if weight_type in ("F16", "BF16"):  # and nothing but that rounding: the file decoded by gguf-py, in float32
        # (block-quantized files against their decoding: test_gguf_kernels.py, through the int8 kernels)
        assert np.abs(logits - run_logits(dequantised(load_weights(path)), ref)).max() <= FP32_NOISE
        # ... computed from the stored 2-byte weights (``_f16``): every matrix that ran, no float32 copy kept
        as_stored, copies = f16_matrices(model)
        print(f"{weight_type}: {as_stored} matrices computed as stored, {copies} float32 copies")
        assert copies == 0 and as_stored > 3  # the backbone's and at least one expert's three


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="negative control: the F16 kernel fed each matrix's stored rows shifted by one")
def test_f16_kernel_fed_the_wrong_bytes_is_caught(oracle_checkpoints, gguf_checkpoints, monkeypatch) -> None:
    """The check above with the kernel reading the wrong bytes (row i computed from stored row i - 1): the
    logits leave the F16 bound against transformers."""
    right = StoredLinear.__init__

    def shifted(self: StoredLinear, w: np.ndarray, bf16: bool, rows: np.ndarray | None = None,
                isa: int | None = None) -> None:
        right(self, np.roll(w, 1, axis=0), bf16, rows, isa)

    monkeypatch.setattr(StoredLinear, "__init__", shifted)
    _, ref = oracle_checkpoints.get("qwen3_moe", "per_expert")
    model = load_model(gguf_checkpoints.get("qwen3_moe", "F16"))
    logits = run_logits(model, ref)
    if f16_matrices(model)[0] < 4:  # not an AssertionError: the xfail must come from the bound alone
        raise RuntimeError("the shifted kernel did not run")
    assert_within_precision(logits, ref, "F16", "qwen3_moe all-F16, kernel fed shifted rows")


def test_fused_backbone_calls_on_an_all_q8_0_file(oracle_checkpoints, gguf_checkpoints) -> None:
    """Qwen2-MoE with every matrix Q8_0 (q/k/v biases; layer 1 a dense MLP, layers 0 and 2 a shared expert):
    each layer's q, k and v are one kernel call (one MatMulNBits over their stacked rows, biases added in the
    graph), each dense MLP and shared expert one (gate, up, SiLU, down in one graph).  Calls per decode
    step: 3 layers x (q/k/v + o) + the QMoE and shared expert of layers 0, 2 + the dense MLP of layer 1 + the LM
    head = 12 (one call per matrix: 24).  Logits against transformers within the all-Q8_0 bound
    (``assert_within_precision``, as ``test_every_writable_type_loads_and_runs``; against the file decoded by
    gguf-py one decode position differs by 0.045 x max|logit| on main's code too: a routing choice the int8
    activations flip).  Negative controls, each past that bound: k's and v's rows swapped in the fused q/k/v;
    gate's and up's in the fused MLPs."""
    from test_gguf_kernels import count_runs  # type: ignore[import-not-found]

    from moeswarm.model._fused import QLinears
    from moeswarm.model._qkernels import QExpertFFN

    _, ref = oracle_checkpoints.get("qwen2_moe", "per_expert")
    model = load_model(gguf_checkpoints.get("qwen2_moe", "Q8_0"))
    assert all(isinstance(model.fused[f"{L}.attn.qkv"], QLinears) for L in range(3))
    assert all(isinstance(model.fused[key], QExpertFFN) for key in ("0.shared", "1.mlp", "2.shared"))
    assert model.weights["0.attn.q"]._kernel is None  # type: ignore[attr-defined]  # not also built alone
    cache = model.new_cache()
    model.forward(np.asarray([ref.prompt_ids]), cache)
    assert count_runs(model, ref.decode_tokens[0], cache) == 12
    assert_within_precision(run_logits(model, ref), ref, "Q8_0", "qwen2_moe all-Q8_0, fused backbone")
    w = model.weights
    for L in range(3):  # negative control 1: k's rows where v's belong and v's where k's
        a = model._attn[L]
        a["qkv"] = QLinears([a["q"].packed(), a["v"].packed(), a["k"].packed()],  # type: ignore[union-attr]
                            np.concatenate([a["q_bias"], a["k_bias"], a["v_bias"]]))
    with pytest.raises(AssertionError):
        assert_within_precision(run_logits(model, ref), ref, "Q8_0", "k and v swapped")
    model._attn = model._attention_tensors()  # the separate q, k, v matrices again
    for key in ("0.shared", "1.mlp", "2.shared"):  # negative control 2: gate and up swapped
        model.fused[key] = QExpertFFN(w[f"{key}.up"].packed(), w[f"{key}.gate"].packed(),  # type: ignore[union-attr]
                                      w[f"{key}.down"].packed())  # type: ignore[union-attr]
    with pytest.raises(AssertionError):
        assert_within_precision(run_logits(model, ref), ref, "Q8_0", "gate and up swapped")
