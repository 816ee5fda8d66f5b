"""The engine on quantized GGUF files computes with the repacked kernels, and its logits match the same
file run through the dequantised reference path (every weight decoded by gguf-py's ``dequantize``, then
plain float32 numpy).  Files: our converter's Q8_0/Q5_x/Q4_x encodings of a random Mixtral, and files whose
experts are K-quants / IQ4_XS (llama.cpp's Q4_K_M mix: gate/up Q4_K, down Q6_K), written as random blocks
since gguf-py cannot encode those types."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from gguf_reference import LOGIT_TOL, dequantised

from moeswarm.model import SamplingParams, _ort_session, generate, load_model, load_weights
from moeswarm.model._fused import QLinears
from moeswarm.model._gguf_write import TensorPlan, plan, write_gguf
from moeswarm.model._qkernels import KernelExpert, QLinear
from moeswarm.model._qmoe import QLayerMoE
from moeswarm.model.experts import F32Cache, expert_ffn
from moeswarm.model.gguf import QuantizedTensor
from moeswarm.model.synthetic import random_mixtral
from moeswarm.model.transformer import Model
from moeswarm.model.weights import ExpertWeights

PROMPT = [3, 17, 250, 41, 9, 88, 123, 7, 301, 64, 2, 99, 480, 5, 16, 200]
N_DECODE = 8


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    """A Mixtral with rows that K-quants can hold (multiples of 256)."""
    return random_mixtral(tmp_path_factory.mktemp("mixtral256") / "m", hidden=256, inter=256, layers=2, experts=4,
                          vocab=512, heads=4, kv_heads=2)


@dataclass
class Encoded(TensorPlan):
    """A plan whose parts are already GGML blocks."""

    def encode(self, a: np.ndarray) -> np.ndarray:
        return a


def random_blocks(name: str, shape: tuple[int, int], rng: np.random.Generator, std: float) -> np.ndarray:
    """Random ``name`` blocks for an ``(n, k)`` matrix, super-block scales set so the values have ``std``
    and (K-quants) about zero mean."""
    block, size = GGML_QUANT_SIZES[Q[name]]
    n, k = shape
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    d_at = 208 if name == "Q6_K" else 0
    raw[..., d_at : d_at + 2] = np.float16(1.0).reshape(1).view(np.uint8)
    if name in ("Q4_K", "Q5_K"):
        raw[..., 2:4] = np.float16(0.0).reshape(1).view(np.uint8)
    unit = dequantize(raw.reshape(n, -1), Q[name])
    d = np.float16(std / unit.std())
    raw[..., d_at : d_at + 2] = d.reshape(1).view(np.uint8)
    if name in ("Q4_K", "Q5_K"):  # dmin * m (m ~ 31.5 on average) cancels the mean of d * sc * q
        raw[..., 2:4] = np.float16(float(d) * unit.mean() / 31.5).reshape(1).view(np.uint8)
    return raw.reshape(n, -1)


def write(folder: Path, out: Path, backbone: str, gate_up: str | None = None, down: str | None = None,
          attn: dict[str, str] | None = None) -> Path:
    """The converter's file of ``backbone`` type; with ``gate_up``/``down``, random blocks of those types for
    the routed experts instead; with ``attn`` (e.g. ``{"attn_v": "Q6_K"}``), for those attention matrices."""
    w = load_weights(folder)
    plans = plan(w, backbone)
    rng = np.random.default_rng(0)
    for i, p in enumerate(plans):
        if gate_up is not None and "_exps.weight" in p.name:
            name = down if "down" in p.name else gate_up
            parts = tuple(random_blocks(name, p.shape[1:], rng, 1 / np.sqrt(p.shape[-1])) for _ in p.parts)
            plans[i] = Encoded(p.name, Q[name], p.shape, parts)
        kind = p.name.split(".")[-2]
        if attn is not None and kind in attn:
            plans[i] = Encoded(p.name, Q[attn[kind]], p.shape, (random_blocks(attn[kind], p.shape, rng,
                                                                             1 / np.sqrt(p.shape[-1])),))
    write_gguf(out, w, plans, {"config.json": (folder / "config.json").read_text()})
    return out


def run(model: Model, tokens: list[int] | None = None) -> tuple[np.ndarray, list[int]]:
    """Prefill of PROMPT (one chunk) + N_DECODE decode steps at batch 1 -> (16 + N_DECODE, V) logits and
    the tokens fed: its own greedy choices, or ``tokens`` (teacher forcing, so that a near-tie cannot send
    the two runs down different continuations)."""
    cache = model.new_cache()
    logits = [model.forward(np.asarray([PROMPT]), cache)[0]]
    fed: list[int] = []
    for i in range(N_DECODE):
        token = tokens[i] if tokens is not None else int(logits[-1][-1].argmax())
        fed.append(token)
        logits.append(model.forward(np.asarray([[token]]), cache)[0])
    return np.concatenate(logits), fed


CASES = [  # (backbone type, experts' gate/up type, down type); None: the converter's own encoding
    ("Q8_0", None, None), ("Q4_0", None, None), ("Q4_1", None, None), ("Q5_0", None, None), ("Q5_1", None, None),
    ("Q8_0", "Q4_K", "Q6_K"),  # llama.cpp's Q4_K_M experts
    ("Q8_0", "Q5_K", "Q5_K"),
    ("F16", "IQ4_XS", "IQ4_XS"),
]


@pytest.mark.parametrize(("backbone", "gate_up", "down"), CASES)
def test_engine_logits_match_the_dequantised_reference(mixtral: Path, tmp_path: Path, backbone: str,
                                                       gate_up: str | None, down: str | None) -> None:
    path = write(mixtral, tmp_path / "m.gguf", backbone, gate_up, down)
    reference, tokens = run(dequantised(load_weights(path)))
    model = load_model(path)
    logits, _ = run(model, tokens)
    # The kernels did the work: a whole layer's experts in one QMoE call where their encodings have no per-block
    # minimum and one block size, else one repacked kernel per expert; a kernel on each quantized backbone matrix.
    held = model.experts.cache._copies  # type: ignore[attr-defined]
    layer_call = (gate_up or backbone) in ("Q8_0", "Q4_0", "Q5_0", "IQ4_XS")
    assert len(held) > 0 and all(isinstance(held.get(key), QLayerMoE if layer_call else KernelExpert)
                                 for key in held.keys())
    q = model.weights["0.attn.q"]
    if backbone != "F16":  # q, k, v in one call (one MatMulNBits: one format), not three kernels; o its own
        assert isinstance(q, QuantizedTensor) and q._kernel is None
        assert all(isinstance(model.fused[f"{L}.attn.qkv"], QLinears) for L in range(2))
        assert model.fused["0.attn.qkv"].matmuls == 1  # type: ignore[union-attr]
        assert isinstance(model.weights["0.attn.o"]._kernel, QLinear)
    err = np.abs(logits - reference).max() / np.abs(reference).max()
    agree = float((logits.argmax(-1) == reference.argmax(-1)).mean())
    print(f"{backbone} + experts {gate_up or backbone}/{down or backbone}: max |logit diff| / max |logit| "
          f"{err:.2e}, argmax agreement {agree:.2f}")
    assert np.isfinite(logits).all()
    assert 0 < err <= LOGIT_TOL  # > 0: the activations were int8, so this was not the float path


def test_batched_expert_calls_equal_one_row_at_a_time(mixtral: Path, tmp_path: Path) -> None:
    """An expert server's batched call (many rows in one kernel call) equals the rows one by one, and the
    cache keeps the repacked expert (one repack, then hits)."""
    w = load_weights(write(mixtral, tmp_path / "m.gguf", "Q8_0", "Q4_K", "Q6_K"))
    cache = F32Cache()
    x = np.random.default_rng(5).standard_normal((12, 256)).astype(np.float32)
    kernel = cache.get((1, 2), w.experts[1][2])
    assert isinstance(kernel, KernelExpert) and cache.get((1, 2), w.experts[1][2]) is kernel
    together = expert_ffn(kernel, x, w.config)
    alone = np.concatenate([expert_ffn(kernel, x[i : i + 1], w.config) for i in range(len(x))])
    assert np.abs(together - alone).max() <= 1e-5 * np.abs(alone).max()
    reference = expert_ffn(ExpertWeights(*(np.asarray(getattr(w.experts[1][2], p)) for p in ("gate", "up", "down"))),
                           x, w.config)
    assert np.abs(together - reference).max() <= LOGIT_TOL * np.abs(reference).max()


@pytest.mark.parametrize("backend", ["eager", "grouped", "batched"])
def test_every_backend_computes_on_kernels(mixtral: Path, tmp_path: Path, backend: str) -> None:
    path = write(mixtral, tmp_path / "m.gguf", "Q8_0", "Q4_K", "Q6_K")
    auto = list(generate(load_model(path), PROMPT, SamplingParams(max_new_tokens=6)))
    model = load_model(path, backend=backend)
    assert list(generate(model, PROMPT, SamplingParams(max_new_tokens=6))) == auto


def test_decoding_a_quantized_file_allocates_no_float32_copies(tmp_path: Path) -> None:
    """Decode on kernels touches no new memory per token: the old path dequantised the Q8_0 attention and
    LM head (8192 x 512: 16 MiB as float32, 4096 fresh pages) at every step."""
    import resource

    from moeswarm.model.memory import MemoryStats, footprint

    folder = random_mixtral(tmp_path / "m", hidden=512, inter=1024, layers=2, experts=4, vocab=8192, heads=8, kv_heads=2)
    model = load_model(write(folder, tmp_path / "m.gguf", "Q8_0"))
    cache = model.new_cache()
    token = int(model.forward(np.asarray([PROMPT]), cache, last_only=True)[0, -1].argmax())
    for _ in range(4):  # every expert used so far is repacked; the KV cache has room
        token = int(model.forward(np.asarray([[token]]), cache, last_only=True)[0, -1].argmax())
    before, faults = MemoryStats.now().vm_rss, resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    steps = 8
    for _ in range(steps):
        token = int(model.forward(np.asarray([[token]]), cache, last_only=True)[0, -1].argmax())
    per_token = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / steps
    grown = MemoryStats.now().vm_rss - before
    print(f"{footprint(model)}; per decode step: {per_token:.0f} minor faults; RSS grew {grown / 2**20:.1f} MiB")
    assert per_token < 1024  # < 4 MiB of fresh pages per token, a quarter of the LM head alone in float32
    assert grown < 8 << 20


def count_runs(model: Model, token: int, cache) -> int:  # type: ignore[no-untyped-def]
    """onnxruntime calls (``Session.run`` and ``run_inputs``, the layer's QMoE) in one decode step."""
    calls = []
    run_one, run_many = _ort_session.Session.run, _ort_session.Session.run_inputs

    def one(self, x):  # type: ignore[no-untyped-def]
        calls.append(1)
        return run_one(self, x)

    def many(self, feeds):  # type: ignore[no-untyped-def]
        calls.append(1)
        return run_many(self, feeds)

    _ort_session.Session.run, _ort_session.Session.run_inputs = one, many  # type: ignore[method-assign]
    try:
        model.forward(np.asarray([[token]]), cache)
    finally:
        _ort_session.Session.run, _ort_session.Session.run_inputs = run_one, run_many  # type: ignore[method-assign]
    return len(calls)


@pytest.mark.parametrize(("types", "matmuls"), [
    (("Q4_K", "Q4_K", "Q6_K"), 2),  # llama.cpp's Q4_K_M layers with a Q6_K attn_v
    # three formats, one kernel layout (8-bit codes, blocks of 32, no minimum); ordered IQ4_XS/Q8_0/Q5_0 these
    # random blocks flip a routing choice at one prompt position (0.23 x max|logit|), the separate kernels too
    (("Q8_0", "IQ4_XS", "Q5_0"), 1),
])
def test_q_k_v_of_mixed_formats_in_one_call(mixtral: Path, tmp_path: Path, types: tuple[str, str, str],
                                           matmuls: int) -> None:
    """llama.cpp's Q4_K_M keeps ``attn_q``/``attn_k`` Q4_K beside ``attn_v`` Q6_K (in some layers): 4-bit codes
    with a block minimum against 8-bit codes in blocks of 16, so they cannot be one ``MatMulNBits``; q and k are
    one over their stacked rows, v another, in one graph: one onnxruntime call for the three.  Formats that repack
    to one layout stack whatever their GGML type.  Against the file decoded by gguf-py (``LOGIT_TOL``, as every
    quantized file here).  Negative control: the fused kernel built with k's and v's rows swapped moves the logits
    far past that bound.  Calls per decode step: 2 layers x (q/k/v 1 + o 1 + 2 chosen experts, one kernel each:
    Q4_K experts have a block minimum QMoE cannot hold) + the LM head = 9; with q, k, v one call each it was 13."""
    path = write(mixtral, tmp_path / "m.gguf", "Q8_0", "Q4_K", "Q6_K",
                 attn=dict(zip(("attn_q", "attn_k", "attn_v"), types)))
    w = load_weights(path)
    assert tuple(w[f"0.attn.{p}"].qtype.name for p in "qkv") == types
    reference, tokens = run(dequantised(w))
    model = load_model(path)
    kernels = [model.fused[f"{L}.attn.qkv"] for L in range(2)]
    assert all(isinstance(k, QLinears) and k.matmuls == matmuls for k in kernels)
    cache = model.new_cache()
    model.forward(np.asarray([PROMPT]), cache)
    assert count_runs(model, tokens[0], cache) == 2 * (1 + 1 + model.config.top_k) + 1
    logits, _ = run(model, tokens)
    scale = float(np.abs(reference).max())
    err = np.abs(logits - reference).max() / scale
    for L in range(2):  # negative control: k's rows where v's belong and v's where k's
        a = model._attn[L]
        a["qkv"] = QLinears([a["q"].packed(), a["v"].packed(), a["k"].packed()])  # type: ignore[union-attr]
    swapped = np.abs(run(model, tokens)[0] - reference).max() / scale
    print(f"q/k/v {'/'.join(types)} in one call: max |logit diff| / max |logit| {err:.2e}; with k and v swapped "
          f"{swapped:.2e} (bound {LOGIT_TOL})")
    assert 0 < err <= LOGIT_TOL
    assert swapped > LOGIT_TOL
