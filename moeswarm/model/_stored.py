"""Weights kept in the format they are published in: FP8 block-scaled, MXFP4, INT4 group-quantised.

Published MoE checkpoints store their experts quantised, and this engine keeps them that way on
disk, in memory, on the wire (a fetching backbone receives them as stored) and in the expert caches: a
``StoredTensor`` holds the stored bytes (``codes``) and their scales, both views into the
checkpoint's memory map, and dequantises only when ``experts.f32`` converts it, one expert at a
time (the ``F32Cache`` keeps the most recent conversions, bounded in bytes).

The three formats, each decoded by one small function (so a fast kernel can later take its place):

* ``fp8_block`` (``quant_method: fp8``, DeepSeek-V3/V3.2, GLM-5, MiniMax M2/M3): ``weight`` is
  float8 e4m3 ``[R, C]``, ``weight_scale_inv`` float32 ``[ceil(R/br), ceil(C/bc)]`` with
  ``weight_block_size: [br, bc]``; ``w = fp8 * scale_inv[r // br, c // bc]`` (``dequant_fp8_block``).
* ``mxfp4`` (``quant_method: mxfp4``, gpt-oss): ``X_blocks`` uint8 ``[.., R, C/32, 16]`` hold two
  e2m1 values per byte (low nibble first), ``X_scales`` uint8 ``[.., R, C/32]`` are e8m0
  exponents; ``w = fp4 * 2**(scale - 127)`` (``dequant_mxfp4``).
* ``int4_group`` (``quant_method: compressed-tensors``, ``format: pack-quantized``, symmetric
  4-bit groups, Kimi K2.x): ``weight_packed`` int32 ``[R, C/8]`` holds eight values per word,
  low nibble first, offset by 8; ``weight_scale`` ``[R, C/g]``; ``w = (q - 8) * scale`` (``dequant_int4_group``).

In memory the codes of MXFP4 and INT4 are both ``[.., R, C/2]`` bytes (a view of the file's
blocks or int32 words), so one row of codes is one row of the matrix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from ..errors import CheckpointError

FORMATS = ("fp8_block", "mxfp4", "int4_group")
_FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
_FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                       dtype=np.float32)


@dataclass(frozen=True)
class QuantFormat:
    """How a checkpoint's quantised weights are stored (from ``config.json``'s ``quantization_config``)."""

    method: str  # one of FORMATS
    block: tuple[int, int] = (128, 128)  # fp8_block: rows x columns sharing one scale
    group: int = 32  # mxfp4 / int4_group: consecutive inputs sharing one scale
    scale_bytes: int = 4  # bytes per scale: fp8 float32, mxfp4 e8m0 (1), int4 bf16 (2)

    @property
    def label(self) -> str:
        if self.method == "fp8_block":
            return f"FP8 e4m3, {self.block[0]}x{self.block[1]} blocks"
        if self.method == "mxfp4":
            return "MXFP4 (e2m1, e8m0 scale per 32)"
        return f"INT4, scale per {self.group}"

    def matrix_bytes(self, rows: int, cols: int) -> int:
        """Stored bytes of one ``[rows, cols]`` matrix: codes plus scales."""
        if self.method == "fp8_block":
            br, bc = self.block
            return rows * cols + math.ceil(rows / br) * math.ceil(cols / bc) * self.scale_bytes
        return rows * cols // 2 + rows * (cols // self.group) * self.scale_bytes

    def part_shapes(self, rows: int, cols: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shapes of (codes, scale) of one ``[rows, cols]`` matrix, as ``StoredTensor`` holds them."""
        if self.method == "fp8_block":
            br, bc = self.block
            return (rows, cols), (math.ceil(rows / br), math.ceil(cols / bc))
        return (rows, cols // 2), (rows, cols // self.group)


def quant_format(raw: dict[str, Any]) -> QuantFormat | None:
    """The ``quantization_config`` of a config.json, or None for an unquantised checkpoint.

    Raises ``ValueError`` (reported by ``ModelConfig.from_hf`` with the file's name) for a
    method this engine does not read."""
    qc = raw.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"FP8 format {qc.get('fmt')!r} is not supported (e4m3)")
        block = qc.get("weight_block_size")
        if not block or len(block) != 2:
            raise ValueError("FP8 without weight_block_size (per-tensor scales) is not supported")
        return QuantFormat("fp8_block", block=(int(block[0]), int(block[1])), scale_bytes=4)
    if method == "mxfp4":
        return QuantFormat("mxfp4", group=32, scale_bytes=1)
    if method == "compressed-tensors":
        if qc.get("format") != "pack-quantized":
            raise ValueError(f"compressed-tensors format {qc.get('format')!r} is not supported (pack-quantized)")
        groups = list((qc.get("config_groups") or {}).values())
        weights = [g.get("weights") or {} for g in groups]
        if len(weights) != 1:
            raise ValueError("compressed-tensors with other than one config group is not supported")
        w = weights[0]
        if (w.get("type"), w.get("num_bits"), w.get("strategy"), w.get("symmetric")) != ("int", 4, "group", True):
            raise ValueError("only symmetric 4-bit group int quantisation is supported for compressed-tensors "
                             f"(got type={w.get('type')}, num_bits={w.get('num_bits')}, "
                             f"strategy={w.get('strategy')}, symmetric={w.get('symmetric')})")
        return QuantFormat("int4_group", group=int(w["group_size"]), scale_bytes=2)
    raise ValueError(f"quantization method {method!r} is not supported (fp8, mxfp4, compressed-tensors)")


