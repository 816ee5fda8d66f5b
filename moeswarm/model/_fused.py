"""The backbone's block-quantized matrices fused into fewer kernel calls, built once at load.

Why: a decode token ran one onnxruntime call per backbone matrix (q, k, v, o per layer; gate, up, down of a
dense MLP or shared expert), each with a fixed cost (the session's run, thread-pool dispatch, the int8
quantization of the same activations again).  What fuses:

* a GQA layer's **q, k and v** projections: one ``QLinears`` call over ``x``, one ``MatMulNBits`` over
  their rows stacked when they share a layout (format width, block, bias form: a Q8_0 or Q4_0 file), else
  one per run of equal layouts inside the same graph (llama.cpp's Q4_K_M keeps ``attn_v`` Q6_K in some
  layers beside Q4_K q/k: two ``MatMulNBits``, still one call); the biases are added in the graph.  Measured
  per layer (1024 wide, Q8_0 / Q4_0, weights cache-hot, load 7): stacked 36-38 / 21 us, three ``MatMulNBits``
  in one graph 38-44 / 25 us, three sessions 48-51 / 31-32 us; the outputs are bitwise equal;
* a **dense MLP and a shared expert**: gate, up, the activation and down in one ``QExpertFFN`` call
  (gate and up stay two ``MatMulNBits``: stacked they measured no faster).

What does not: float (F32/F16/BF16) matrices, which would need a stacked float copy beside the stored
ones; a layer whose three matrices are not all block-quantized (it keeps one call per matrix); attention
kinds other than GQA (MLA's projections interleave with norms and rope); the o projection (its input is
the attention's output); families with their own decoder layer (``transformer.DECODER_LAYERS``).

The fused kernel holds what the separate ones would have (``kernel_nbytes``); the separate matrices are not
prepared (``_prepare_backbone`` skips them), so nothing is held twice.  ``Model.fused`` keeps them by name
(``"{L}.attn.qkv"``, ``"{L}.mlp"``, ``"{L}.shared"``) for footprints and tests.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ._ort_session import SESSION_NBYTES
from ._pages import release_stored
from ._qkernels import Activation, Packed, QExpertFFN, _Graph, packable
from .config import ModelConfig

QKV = ("q", "k", "v")


class QLinears:
    """``matmul(x (M, K)) -> x @ [W1; W2; ...].T (M, n1 + n2 + ...)`` float32 (plus ``bias``, if given): several
    matrices on one input in one onnxruntime call, e.g. a layer's q, k and v projections (``_Graph.rows``: one
    MatMulNBits per run of matrices of one layout).  ``widths``: each matrix's share of the output."""

    def __init__(self, ps: Sequence[Packed], bias: np.ndarray | None = None) -> None:
        self.widths = [p.n for p in ps]
        self.n, self.k = sum(self.widths), ps[0].k
        g = _Graph()
        y = g.rows("X", ps)
        if bias is not None:
            y = g.op("Add", [y, g.const(np.asarray(bias, np.float32))])
        self.matmuls = sum(node.op_type == "MatMulNBits" for node in g.nodes)  # one per run of equal layouts
        self.session = g.build({"X": self.k}, y, self.n)
        self.nbytes = sum(p.kernel_nbytes for p in ps) + SESSION_NBYTES + self.session.weights.nbytes

    def matmul(self, x: np.ndarray) -> np.ndarray:
        return self.session.run(x)


def _packed(matrices: Sequence[object]) -> list[Packed] | None:
    """The matrices in kernel layout, or None unless every one is computed by the block-quantized kernels."""
    if not all(packable(a) for a in matrices):
        return None
    return [a.packed() for a in matrices]  # type: ignore[attr-defined]


def fuse_qkv(attn: dict[str, object]) -> QLinears | None:
    """One layer's q, k, v (``attn`` holds its ``attn.*`` tensors) as one ``QLinears``, or None."""
    if any(attn.get(p) is None for p in QKV):
        return None
    ps = _packed([attn[p] for p in QKV])
    if ps is None or len({p.k for p in ps}) != 1:
        return None
    biases = [attn.get(f"{p}_bias") for p in QKV]
    bias = None
    if any(b is not None for b in biases):
        bias = np.concatenate([np.zeros(p.n, np.float32) if b is None else np.asarray(b, np.float32).reshape(-1)
                               for b, p in zip(biases, ps)])
    kernel = QLinears(ps, bias)
    release_stored([attn[p] for p in QKV])
    return kernel


def fuse_ffn(gate: object, up: object, down: object, act: Activation) -> QExpertFFN | None:
    """A dense SwiGLU MLP (or shared expert) as one ``QExpertFFN``, or None."""
    ps = _packed([gate, up, down])
    if ps is None:
        return None
    kernel = QExpertFFN(*ps, act=act)
    release_stored([gate, up, down])
    return kernel


def fuse_backbone(cfg: ModelConfig, tensors: dict[str, object], attn: list[dict[str, object]],
                  dense: Activation, gqa_layers: Sequence[int]) -> dict[str, QLinears | QExpertFFN]:
    """Every fusable group of the backbone: ``"{L}.attn.qkv"`` for the layers in ``gqa_layers`` (``attn[L]`` their
    tensors), ``"{L}.mlp"`` / ``"{L}.shared"`` for dense MLPs and shared experts (activation ``dense``)."""
    fused: dict[str, QLinears | QExpertFFN] = {}
    for L in gqa_layers:
        kernel = fuse_qkv(attn[L])
        if kernel is not None:
            fused[f"{L}.attn.qkv"] = kernel
    for L in range(cfg.all_layers):
        for site in ("mlp", "shared"):
            names = [f"{L}.{site}.{p}" for p in ("gate", "up", "down")]
            if all(n in tensors for n in names):
                ffn = fuse_ffn(*(tensors[n] for n in names), act=dense)
                if ffn is not None:
                    fused[f"{L}.{site}"] = ffn
    return fused


def fused_names(fused: dict[str, object]) -> set[str]:
    """The backbone tensors the fused kernels compute (not to be prepared one by one)."""
    names: set[str] = set()
    for key in fused:
        if key.endswith(".attn.qkv"):
            names.update(f"{key[: -len('qkv')]}{p}" for p in QKV)
        else:
            names.update(f"{key}.{p}" for p in ("gate", "up", "down"))
    return names
