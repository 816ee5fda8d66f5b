"""A layer's routed experts in one onnxruntime call (``_qmoe.QLayerMoE``, onnxruntime's ``QMoE``) against the
float reference computed from gguf-py's dequantisation of the same stored blocks: each token's chosen experts'
SwiGLU, weighted by the router's weights and summed, in float64 numpy.

Bound: the products see int8 activations (``accuracy_level=4``), as ``QExpertFFN`` does; each projection's
error is bounded per block as in ``test_qkernels.int8_bound``.  The down projection's input carries the gate/up
error too, so the check is relative to the output's size, with the same 2e-2 as the per-expert fused graph
(a wrong layout, interleave, expert column or combine weight is off by ~1).  Before this kernel a layer cost one
onnxruntime call per chosen expert; ``test_one_call_per_layer`` counts the calls."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from test_qkernels import stored  # type: ignore[import-not-found]

from moeswarm.errors import ConfigError
from moeswarm.model import _ort_session
from moeswarm.model._qkernels import Activation
from moeswarm.model._qmoe import QLayerMoE, fits
from moeswarm.model.config import ModelConfig
from moeswarm.model.experts import F32Cache, auto
from moeswarm.model.gguf import QuantizedTensor
from moeswarm.model.weights import ExpertWeights

H, I, E, K = 256, 512, 6, 2


def experts(name: str) -> dict[int, ExpertWeights]:
    """Experts 10, 11, ... (numbers need not start at 0) of stored ``name`` blocks, as the GGUF loader gives them."""
    out = {}
    for e in range(E):
        mats = [QuantizedTensor(stored(name, *shape, seed=10 * e + s, d_max=2e-4), Q[name], shape)
                for s, shape in ((1, (I, H)), (2, (I, H)), (3, (H, I)))]
        out[10 + e] = ExpertWeights(*mats)
    return out


def reference(ws: dict[int, ExpertWeights], x: np.ndarray, ids: np.ndarray, weights: np.ndarray, act: Activation,
              biases: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None) -> np.ndarray:
    out = np.zeros(x.shape, np.float64)
    for t in range(x.shape[0]):
        for e, wt in zip(ids[t], weights[t]):
            w = ws[int(e)]
            gate, up, down = (dequantize(a.raw, a.qtype).reshape(a.shape).astype(np.float64) for a in (w.gate, w.up, w.down))
            g, u = gate @ x[t], up @ x[t]
            if biases is not None:
                g, u = g + biases[int(e)][0], u + biases[int(e)][1]
            if act.kind == "silu":
                h = g / (1 + np.exp(-g)) * u
            else:  # gpt-oss: clamp, then (up + 1) * gate * sigmoid(alpha * gate)
                g, u = np.minimum(g, act.limit), np.clip(u, -act.limit, act.limit)
                h = (u + 1) * (g / (1 + np.exp(-act.alpha * g)))
            y = down @ h + (biases[int(e)][2] if biases is not None else 0)
            out[t] += wt * y
    return out


def choose(rng: np.random.Generator, T: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.stack([rng.choice(np.arange(10, 10 + E), K, replace=False) for _ in range(T)])
    weights = rng.random((T, K)).astype(np.float32)  # not normalised: the kernel must use them as given
    return ids, weights


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q5_0", "Q6_K", "IQ4_XS"])
def test_layer_call_equals_the_dequantised_reference(name: str) -> None:
    ws = experts(name)
    assert fits(list(ws.values()))
    layer = QLayerMoE(sorted(ws), [(w.gate.packed(), w.up.packed(), w.down.packed()) for w in ws.values()],
                      [(None, None, None)] * E, K)
    assert not layer.session.weights.resident  # released: onnxruntime computes from its prepacked copy alone
    rng = np.random.default_rng(7)
    for T in (1, 3, 9):  # decode, a few tokens, a prefill chunk
        x = rng.standard_normal((T, H)).astype(np.float32)
        ids, weights = choose(rng, T)
        y = layer(x, ids, weights)
        expected = reference(ws, x, ids, weights, Activation())
        rel = np.abs(y - expected).max() / np.abs(expected).max()
        print(f"{name} T={T}: max relative error {rel:.2e}")
        assert y.shape == (T, H) and y.dtype == np.float32
        assert 0 < rel < 2e-2  # > 0: int8 activations, not a float path


def test_expert_biases() -> None:
    """Per-expert biases of gate, up (fc1, interleaved like the rows) and down (fc2)."""
    ws = experts("Q8_0")
    rng = np.random.default_rng(8)
    biases = {e: tuple(rng.standard_normal(n).astype(np.float32) for n in (I, I, H)) for e in ws}
    layer = QLayerMoE(sorted(ws), [(w.gate.packed(), w.up.packed(), w.down.packed()) for w in ws.values()],
                      [biases[e] for e in sorted(ws)], K)
    x = rng.standard_normal((4, H)).astype(np.float32)
    ids, weights = choose(rng, 4)
    expected = reference(ws, x, ids, weights, Activation(), biases)  # type: ignore[arg-type]
    without = reference(ws, x, ids, weights, Activation())
    rel = np.abs(layer(x, ids, weights) - expected).max() / np.abs(expected).max()
    print(f"expert biases: max relative error {rel:.2e}; the biases move the output by "
          f"{np.abs(expected - without).max() / np.abs(expected).max():.2f}")
    assert 0 < rel < 2e-2


def test_gpt_oss_activation_keeps_one_kernel_per_expert() -> None:
    """The clamped SwiGLU is not handed to QMoE (see ``_qmoe``'s docstring for what it measured)."""
    assert not fits(list(experts("Q8_0").values()), Activation("clamped_swiglu"))


def test_formats_with_a_block_minimum_keep_one_kernel_per_expert() -> None:
    assert not fits(list(experts("Q4_1").values()))  # d * q + m: a per-block bias QMoE cannot hold
    assert not fits(list(experts("Q4_K").values()))


def test_one_call_per_layer() -> None:
    """The engine's default backend runs the layer's chosen experts in one onnxruntime call (it was one per
    chosen expert: 2 for a token, up to 6 for a 9-token prefill here) and refuses experts it does not hold."""
    cfg = ModelConfig.from_hf({"model_type": "mixtral", "vocab_size": 8, "hidden_size": H, "num_hidden_layers": 1,
                               "num_attention_heads": 4, "num_local_experts": E, "num_experts_per_tok": K,
                               "intermediate_size": I})
    ws = experts("Q8_0")
    store = F32Cache().layer(0, ws)
    rng = np.random.default_rng(9)
    calls = []
    original = _ort_session.Session.run_inputs

    def counted(self, feeds):  # type: ignore[no-untyped-def]
        calls.append(1)
        return original(self, feeds)

    _ort_session.Session.run_inputs = counted  # type: ignore[method-assign]
    try:
        for T in (1, 9):
            x = rng.standard_normal((T, H)).astype(np.float32)
            ids, weights = choose(rng, T)
            calls.clear()
            y = auto(store, x, ids, weights, cfg)
            assert len(calls) == 1
            expected = reference(ws, x, ids, weights, Activation())
            assert np.abs(y - expected).max() / np.abs(expected).max() < 2e-2
    finally:
        _ort_session.Session.run_inputs = original  # type: ignore[method-assign]
    with pytest.raises(ConfigError, match=r"experts \[3\] are not held"):
        auto(store, x, np.array([[3, 10]] * T), weights, cfg)


def test_the_default_cache_sizes_itself_for_every_layer_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ``--memory-budget`` the expert cache makes room for every layer's kernel (as llama.cpp keeps the whole
    file resident) where the memory available at load allows: ``kernels_nbytes`` predicts what the cache holds
    once every layer ran (one ``QLayerMoE`` each, none evicted), and ``_cache_size`` grants it.  With the old fixed
    512 MiB, a real-depth model (8 layers of 128 Q8_0 experts, 0.7 GiB of kernels a layer) evicted its layer
    kernels and rebuilt 54 onnxruntime sessions a token (benchmarks/llamacpp.py --depth real: 1.8 tok/s)."""
    from moeswarm.model import transformer
    from moeswarm.model.experts import kernels_nbytes
    from moeswarm.model.transformer import LocalExperts

    cfg = ModelConfig.from_hf({"model_type": "mixtral", "vocab_size": 8, "hidden_size": H, "num_hidden_layers": 3,
                               "num_attention_heads": 4, "num_local_experts": E, "num_experts_per_tok": K,
                               "intermediate_size": I})
    layers = {L: experts("Q8_0") for L in range(3)}
    local = LocalExperts(layers, cfg)
    rng = np.random.default_rng(3)
    for L in range(3):
        x = rng.standard_normal((4, H)).astype(np.float32)
        local.submit(L, x, *choose(rng, 4)).result()
    assert local.cache.layer_kernels_fit and local.cache._copies.bytes == kernels_nbytes(layers, cfg)

    big = 24 << 30  # a real-depth model's kernels
    monkeypatch.setattr(transformer, "kernels_nbytes", lambda experts, cfg: big)
    monkeypatch.setattr(transformer, "available_bytes", lambda: 32 << 30)
    assert transformer._cache_size(layers, cfg) == big
    monkeypatch.setattr(transformer, "available_bytes", lambda: 16 << 30)  # does not fit: the 512 MiB floor
    assert transformer._cache_size(layers, cfg) == 512 << 20
