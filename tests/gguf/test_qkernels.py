"""Repacked quantized kernels against gguf-py's reference dequantisation (an independent decoder).

For every GGML type the engine computes on: the repacked weights equal ``gguf.quants.dequantize``
exactly, and ``QLinear`` (onnxruntime MatMulNBits) equals ``x @ dequantize(W).T`` elementwise within
what int8 activations can change: MLAS rounds each block of ``block`` activations to int8 with the
scale ``max|x_b| / 127``, so each value moves by at most half a step, and output ``n`` by at most
``sum_b max|x_b| / 254 * sum_{k in b} |W[n, k]|``.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from moeswarm.errors import CheckpointError
from moeswarm.model._qkernels import Activation, QExpertFFN, QLinear, repack

TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"]
ENCODABLE = {"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"}  # gguf-py can quantize these; the others only decode
FP32_SLACK = 1e-5  # relative to sum |x| |W|: float32 accumulation in both products


def stored(name: str, n: int, k: int, seed: int = 0, d_max: float = 0.02) -> np.ndarray:
    """(n, bytes per row) of type ``name``: gguf-py's encoding of a random matrix, or (K-quants, IQ4_XS)
    random bytes with small positive fp16 super-block scales, which reach every code and scale."""
    rng = np.random.default_rng(seed)
    qtype = Q[name]
    if name in ENCODABLE:
        return quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    d = (rng.random((n, k // block, 1)) * d_max + d_max / 20).astype(np.float16).view(np.uint8)
    if name == "Q6_K":
        raw[..., 208:210] = d
    else:
        raw[..., 0:2] = d
        if name in ("Q4_K", "Q5_K"):
            raw[..., 2:4] = d  # dmin
    return raw.reshape(n, -1)


def int8_bound(x: np.ndarray, w: np.ndarray, block: int) -> np.ndarray:
    """Elementwise bound (M, N) on |kernel - x @ w.T| from int8 activations of ``block`` values."""
    M, K = x.shape
    step = np.abs(x).reshape(M, K // block, block).max(-1) / 254  # (M, K/block): half an int8 step
    wsum = np.abs(w).reshape(w.shape[0], K // block, block).sum(-1)  # (N, K/block)
    return step @ wsum.T + FP32_SLACK * (np.abs(x) @ np.abs(w).T)


@pytest.mark.parametrize("name", TYPES)
def test_repacked_kernel_equals_reference_dequantisation(name: str) -> None:
    n, k = 96, 512
    raw = stored(name, n, k)
    reference = dequantize(raw, Q[name]).reshape(n, k)
    packed = repack(raw, name, (n, k))
    assert np.array_equal(packed.dequantize(), reference) or np.abs(packed.dequantize() - reference).max() <= (
        1e-6 * np.abs(reference).max())  # the same fp16 scales and integers: exact up to float32 rounding
    kernel = QLinear(packed)
    assert not kernel.session.weights.resident  # released: the products below use onnxruntime's prepacked copy alone
    rng = np.random.default_rng(1)
    for M in (1, 3, 17):  # decode, a few tokens, a prefill chunk
        x = rng.standard_normal((M, k)).astype(np.float32)
        x[0, :32] *= 10  # one loud block: the bound is per block, not per row
        y = kernel.matmul(x)
        expected = x @ reference.T
        bound = int8_bound(x, reference, packed.block)
        err = np.abs(y - expected)
        print(f"{name} M={M}: max err {err.max():.2e}, max err / bound {(err / bound).max():.2f}")
        assert y.shape == (M, n) and y.dtype == np.float32
        assert (err <= bound).all()
        assert err.max() > 0  # the activations really are int8 (else the bound tests nothing)


@pytest.mark.parametrize("name", ["Q4_K", "Q8_0"])
def test_row_permutation_and_bad_input(name: str) -> None:
    n, k = 32, 256
    raw = stored(name, n, k, seed=2)
    reference = dequantize(raw, Q[name]).reshape(n, k)
    rows = np.random.default_rng(3).permutation(n)
    assert np.array_equal(repack(raw, name, (n, k)).take_rows(rows).dequantize(), reference[rows])
    with pytest.raises(CheckpointError, match="no quantized kernel for Q2_K"):
        repack(raw, "Q2_K", (n, k))


@pytest.mark.parametrize(("act", "biases"), [("silu", False), ("clamped_swiglu", True)])
def test_fused_expert_equals_its_dequantised_reference(act: str, biases: bool) -> None:
    H, I = 256, 512
    rng = np.random.default_rng(4)
    gate, up, down = (repack(stored(t, *shape, seed=s, d_max=2e-4), t, shape)
                      for t, shape, s in (("Q4_K", (I, H), 5), ("Q4_K", (I, H), 6), ("Q6_K", (H, I), 7)))
    gb, ub, db = ((rng.standard_normal(m).astype(np.float32) * 0.1) if biases else None for m in (I, I, H))
    activation = Activation(act, alpha=1.702, limit=7.0)
    ffn = QExpertFFN(gate, up, down, activation, (gb, ub, db))
    assert not ffn.session.weights.resident
    x = rng.standard_normal((5, H)).astype(np.float32)
    g, u = x @ gate.dequantize().T, x @ up.dequantize().T
    if biases:
        g, u = g + gb, u + ub
    if act == "silu":
        h = g / (1 + np.exp(-g)) * u
    else:  # gpt-oss (transformers GptOssExperts): clamp, then (up + 1) * gate * sigmoid(alpha * gate)
        g, u = np.minimum(g, 7.0), np.clip(u, -7.0, 7.0)
        h = (u + 1) * (g / (1 + np.exp(-1.702 * g)))
    expected = h @ down.dequantize().T + (db if biases else 0)
    y = ffn(x)
    rel = np.abs(y - expected).max() / np.abs(expected).max()
    print(f"fused expert ({act}): max relative error {rel:.2e}")
    assert rel < 2e-2  # int8 activations twice (a wrong layout or activation is off by ~1)