# ---------------------------------------------------------------- the decoders: one per format


# Decoding tables: a code indexes its value directly
_FP8_VALUES = np.arange(256, dtype=np.uint8).view(_FP8).astype(np.float32)  # e4m3 byte -> value
with np.errstate(over="ignore"):  # e8m0 255 is NaN in the spec; ldexp (as transformers decodes) gives inf
    _E8M0_VALUES = np.ldexp(np.float32(1), np.arange(256, dtype=np.int32) - 127).astype(np.float32)  # 2**(e - 127)


def dequant_fp8_block(codes: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """codes ``(.., R, C)`` e4m3 bytes, scale ``(.., ceil(R/br), ceil(C/bc))`` -> float32 ``(.., R, C)``.

    An e4m3 byte moved into a float32's sign, low exponent and high mantissa bits is its value
    times 2**-120, subnormals included; times 2**120 and the block's scale gives the weight."""
    bits = codes.astype(np.uint32)  # (.., R, C): bits = sign << 31 | rest << 20, in place
    sign = bits >> 7
    sign <<= 31
    bits &= 0x7F
    bits <<= 20
    bits |= sign
    del sign
    w = bits.view(np.float32)
    w *= np.float32(2.0**120)
    *lead, R, C = w.shape
    br, bc = block
    s = scale.astype(np.float32, copy=False)
    if R % br == 0 and C % bc == 0:  # in place, block by block: no temporary as large as the matrix
        blocks = w.reshape(*lead, R // br, br, C // bc, bc)
        blocks *= s[..., :, None, :, None]
    else:
        w *= np.repeat(np.repeat(s, br, axis=-2), bc, axis=-1)[..., :R, :C]
    nan = (codes & 0x7F) == 0x7F  # e4m3fn has no infinities; S.1111.111 is NaN
    if nan.any():
        w[nan] = np.nan
    return w


def _nibbles(codes: np.ndarray) -> np.ndarray:
    """``(.., n)`` bytes -> ``(.., 2n)`` 4-bit codes, low nibble first."""
    out = np.empty((*codes.shape, 2), dtype=np.uint8)
    np.bitwise_and(codes, 0x0F, out=out[..., 0])
    np.right_shift(codes, 4, out=out[..., 1])
    return out.reshape(*codes.shape[:-1], 2 * codes.shape[-1])


def dequant_mxfp4(codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """codes ``(.., R, C/2)`` e2m1 pairs, scale ``(.., R, C/32)`` e8m0 -> float32 ``(.., R, C)``.

    Like FP8: an e2m1 code in a float32's sign, low exponent and high mantissa bit is its value
    times 2**-126; then times 2**126 and the group's power of two (both exact, as ldexp)."""
    bits = _nibbles(codes).astype(np.uint32)  # sign << 31 | rest << 22, in place
    sign = bits >> 3
    sign <<= 31
    bits &= 7
    bits <<= 22
    bits |= sign
    del sign
    values = bits.view(np.float32)  # (.., R, C)
    values *= np.float32(2.0**126)
    groups = values.reshape(*scale.shape, -1)  # (.., R, C/32, 32)
    groups *= np.take(_E8M0_VALUES, scale)[..., None]
    return values


def dequant_int4_group(codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """codes ``(.., R, C/2)`` offset-8 nibbles, scale ``(.., R, C/g)`` -> float32 ``(.., R, C)``."""
    q = _nibbles(codes).astype(np.float32)
    q -= np.float32(8)
    groups = q.reshape(*scale.shape, -1)
    groups *= scale.astype(np.float32)[..., None]
    return q


def dequantize(fmt: QuantFormat, codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    if fmt.method == "fp8_block":
        return dequant_fp8_block(codes, scale, fmt.block)
    if fmt.method == "mxfp4":
        return dequant_mxfp4(codes, scale)
    return dequant_int4_group(codes, scale)


# ---------------------------------------------------------------- the tensor


class StoredTensor:
    """A weight in its published encoding (codes + scales, views into the map), decoded on use.

    Fits the engine's float32-at-use protocol like ``QuantizedTensor``: ``dtype`` is ``uint8``
    (so ``experts.f32`` always calls ``astype``), ``shape`` the logical shape, ``nbytes`` the
    stored bytes.  Basic indexing of the leading axes (an expert of a stack, every other row)
    returns a ``StoredTensor`` of the same bytes; indexing rows with an integer array decodes."""

    __slots__ = ("fmt", "shape", "codes", "scale")

    def __init__(self, fmt: QuantFormat, shape: tuple[int, ...], codes: np.ndarray, scale: np.ndarray) -> None:
        self.fmt = fmt
        self.shape = tuple(int(d) for d in shape)  # logical, e.g. (I, H)
        self.codes = codes.view(np.uint8) if codes.dtype != np.uint8 else codes
        self.scale = scale
        want_codes, want_scale = fmt.part_shapes(*self.shape[-2:])
        lead = self.shape[:-2]
        if self.codes.shape != (*lead, *want_codes) or self.scale.shape != (*lead, *want_scale):
            raise ValueError(f"{fmt.method} parts {list(self.codes.shape)} and {list(self.scale.shape)} do not "
                             f"make a {list(self.shape)} matrix (expected {[*lead, *want_codes]} and "
                             f"{[*lead, *want_scale]})")

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.uint8)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Stored bytes: what the tensor costs on disk, in RAM and on the wire."""
        return int(self.codes.nbytes + self.scale.nbytes)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """The stored arrays (views into the checkpoint's map, or fetched bytes)."""
        return self.codes, self.scale

    def astype(self, dtype: Any, copy: bool = True) -> np.ndarray:
        return dequantize(self.fmt, self.codes, self.scale).astype(dtype, copy=False)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        if copy is False:
            raise ValueError("a StoredTensor cannot be viewed as an array without decoding it")
        return self.astype(np.float32 if dtype is None else dtype)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, (list, np.ndarray)):
            return self.astype(np.float32)[index]  # e.g. an embedding lookup: decode
        index = index if isinstance(index, tuple) else (index,)
        if len(index) == self.ndim and index[-1] == slice(None):
            index = index[:-1]  # the input axis whole: scales run along it
        if len(index) > self.ndim - 1 or any(not isinstance(i, (int, np.integer, slice)) for i in index):
            raise IndexError(f"a {self.fmt.method} tensor can only be indexed on its leading axes, not {index!r}")
        row_axis = self.ndim - 2
        if (len(index) > row_axis and self.fmt.method == "fp8_block" and self.fmt.block[0] > 1
                and index[row_axis] != slice(None)):
            raise IndexError("rows of an FP8 block-scaled tensor share scales: they cannot be taken apart")
        shape = np.empty(self.shape[:-1], dtype=np.bool_)[index].shape + self.shape[-1:]
        return StoredTensor(self.fmt, shape, self.codes[index], self.scale[index])

    def __repr__(self) -> str:
        return f"StoredTensor({self.fmt.method}, shape={self.shape}, nbytes={self.nbytes})"


def stored_tensor(fmt: QuantFormat, shape: tuple[int, ...], codes: np.ndarray, scale: np.ndarray, *,
                  path: str, key: str) -> StoredTensor:
    """A ``StoredTensor``, or a ``CheckpointError`` naming the tensor whose parts do not fit."""
    try:
        return StoredTensor(fmt, shape, codes, scale)
    except ValueError as e:
        raise CheckpointError(str(e), path=path, tensor=key) from None


# ---------------------------------------------------------------- checkpoint keys -> stored tensors


class _Source:
    """Stands in for a ``SafetensorsFile`` in ``convert``: one combined tensor under one key."""

    def __init__(self, path: str, tensor: StoredTensor) -> None:
        self.path = path
        self._tensor = tensor

    def tensor(self, key: str) -> StoredTensor:
        return self._tensor


_SUFFIXES = {  # method -> (codes key suffix, scale key suffix, the key the pair is known by)
    "fp8_block": (".weight", ".weight_scale_inv", ".weight"),
    "mxfp4": ("_blocks", "_scales", "_blocks"),
    "int4_group": (".weight_packed", ".weight_scale", ".weight"),
}


def combine_stored(keys: dict[str, tuple[Any, str]], fmt: QuantFormat) -> dict[str, tuple[Any, str]]:
    """Checkpoint keys with each (codes, scale) pair replaced by one ``StoredTensor`` under the key
    the engine's rules match (``X.weight``; ``X_blocks`` for MXFP4).  Reads headers only."""
    code_suffix, scale_suffix, known_as = _SUFFIXES[fmt.method]
    out = dict(keys)
    for key in keys:
        if not key.endswith(scale_suffix):
            continue
        stem = key[: -len(scale_suffix)]
        codes_key = stem + code_suffix
        if codes_key not in keys:
            file, _ = keys[key]
            raise CheckpointError(f"scales without their weights {codes_key!r}", path=file.path, tensor=key)
        cfile, cinner = keys[codes_key]
        sfile, sinner = keys[key]
        codes, scale = cfile.tensor(cinner), sfile.tensor(sinner)
        if fmt.method == "fp8_block":
            if codes.dtype != _FP8:
                raise CheckpointError(f"dtype {codes.dtype} where FP8 e4m3 was expected", path=cfile.path,
                                      tensor=codes_key)
            shape = codes.shape
        elif fmt.method == "mxfp4":  # blocks (.., R, C/32, 16) -> codes (.., R, C/2)
            if codes.ndim < 3 or codes.shape[-1] != 16 or codes.dtype != np.uint8:
                raise CheckpointError("MXFP4 blocks must be uint8 [.., rows, groups, 16]", path=cfile.path,
                                      tensor=codes_key)
            codes = codes.reshape(*codes.shape[:-2], codes.shape[-2] * 16)
            shape = (*codes.shape[:-1], codes.shape[-1] * 2)
        else:  # int32 words (R, C/8) -> bytes (R, C/2); weight_shape says C
            shape_key = stem + ".weight_shape"
            if shape_key not in keys or codes.dtype != np.int32:
                raise CheckpointError("pack-quantized weights need int32 weight_packed and weight_shape",
                                      path=cfile.path, tensor=codes_key)
            sh_file, sh_inner = keys[shape_key]
            shape = tuple(int(d) for d in np.asarray(sh_file.tensor(sh_inner)))
            codes = codes.view(np.uint8).reshape(*codes.shape[:-1], codes.shape[-1] * 4)
            out.pop(shape_key, None)
            if shape and shape[-1] % 8 == 0:
                codes = codes[..., : shape[-1] // 2]
        out.pop(key)
        out.pop(codes_key)
        out[stem + known_as] = (_Source(cfile.path, stored_tensor(fmt, shape, codes, scale, path=cfile.path,
                                                                  key=codes_key)), codes_key)
    return out
