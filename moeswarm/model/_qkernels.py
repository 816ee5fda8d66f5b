"""Matrix products on block-quantized weights: onnxruntime's ``MatMulNBits`` (MLAS kernels).

How a stored quantized matrix is wrapped and multiplied
-------------------------------------------------------
1. **Repack** (once, at load or on first use; never per token).  A stored matrix ``W (N, K)`` in any
   block format becomes a ``Packed``::

       W[n, k] = scale[n, b] * (u[n, k] - Z) + bias[n, b]        b = k // block

   ``u`` are unsigned ``bits``-bit codes (``bits`` 4 or 8; 4-bit codes two per byte, low nibble
   first), ``Z = 2 ** (bits - 1)`` (MatMulNBits' default zero point), ``scale`` float32 and
   ``bias`` float32 or ``None`` (only formats with a per-block minimum need it).  ``repack(raw,
   qtype, shape)`` does this for the GGML types in ``REPACKERS``; a new stored format (FP8 block
   scaled, MXFP4, INT4 groups...) plugs in by registering ``fn(raw, n, k) -> Packed`` with
   ``@repacker(name, bits, block, bias)`` (exact whenever its values are ``scale * small integer
   (+ bias)``; centre the codes, since int8 activations err in proportion to ``|scale * (u - Z)|``),
   and its tensor class exposing ``kernel_format``, ``shape`` and ``packed()`` (see
   ``packable``); the engine then computes on it wherever it would have converted to float32.
2. **Multiply**.  ``QLinear(packed).matmul(x)`` gives ``x (M, K) @ W.T -> (M, N)`` float32;
   ``QExpertFFN(gate, up, down, ...)`` runs one routed expert's whole SwiGLU in one onnxruntime
   call (``session.run`` has a fixed cost of ~10 us, so a graph holds as much as it can).  The bias
   term is ``blocksum(x) @ bias.T`` inside the same graph.  The weights are handed to onnxruntime
   from memory and released once it has prepacked them (``_ort_session``): a kernel costs
   ``kernel_nbytes``, not two or three copies.  In the engine, ``experts.mm`` calls a tensor's
   ``matmul`` and ``F32Cache`` turns an expert of packable matrices into a ``KernelExpert``.

Precision: the weights are exact (every GGML value is ``fp16 scale x integer``); with
``accuracy_level=4`` (the fast path, needed for 8-bit codes) MLAS quantizes the activations to
int8 per block of ``block`` values, as llama.cpp quantizes them to Q8 for its dot products.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import CheckpointError
from ._ort_session import (SESSION_NBYTES, Lazy, Session, global_pool_active, placeholder, release_mapped,
                           set_threads)
from ._pages import release_stored


@dataclass(frozen=True)
class Packed:
    """One matrix in MatMulNBits layout (see the module docstring)."""

    n: int  # output rows
    k: int  # inputs per row
    bits: int  # 4 or 8
    block: int  # values per scale (16 or 32)
    data: np.ndarray  # (n, k // block, block * bits // 8) uint8
    scales: np.ndarray  # (n, k // block) float32
    bias: np.ndarray | None = None  # (n, k // block) float32, or None

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scales.nbytes + (self.bias.nbytes if self.bias is not None else 0)

    @property
    def kernel_nbytes(self) -> int:
        """What onnxruntime holds for this matrix once its session exists (see ``kernel_nbytes``)."""
        return kernel_nbytes(self.n, self.k, self.bits, self.block, self.bias is not None)

    def take_rows(self, rows: np.ndarray) -> "Packed":
        """The same matrix with its rows reordered (llama.cpp's q/k rotary permutation undone)."""
        return Packed(self.n, self.k, self.bits, self.block, np.ascontiguousarray(self.data[rows]),
                      np.ascontiguousarray(self.scales[rows]),
                      None if self.bias is None else np.ascontiguousarray(self.bias[rows]))

    def dequantize(self) -> np.ndarray:
        """``W (n, k)`` float32 from the packed form (for tests and debugging, not the hot path)."""
        u = self.data
        if self.bits == 4:
            u = np.stack([u & 0x0F, u >> 4], axis=-1).reshape(self.n, self.k // self.block, self.block)
        w = (u.astype(np.float32) - np.float32(1 << (self.bits - 1))) * self.scales[..., None]
        if self.bias is not None:
            w = w + self.bias[..., None]
        return w.reshape(self.n, self.k)


def kernel_nbytes(n: int, k: int, bits: int, block: int, bias: bool) -> int:
    """Resident bytes of an ``(n, k)`` matrix on the kernels: MLAS's int8-activation layout holds the codes
    and, per block, the scale and the block sum (``QNBitGemmPackQuantBDataSize``); measured with onnxruntime
    1.32 on AVX2, codes + 2.3-3 floats per block (the rest is scratch), so 3 are counted; the bias term's
    ``(k / block, n)`` float matrix is packed for sgemm.  The weights handed over are released
    (``_ort_session``), so this is all a kernel costs besides its session's ``SESSION_NBYTES``."""
    blocks = n * (k // block)
    return n * k * bits // 8 + 3 * 4 * blocks + (4 * (k // block) * -(-n // 16) * 16 if bias else 0)


def same_layout(ps: Sequence[Packed]) -> bool:
    """Whether these matrices can be one MatMulNBits over their rows stacked: the same inputs, code width,
    block and bias form (a per-block minimum or none)."""
    return len({(p.k, p.bits, p.block, p.bias is None) for p in ps}) == 1


def _stacked(parts: Sequence[np.ndarray], axis: int) -> Lazy:
    """``np.concatenate(parts, axis)`` written straight into the session's buffer (``_ort_session.Lazy``); a
    part that is a kernel-file view leaves this process's memory once copied."""
    shape = list(parts[0].shape)
    shape[axis] = sum(a.shape[axis] for a in parts)

    def fill(out: np.ndarray) -> None:
        at = 0
        for a in parts:
            index = [slice(None)] * out.ndim
            index[axis] = slice(at, at + a.shape[axis])
            out[tuple(index)] = a
            at += a.shape[axis]
            release_mapped(a)

    return Lazy(tuple(shape), parts[0].dtype, fill)


def pack(u: np.ndarray, scales: np.ndarray, bias: np.ndarray | None, bits: int, block: int) -> Packed:
    """``u (n, k)`` codes in ``[0, 2**bits)`` -> ``Packed`` (4-bit codes two per byte, low nibble first)."""
    n, k = u.shape
    u = u.astype(np.uint8, copy=False).reshape(n, k // block, block)
    if bits == 4:
        u = u[..., 0::2] | (u[..., 1::2] << np.uint8(4))
    return Packed(n, k, bits, block, np.ascontiguousarray(u), np.ascontiguousarray(scales, dtype=np.float32).reshape(n, -1),
                  None if bias is None else np.ascontiguousarray(bias, dtype=np.float32).reshape(n, -1))


# ---------------------------------------------------------------- GGML blocks -> Packed

Repacker = Callable[[np.ndarray, int, int], Packed]


@dataclass(frozen=True)
class Format:
    """A stored format the kernels compute on: its repacker and the layout it produces."""

    fn: Repacker
    bits: int
    block: int
    bias: bool  # whether its Packed carries a per-block bias (formats with minimums)

    def kernel_nbytes(self, n: int, k: int) -> int:
        return kernel_nbytes(n, k, self.bits, self.block, self.bias)


REPACKERS: dict[str, Format] = {}
REPACKS = {"count": 0}  # matrices repacked from stored blocks by this process (a kernel file makes it 0)


def repacker(name: str, bits: int, block: int, bias: bool = False) -> Callable[[Repacker], Repacker]:
    """Register ``fn(raw (n, bytes per row) uint8, n, k) -> Packed`` for the stored format ``name``."""
    def register(fn: Repacker) -> Repacker:
        REPACKERS[name] = Format(fn, bits, block, bias)
        return fn
    return register


def repack(raw: np.ndarray, qtype: str, shape: tuple[int, int]) -> Packed:
    """A stored ``(n, k)`` matrix of format ``qtype`` (e.g. ``"Q4_K"``) in kernel layout."""
    fmt = REPACKERS.get(qtype)
    if fmt is None:
        raise CheckpointError(f"no quantized kernel for {qtype} weights (kernels exist for {', '.join(REPACKERS)})")
    n, k = shape
    REPACKS["count"] += 1
    return fmt.fn(np.asarray(raw).view(np.uint8).reshape(n, -1), n, k)


def _blocks(raw: np.ndarray, n: int, k: int, per: int) -> np.ndarray:
    """(n, bytes per row) -> (n, k // per, bytes per block)."""
    return raw.reshape(n, k // per, -1)


def _f16(b: np.ndarray) -> np.ndarray:
    """(..., 2) bytes -> (...) float32."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """(..., 16) bytes of a 32-value block -> (..., 32): values 0-15 are low nibbles, 16-31 high ones."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """(..., 4) bytes = a little-endian uint32 -> (..., 32) bits."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


@repacker("Q8_0", 8, 32)
def _q8_0(raw: np.ndarray, n: int, k: int) -> Packed:
    b = _blocks(raw, n, k, 32)
    u = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return pack(u.reshape(n, k), _f16(b[..., :2]), None, 8, 32)


@repacker("Q4_0", 4, 32)
def _q4_0(raw: np.ndarray, n: int, k: int) -> Packed:
    b = _blocks(raw, n, k, 32)
    return pack(_nibbles32(b[..., 2:]).reshape(n, k), _f16(b[..., :2]), None, 4, 32)  # d * (q - 8)


@repacker("Q4_1", 4, 32, bias=True)
def _q4_1(raw: np.ndarray, n: int, k: int) -> Packed:
    b = _blocks(raw, n, k, 32)
    d, m = _f16(b[..., :2]), _f16(b[..., 2:4])
    return pack(_nibbles32(b[..., 4:]).reshape(n, k), d, m + 8 * d, 4, 32)  # d*q + m = d*(q - 8) + (m + 8d)


@repacker("Q5_0", 8, 32)
def _q5_0(raw: np.ndarray, n: int, k: int) -> Packed:
    b = _blocks(raw, n, k, 32)
    q = _nibbles32(b[..., 6:]) | (_high_bits(b[..., 2:6]) << 4)  # 0..31
    return pack((q + 112).reshape(n, k), _f16(b[..., :2]), None, 8, 32)  # d*(q - 16) = d*((q + 112) - 128)


@repacker("Q5_1", 8, 32, bias=True)
def _q5_1(raw: np.ndarray, n: int, k: int) -> Packed:
    b = _blocks(raw, n, k, 32)
    d, m = _f16(b[..., :2]), _f16(b[..., 2:4])
    q = _nibbles32(b[..., 8:]) | (_high_bits(b[..., 4:8]) << 4)
    return pack((q + 112).reshape(n, k), d, m + 16 * d, 8, 32)  # d*q + m = d*(q - 16) + (m + 16d): centred codes


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 scale bytes of a Q4_K / Q5_K super-block -> 8 six-bit scales and 8 six-bit minimums."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_quant(raw: np.ndarray, n: int, k: int, high: bool) -> Packed:
    """Q4_K (``high`` False) and Q5_K: 256-value super-blocks of 8 sub-blocks of 32,
    ``W = d*sc_j * q - dmin*m_j``; each 32 bytes of ``qs`` hold sub-block 2i (low nibbles) and 2i+1."""
    b = _blocks(raw, n, k, 256)
    d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
    sc, mn = _k_scales(b[..., 4:16])
    scale, minimum = d * sc, dmin * mn  # (n, k/256, 8)
    qs = b[..., 48:] if high else b[..., 16:]
    q = np.stack([qs.reshape(*qs.shape[:-1], 4, 32) & 0x0F, qs.reshape(*qs.shape[:-1], 4, 32) >> 4], axis=-2)
    q = q.reshape(n, k // 256, 8, 32)
    if not high:
        return pack(q.reshape(n, k), scale, 8 * scale - minimum, 4, 32)
    qh = b[..., 16:48]  # bit j of byte l is the fifth bit of value l of sub-block j
    bits = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # (n, k/256, 8, 32)
    q = q | (bits << 4)
    return pack((q + 112).reshape(n, k), scale, 16 * scale - minimum, 8, 32)  # centred codes, as Q4_K's


@repacker("Q4_K", 4, 32, bias=True)
def _q4_k(raw: np.ndarray, n: int, k: int) -> Packed:
    return _k_quant(raw, n, k, high=False)


@repacker("Q5_K", 8, 32, bias=True)
def _q5_k(raw: np.ndarray, n: int, k: int) -> Packed:
    return _k_quant(raw, n, k, high=True)


@repacker("Q6_K", 8, 16)
def _q6_k(raw: np.ndarray, n: int, k: int) -> Packed:
    """256-value super-blocks: ql[128], qh[64], 16 int8 scales, fp16 d; ``W = d*sc_j * (q - 32)``, 16 per scale."""
    b = _blocks(raw, n, k, 256)
    ql, qh = b[..., :128], b[..., 128:192]
    sc = b[..., 192:208].view(np.int8).astype(np.float32)
    d = _f16(b[..., 208:210])[..., None]
    lo = np.stack([ql.reshape(n, -1, 2, 64) & 0x0F, ql.reshape(n, -1, 2, 64) >> 4], axis=-2)  # (n, S, half, 2, 64)
    lo = lo.reshape(n, -1, 2, 4, 32)  # per half: low ql[0:32], low ql[32:64], high ql[0:32], high ql[32:64]
    hi = (qh.reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3  # (n, S, half, 4, 32)
    q = lo | (hi << 4)  # 0..63
    return pack((q.astype(np.uint8) + 96).reshape(n, k), d * sc, None, 8, 16)  # q - 32 = (q + 96) - 128


IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int16)


@repacker("IQ4_XS", 8, 32)
def _iq4_xs(raw: np.ndarray, n: int, k: int) -> Packed:
    """256-value super-blocks: fp16 d, 6-bit scales (4 low bits in scales_l, 2 high in scales_h), 4-bit
    indices into the non-linear IQ4_VALUES table: ``W = d*(ls - 32) * IQ4_VALUES[q]``, as 8-bit codes."""
    b = _blocks(raw, n, k, 256)
    d = _f16(b[..., 0:2])[..., None]
    sh = b[..., 2:4].copy().view(np.uint16)  # (n, S, 1)
    sl = b[..., 4:8]
    low = np.stack([sl & 0x0F, sl >> 4], axis=-1).reshape(n, -1, 8)
    high = (sh >> (2 * np.arange(8, dtype=np.uint16))) & 3
    ls = (low | (high.astype(np.uint8) << 4)).astype(np.float32) - 32
    idx = _nibbles32(b[..., 8:].reshape(n, -1, 8, 16))  # (n, S, 8, 32)
    u = (IQ4_VALUES[idx] + 128).astype(np.uint8)
    return pack(u.reshape(n, k), d * ls, None, 8, 32)


# ---------------------------------------------------------------- onnxruntime graphs

class _Graph:
    """Nodes and initializers of one onnxruntime graph, built by name."""

    def __init__(self) -> None:
        self.nodes: list = []  # type: ignore[type-arg]
        self.inits: list = []  # type: ignore[type-arg]
        self.weights: list[tuple[str, np.ndarray | Lazy]] = []  # handed to the session, not serialized (_ort_session)
        self._n = 0

    def name(self, stem: str) -> str:
        self._n += 1
        return f"{stem}{self._n}"

    def const(self, a: np.ndarray, stem: str = "c") -> str:
        from onnx import numpy_helper

        name = self.name(stem)
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(a), name))
        return name

    def weight(self, a: np.ndarray | Lazy, stem: str) -> str:
        """A constant the session prepacks (quantized codes, scales, the bias matrix): handed over from memory."""
        name = self.name(stem)
        if not isinstance(a, Lazy):
            a = np.ascontiguousarray(a)
        self.inits.append(placeholder(name, a))
        self.weights.append((name, a))
        return name

    def op(self, kind: str, inputs: list[str], domain: str = "", **attrs) -> str:  # type: ignore[no-untyped-def]
        from onnx import helper

        out = self.name(kind.lower())
        self.nodes.append(helper.make_node(kind, inputs, [out], domain=domain, **attrs))
        return out

    def linear(self, x: str, p: Packed | Sequence[Packed]) -> str:
        """``x (M, K) @ W.T``: MatMulNBits, plus ``blocksum(x) @ bias.T`` when ``p`` has a bias.  Several
        matrices of one layout (``same_layout``) are one MatMulNBits over their rows stacked, in order: the
        output is theirs side by side (written into the session's buffer, no stacked copy beside it)."""
        ps = [p] if isinstance(p, Packed) else list(p)
        first, n = ps[0], sum(q.n for q in ps)
        if len(ps) > 1 and not same_layout(ps):
            raise ValueError("matrices of different layouts cannot share one MatMulNBits")
        data = first.data if len(ps) == 1 else _stacked([q.data for q in ps], axis=0)
        scales = first.scales.reshape(-1) if len(ps) == 1 else _stacked([q.scales.reshape(-1) for q in ps], axis=0)
        y = self.op("MatMulNBits", [x, self.weight(data, "b"), self.weight(scales, "s")],
                    domain="com.microsoft", K=first.k, N=n, bits=first.bits, block_size=first.block, accuracy_level=4)
        if first.bias is None:
            return y
        bias = first.bias.T if len(ps) == 1 else _stacked([q.bias.T for q in ps], axis=1)  # type: ignore[union-attr]
        blocks = self.op("Reshape", [x, self.const(np.array([-1, first.k // first.block, first.block], np.int64))])
        sums = self.op("ReduceSum", [blocks, self.const(np.array([-1], np.int64))], keepdims=0)  # (M, K/block)
        return self.op("Add", [y, self.op("MatMul", [sums, self.weight(bias, "m")])])

    def rows(self, x: str, ps: Sequence[Packed]) -> str:
        """``x @ [W1; W2; ...].T``: every matrix's output side by side, one MatMulNBits per run of consecutive
        matrices of one layout (a layer's q/k/v of one format: one), joined by a Concat where there are several."""
        runs: list[list[Packed]] = []
        for p in ps:
            if runs and same_layout([runs[-1][0], p]):
                runs[-1].append(p)
            else:
                runs.append([p])
        outs = [self.linear(x, run) for run in runs]
        return outs[0] if len(outs) == 1 else self.op("Concat", outs, axis=-1)

    def build(self, inputs: dict[str, int], output: str, width: int) -> Session:
        from onnx import TensorProto, helper

        ins = [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["M", k]) for name, k in inputs.items()]
        self.nodes.append(helper.make_node("Identity", [output], ["Y"]))
        out = helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", width])
        graph = helper.make_graph(self.nodes, "moeswarm", ins, [out], initializer=self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                         helper.make_opsetid("com.microsoft", 1)])
        model.ir_version = 10
        return Session(model.SerializeToString(), inputs, self.weights)


class QLinear:
    """``matmul(x (M, K)) -> x @ W.T (M, N)`` float32, for one repacked matrix (its own graph)."""

    def __init__(self, p: Packed) -> None:
        self.n, self.k = p.n, p.k
        g = _Graph()
        self.session = g.build({"X": p.k}, g.linear("X", p), p.n)
        self.nbytes = p.kernel_nbytes + SESSION_NBYTES + self.session.weights.nbytes  # the last 0 once released

    def matmul(self, x: np.ndarray) -> np.ndarray:
        return self.session.run(x)


@dataclass(frozen=True)
class Activation:
    """The expert's gated activation: SiLU(gate) * up, or gpt-oss's clamped SwiGLU."""

    kind: str = "silu"  # "silu", "clamped_swiglu" or "limited_swiglu" (DeepSeek-V4: clamps, then SiLU)
    alpha: float = 1.702  # clamped_swiglu: sigmoid(alpha * gate)
    limit: float = 7.0  # clamped_swiglu: gate <= limit, |up| <= limit


class QExpertFFN:
    """One routed expert ``x (T, H) -> (T, H)`` in one onnxruntime call: gate/up projections, the gated
    activation, the down projection (and expert biases, if any), all on repacked weights."""

    def __init__(self, gate: Packed, up: Packed, down: Packed, act: Activation = Activation(),
                 biases: tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None] = (None, None, None)) -> None:
        g = _Graph()
        gb, ub, db = (None if b is None else np.asarray(b, np.float32) for b in biases)
        # gate and up stay two MatMulNBits: one over their stacked rows measured 0-7% slower a call (Q4_0, a
        # Q4_K/Q6_K expert of 1024 x 2816, cycling 32 experts) and would copy the kernel file's views
        gx, ux = g.linear("X", gate), g.linear("X", up)
        if gb is not None:
            gx = g.op("Add", [gx, g.const(gb)])
        if ub is not None:
            ux = g.op("Add", [ux, g.const(ub)])
        if act.kind == "clamped_swiglu":
            gx = g.op("Min", [gx, g.const(np.array(act.limit, np.float32))])
            ux = g.op("Clip", [ux, g.const(np.array(-act.limit, np.float32)), g.const(np.array(act.limit, np.float32))])
            glu = g.op("Mul", [gx, g.op("Sigmoid", [g.op("Mul", [gx, g.const(np.array(act.alpha, np.float32))])])])
            h = g.op("Mul", [g.op("Add", [ux, g.const(np.array(1.0, np.float32))]), glu])
        elif act.kind == "limited_swiglu":
            gx = g.op("Min", [gx, g.const(np.array(act.limit, np.float32))])
            ux = g.op("Clip", [ux, g.const(np.array(-act.limit, np.float32)), g.const(np.array(act.limit, np.float32))])
            h = g.op("Mul", [g.op("Mul", [gx, g.op("Sigmoid", [gx])]), ux])
        else:
            h = g.op("Mul", [g.op("Mul", [gx, g.op("Sigmoid", [gx])]), ux])
        y = g.linear(h, down)
        if db is not None:
            y = g.op("Add", [y, g.const(db)])
        self.session = g.build({"X": gate.k}, y, down.n)
        self.nbytes = (gate.kernel_nbytes + up.kernel_nbytes + down.kernel_nbytes + SESSION_NBYTES
                       + self.session.weights.nbytes)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.session.run(x)




# ---------------------------------------------------------------- routed experts on kernels


def packable(a: object) -> bool:
    """Whether a stored tensor can be computed by these kernels.  The protocol a stored tensor class
    implements: ``kernel_format`` (a key of ``REPACKERS``, or None), ``shape`` ``(n, k)`` and
    ``packed() -> Packed``; ``QuantizedTensor`` (GGUF) is one."""
    return getattr(a, "kernel_format", None) in REPACKERS


class KernelExpert:
    """A routed expert whose matrices are computed by one ``QExpertFFN`` (built on first call, since
    the activation comes from the model config).  ``nbytes``: what its kernels hold (``kernel_nbytes``), for cache
    budgets."""

    def __init__(self, w) -> None:  # type: ignore[no-untyped-def]  # an ExpertWeights of packable matrices
        self.weights = w
        self.nbytes = SESSION_NBYTES + sum(REPACKERS[a.kernel_format].kernel_nbytes(*a.shape)
                                           for a in (w.gate, w.up, w.down))
        self._ffn: QExpertFFN | None = None

    def __call__(self, x: np.ndarray, act: Activation) -> np.ndarray:
        if self._ffn is None:
            w = self.weights
            biases = tuple(None if b is None else np.asarray(b, np.float32) for b in (w.gate_bias, w.up_bias, w.down_bias))
            self._ffn = QExpertFFN(w.gate.packed(), w.up.packed(), w.down.packed(), act, biases)  # type: ignore[arg-type]
            release_stored((w.gate, w.up, w.down))  # the stored bytes are not read again: leave them to the file
        return self._ffn(x)

__all__ = ["Activation", "IQ4_VALUES", "KernelExpert", "Packed", "QExpertFFN", "QLinear", "REPACKERS", "pack",
           "packable", "global_pool_active", "kernel_nbytes", "repack", "repacker", "same_layout", "set_threads"]
