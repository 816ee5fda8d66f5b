"""A layer's routed experts in one onnxruntime call: ``com.microsoft`` ``QMoE`` over the repacked weights.

Why: a decode step ran one onnxruntime call per chosen expert (``QExpertFFN``); ``QMoE`` takes the layer's
tokens, the choice and the combine weights and runs every chosen expert of every token in one call, with
MLAS's block-quantized kernels (int8 activations, ``accuracy_level=4``, as ``MatMulNBits``).  It holds
what ``MatMulNBits`` holds: measured, 8 Q8_0 experts of 1024 x 2816 (70 MiB stored) added 83 MiB of private
memory, 8 Q4_0 ones (37 MiB stored) 54 MiB: the codes and ~2-3 floats per block of 32.

How the choice is handed over: ``R (T, E)`` is 1 at each token's chosen experts and 0 elsewhere, so
``QMoE``'s own top-k over it picks exactly the router's choice; ``C (T, E)`` holds the combine weights
at those experts (``router_weights``, used as given with ``normalize_routing_weights=0``).  The router
itself stays outside (``routing.route``: every family's rule, not only softmax-top-k).

What fits: experts whose matrices repack without a per-block bias (Q8_0, Q4_0, Q5_0, Q6_K, IQ4_XS...:
``Packed.bias is None``), one block size for the layer, gate and up of the same width, and the activation
SiLU(gate) * up (``QMoE``'s ``swiglu``, ``G * sigmoid(alpha G) * (L + beta)``, with alpha 1, beta 0 and no
limit).  gpt-oss's clamped SwiGLU is the same formula with a limit, but measured against the float reference
it was off by 12% of the output where the limit clamps most gates (limit 0.05; 1.3% at limit 7), so it keeps
one ``QExpertFFN`` per expert.  CPU ``QMoE`` wants gate and up fused with their rows interleaved
(``swiglu_fusion=1``).  Other layers keep one ``QExpertFFN`` per expert.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ._ort_session import SESSION_NBYTES, Lazy, Session, release_mapped
from ._qkernels import REPACKERS, Activation, Packed

Matrices = tuple[Packed, Packed, Packed]  # gate, up, down
Biases = tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]


_SILU = Activation()


def fits(experts: Sequence[object], act: Activation = _SILU) -> bool:
    """Whether these ``ExpertWeights`` of packable matrices can run as one ``QMoE`` (see the module docstring);
    decided from their formats, before any repacking."""
    if act.kind != "silu":
        return False
    fmts = [tuple(REPACKERS.get(getattr(getattr(w, p), "kernel_format", None) or "") for p in ("gate", "up", "down"))
            for w in experts]
    if not fmts or any(f is None for row in fmts for f in row):
        return False
    if any(f.bias for row in fmts for f in row):  # type: ignore[union-attr]
        return False
    if len({f.block for row in fmts for f in row}) != 1:  # type: ignore[union-attr]
        return False
    bits = {(g.bits, u.bits, d.bits) for g, u, d in fmts}  # type: ignore[union-attr]
    return len(bits) == 1 and all(g == u for g, u, _ in bits)


def kernel_nbytes(experts: Sequence[object]) -> int:
    """What a ``QLayerMoE`` of these experts holds, counted as ``_qkernels.kernel_nbytes`` counts a matrix: the codes
    and 3 floats per block (measured: 83 MiB for 8 Q8_0 experts of 1024 x 2816 counted as 91; 54 MiB for 8 Q4_0
    ones counted as 58), plus its session."""
    total = SESSION_NBYTES
    for w in experts:
        for p in ("gate", "up", "down"):
            a = getattr(w, p)
            fmt = REPACKERS[a.kernel_format]
            n, k = a.shape
            total += n * k * fmt.bits // 8 + 3 * 4 * n * (k // fmt.block)
    return total


class QLayerMoE:
    """``__call__(x (T, H), ids (T, k), weights (T, k)) -> (T, H)``: the weighted sum of each token's chosen
    experts, for the experts ``expert_ids`` of one layer (ids are the layer's expert numbers)."""

    def __init__(self, expert_ids: Sequence[int], matrices: Sequence[Matrices], biases: Sequence[Biases],
                 top_k: int) -> None:
        from onnx import TensorProto, helper

        from ._qkernels import _Graph

        self.expert_ids = list(expert_ids)
        self.column = np.full(max(self.expert_ids) + 1, -1, np.int64)  # expert number -> its column in R and C
        self.column[self.expert_ids] = np.arange(len(self.expert_ids))
        E = len(self.expert_ids)
        gate, _, down = matrices[0]
        H, inter = gate.k, gate.n
        g = _Graph()

        def stacked(i: int, part: str) -> Lazy:  # (E, n, k * bits / 8) codes or (E, n, k / block) scales
            rows = [getattr(m[i], part).reshape(m[i].n, -1) for m in matrices]

            def fill(out: np.ndarray) -> None:  # written into the session's buffer: no stacked copy beside it
                for j, a in enumerate(rows):
                    out[j] = a
                    release_mapped(a)  # a kernel-file view: its pages leave this process as soon as copied

            return Lazy((E, *rows[0].shape), rows[0].dtype, fill)

        def fused(part: str) -> Lazy:  # gate and up rows interleaved: (E, 2 * inter, ...)
            gates, ups = ([getattr(m[i], part).reshape(m[i].n, -1) for m in matrices] for i in (0, 1))

            def fill(out: np.ndarray) -> None:
                pairs = out.reshape(E, inter, 2, -1)
                for j in range(E):
                    pairs[j, :, 0], pairs[j, :, 1] = gates[j], ups[j]
                    release_mapped(gates[j])
                    release_mapped(ups[j])

            return Lazy((E, 2 * inter, gates[0].shape[1]), gates[0].dtype, fill)

        inputs = ["X", "R", g.weight(fused("data"), "w1"), g.weight(fused("scales"), "s1"),
                  self._bias(g, biases, E, 2 * inter, fused_up=True),
                  g.weight(stacked(2, "data"), "w2"), g.weight(stacked(2, "scales"), "s2"),
                  self._bias(g, biases, E, H, fused_up=False), "", "", "", "", "", "", "C"]
        attrs = {"k": top_k, "activation_type": "swiglu", "swiglu_fusion": 1, "block_size": gate.block,
                 "accuracy_level": 4, "weights_prepacked": 0, "normalize_routing_weights": 0,
                 "expert_weight_bits": gate.bits, "fc2_expert_weight_bits": down.bits,
                 "activation_alpha": 1.0, "activation_beta": 0.0}  # SiLU(gate) * up
        g.nodes.append(helper.make_node("QMoE", inputs, ["Y"], domain="com.microsoft", **attrs))
        widths = {"X": H, "R": E, "C": E}
        ins = [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["M", w]) for name, w in widths.items()]
        out = helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", H])
        graph = helper.make_graph(g.nodes, "moeswarm_layer", ins, [out], initializer=g.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                         helper.make_opsetid("com.microsoft", 1)])
        model.ir_version = 10
        self.session = Session(model.SerializeToString(), widths, g.weights)
        self.nbytes = 0  # set by the caller from the stored formats (``kernel_nbytes``)

    @staticmethod
    def _bias(g, biases: Sequence[Biases], E: int, width: int, fused_up: bool) -> str:  # type: ignore[no-untyped-def]
        """The fc1 (gate/up interleaved) or fc2 (down) bias stack, or "" when no expert has one."""
        parts = [(b[0], b[1]) if fused_up else (b[2],) for b in biases]
        if all(x is None for p in parts for x in p):
            return ""
        if fused_up:
            rows = [np.stack([np.zeros(width // 2, np.float32) if b is None else np.asarray(b, np.float32)
                              for b in p], axis=1).reshape(width) for p in parts]
        else:
            rows = [np.zeros(width, np.float32) if p[0] is None else np.asarray(p[0], np.float32) for p in parts]
        return g.const(np.stack(rows))  # type: ignore[no-any-return]

    def holds(self, ids: np.ndarray) -> bool:
        """Whether every id of ``ids`` is one of this kernel's experts."""
        return not ids.size or (int(ids.min()) >= 0 and int(ids.max()) < len(self.column)
                                and bool((self.column[ids] >= 0).all()))

    def __call__(self, x: np.ndarray, ids: np.ndarray, weights: np.ndarray) -> np.ndarray:
        T, E = x.shape[0], len(self.expert_ids)
        cols = self.column[ids]  # (T, k); the caller checked every id is held (``holds``)
        rows = np.arange(T)[:, None]
        chosen = np.zeros((T, E), np.float32)
        chosen[rows, cols] = 1
        combine = np.zeros((T, E), np.float32)
        combine[rows, cols] = weights
        return self.session.run_inputs({"X": x, "R": chosen, "C": combine})
