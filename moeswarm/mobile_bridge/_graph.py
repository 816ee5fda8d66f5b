"""The ONNX graph of one layer shard: one independent branch per expert, built with ``onnx.helper``.

Branch of expert ``e`` (``D`` is the export dtype, fp32 or fp16; ``n_e`` a per-branch dynamic dim):

    x_e (n_e, H)
      -> MatMul(w_gu_e (H, 2I)) [+ b_gu_e (2I,)]    gate and up projections fused
      -> Split(axis=1, [I, I]) -> gate, up
      swiglu:          hidden = gate * Sigmoid(gate) * up
      clamped_swiglu:  gate = Min(gate, limit); up = Clip(up, -limit, limit)
                       hidden = (up + 1) * (gate * Sigmoid(gate * alpha))          (gpt-oss)
      -> MatMul(w_down_e (I, H)) [+ b_down_e (H,)]
    y_e (n_e, H)

The operations and their order are those of ``moeswarm.model.experts.expert_ffn``, so fp32
shards match the engine to rounding. Weights are stored transposed (``[in, out]``: ORT's MatMul
orientation) and each branch has its own dynamic row count so branches can be fed empty inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import ConfigError
from ..model import ExpertWeights, ModelConfig

OPSET = 17
IR_VERSION = 9
DTYPES: dict[str, tuple[type[np.floating], int]] = {
    "fp32": (np.float32, TensorProto.FLOAT),
    "fp16": (np.float16, TensorProto.FLOAT16),
}


def input_name(expert: int) -> str:
    return f"x_{expert}"


def output_name(expert: int) -> str:
    return f"y_{expert}"


@dataclass(frozen=True)
class Activation:
    """The expert nonlinearity, read from the model config."""

    kind: str  # "swiglu" or "clamped_swiglu"
    alpha: float = 1.702  # clamped_swiglu: sigmoid slope
    limit: float = 7.0  # clamped_swiglu: clamp bound

    @classmethod
    def of(cls, cfg: ModelConfig) -> "Activation":
        if cfg.expert_activation not in ("swiglu", "clamped_swiglu"):
            raise ConfigError(f"expert activation {cfg.expert_activation!r} cannot be exported")
        return cls(cfg.expert_activation, cfg.swiglu_alpha, cfg.swiglu_limit)


class _Builder:
    def __init__(self, dtype: str) -> None:
        self.np_dtype, self.onnx_dtype = DTYPES[dtype]
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[TensorProto] = []

    def const(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def weight(self, name: str, array: np.ndarray) -> str:
        return self.const(name, np.asarray(array, dtype=np.float32).astype(self.np_dtype))

    def op(self, op_type: str, inputs: list[str], output: str, **attrs: Any) -> str:
        self.nodes.append(helper.make_node(op_type, inputs, [output], **attrs))
        return output


def _branch(b: _Builder, e: int, w: ExpertWeights, act: Activation, scalars: dict[str, str]) -> None:
    inter = w.gate.shape[0]
    w_gu = np.concatenate([np.asarray(w.gate, np.float32).T, np.asarray(w.up, np.float32).T], axis=1)  # (H, 2I)
    gu = b.op("MatMul", [input_name(e), b.weight(f"w_gu_{e}", w_gu)], f"gu_{e}")  # (n, 2I)
    if w.gate_bias is not None and w.up_bias is not None:
        bias = np.concatenate([np.asarray(w.gate_bias, np.float32), np.asarray(w.up_bias, np.float32)])
        gu = b.op("Add", [gu, b.weight(f"b_gu_{e}", bias)], f"gub_{e}")
    elif w.gate_bias is not None or w.up_bias is not None:
        raise ConfigError(f"expert {e} has a gate bias or an up bias but not both")
    b.nodes.append(helper.make_node("Split", [gu, scalars["split"]], [f"g_{e}", f"u_{e}"], axis=1))
    gate, up = f"g_{e}", f"u_{e}"
    if act.kind == "clamped_swiglu":
        gate = b.op("Min", [gate, scalars["limit"]], f"gc_{e}")
        up = b.op("Clip", [up, scalars["neg_limit"], scalars["limit"]], f"uc_{e}")
        slope = b.op("Mul", [gate, scalars["alpha"]], f"ga_{e}")
        glu = b.op("Mul", [gate, b.op("Sigmoid", [slope], f"gs_{e}")], f"glu_{e}")
        hidden = b.op("Mul", [b.op("Add", [up, scalars["one"]], f"u1_{e}"), glu], f"h_{e}")
    else:
        silu = b.op("Mul", [gate, b.op("Sigmoid", [gate], f"gs_{e}")], f"silu_{e}")
        hidden = b.op("Mul", [silu, up], f"h_{e}")
    if inter != w.down.shape[1]:
        raise ConfigError(f"expert {e}: down projection does not take {inter} inputs")
    down = b.weight(f"w_down_{e}", np.asarray(w.down, np.float32).T)  # (I, H)
    if w.down_bias is None:
        b.op("MatMul", [hidden, down], output_name(e))
    else:
        y = b.op("MatMul", [hidden, down], f"yd_{e}")
        b.op("Add", [y, b.weight(f"b_down_{e}", w.down_bias)], output_name(e))


def layer_graph(layer: int, experts: dict[int, ExpertWeights], cfg: ModelConfig, dtype: str) -> onnx.ModelProto:
    """The model of one layer shard holding ``experts`` (expert id -> weights)."""
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    if not experts:
        raise ConfigError(f"layer {layer}: no experts to export")
    act = Activation.of(cfg)
    b = _Builder(dtype)
    inter, hidden = cfg.moe_intermediate_size, cfg.hidden_size
    scalars = {"split": b.const("split_sizes", np.array([inter, inter], np.int64))}
    if act.kind == "clamped_swiglu":
        scalars.update(limit=b.weight("limit", np.asarray(act.limit, np.float32)),
                       neg_limit=b.weight("neg_limit", np.asarray(-act.limit, np.float32)),
                       alpha=b.weight("alpha", np.asarray(act.alpha, np.float32)),
                       one=b.weight("one", np.asarray(1.0, np.float32)))
    inputs, outputs = [], []
    for e in sorted(experts):
        _branch(b, e, experts[e], act, scalars)
        inputs.append(helper.make_tensor_value_info(input_name(e), b.onnx_dtype, [f"n_{e}", hidden]))
        outputs.append(helper.make_tensor_value_info(output_name(e), b.onnx_dtype, [f"n_{e}", hidden]))
    graph = helper.make_graph(b.nodes, f"moeswarm_layer_{layer}", inputs, outputs, b.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="moeswarm", doc_string=f"layer {layer} experts {sorted(experts)}")
    model.ir_version = IR_VERSION
    return model
