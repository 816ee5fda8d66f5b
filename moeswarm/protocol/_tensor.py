"""Tensors on the wire: ``{data: bin, dtype: "f32"|"f16"|"bf16", shape: [uint, ...]}``.

``data`` holds the elements in C (row-major) order as little-endian IEEE-754 binary32,
binary16 or bfloat16. Every v1 tensor must be finite: any element whose exponent bits are
all ones (NaN, +-Inf) is rejected with code 6.

One more dtype, ``"u8"`` (raw bytes, no finiteness rule), travels only where a message allows it:
a ``weights_response`` carrying quantised weights in their stored encoding (v1.2).
"""

from __future__ import annotations

import hashlib
import sys
from typing import Any, Final

import ml_dtypes
import numpy as np

from moeswarm.errors import ConfigError, ProtocolError

from ._limits import MAX_TENSOR_RANK, U32_MAX, ErrorCode
from ._wire import pack

WIRE_DTYPES: Final[dict[str, np.dtype[Any]]] = {
    "f32": np.dtype("<f4"),
    "f16": np.dtype("<f2"),
    "bf16": np.dtype(ml_dtypes.bfloat16),
}
"""Wire dtype name -> numpy dtype of the decoded array."""

BYTES_DTYPE: Final = "u8"  # stored bytes of quantised weights; only in weights_response

# (unsigned view with the same width, mask of the exponent bits)
_BITS: Final[dict[str, tuple[np.dtype[Any], int]]] = {
    "f32": (np.dtype("<u4"), 0x7F800000),
    "f16": (np.dtype("<u2"), 0x7C00),
    "bf16": (np.dtype("<u2"), 0x7F80),
}
_LITTLE: Final = sys.byteorder == "little"


def _bad(message: str, code: int = ErrorCode.BAD_TENSOR) -> ProtocolError:
    return ProtocolError(message, code=code)


def wire_dtype(array: np.ndarray) -> str:
    """The wire name of an array's dtype; ``ConfigError`` for dtypes v1 cannot carry."""
    dt = array.dtype
    if dt == np.float32:
        return "f32"
    if dt == np.float16:
        return "f16"
    if dt == WIRE_DTYPES["bf16"]:
        return "bf16"
    if dt == np.uint8:
        return BYTES_DTYPE
    raise ConfigError(f"dtype {dt} cannot travel in protocol v1 (f32, f16, bf16 only)")


def _raw_bytes(array: np.ndarray, name: str) -> memoryview:
    """The little-endian element bytes of ``array`` in C order, without a copy if possible."""
    if _LITTLE and name != "bf16" and array.flags.c_contiguous:  # the array's own memory, as bytes (no numpy steps)
        return memoryview(array).cast("B")
    if name == BYTES_DTYPE:
        return memoryview(np.ascontiguousarray(array).reshape(-1).data)
    bits = _BITS[name][0]
    flat = np.ascontiguousarray(array).view(bits.newbyteorder("="))
    if not _LITTLE:  # pragma: no cover - big-endian hosts only
        flat = flat.astype(bits)
    return memoryview(flat.reshape(-1).view(np.uint8).data)


def tensor_to_wire(array: np.ndarray) -> dict[str, Any]:
    """The wire map of an f32/f16/bf16 array (keys in canonical order)."""
    name = wire_dtype(array)
    if not 1 <= array.ndim <= MAX_TENSOR_RANK:
        raise ConfigError(f"tensor rank must be 1..{MAX_TENSOR_RANK}, not {array.ndim}")
    return {"data": _raw_bytes(array, name), "dtype": name, "shape": [int(d) for d in array.shape]}


_DATA_KEY: Final = b"\x83" + pack("data")  # a tensor map of 3 entries, then its first key
_DTYPE_FIELD: Final = {name: pack("dtype") + pack(name) + pack("shape") for name in (*WIRE_DTYPES, BYTES_DTYPE)}


def tensor_canonical_parts(array: np.ndarray) -> tuple[bytes, memoryview, bytes]:
    """``(prefix, data, suffix)`` whose concatenation is the canonical tensor map.

    Lets large tensors be hashed without building one more copy of their bytes.
    """
    wire = tensor_to_wire(array)
    data = wire["data"]
    n = data.nbytes
    if n < 2**8:
        header = b"\xc4" + n.to_bytes(1, "big")
    elif n < 2**16:
        header = b"\xc5" + n.to_bytes(2, "big")
    else:
        header = b"\xc6" + n.to_bytes(4, "big")
    return _DATA_KEY + header, data, _DTYPE_FIELD[wire["dtype"]] + pack(wire["shape"])


def tensor_hash(array: np.ndarray) -> bytes:
    """SHA-256 of the canonical msgpack encoding of the tensor map."""
    prefix, data, suffix = tensor_canonical_parts(array)
    h = hashlib.sha256(prefix)
    h.update(data)
    h.update(suffix)
    return h.digest()


def check_finite(array: np.ndarray, name: str, field: str = "tensor") -> None:
    """Raise code 6 if any element is NaN or infinite (exponent bits all ones)."""
    if name == "f32":  # numpy's own test is ~3x faster than the bit test for float32 (not for 16-bit floats)
        if not np.isfinite(array).all():
            raise _bad(f"{field} holds NaN or Inf", ErrorCode.NON_FINITE)
        return
    bits, mask = _BITS[name]
    u = array.reshape(-1).view(bits.newbyteorder("="))
    if np.any((u & mask) == mask):
        raise _bad(f"{field} holds NaN or Inf", ErrorCode.NON_FINITE)


def tensor_from_wire(obj: Any, field: str = "tensor", *, rank: int | None = None,
                     allow_bytes: bool = False) -> np.ndarray:
    """Decode and validate a wire tensor map into a read-only numpy array.

    The array is a zero-copy view of the ``data`` bytes on little-endian hosts.  ``allow_bytes``
    also accepts ``"u8"`` (stored bytes of quantised weights: any value).
    Errors: code 5 for a malformed map, dtype, rank, shape or data length; 6 for NaN/Inf.
    """
    if type(obj) is not dict:
        raise _bad(f"{field} is not a tensor map")
    name = obj.get("dtype")
    dtypes = {**WIRE_DTYPES, BYTES_DTYPE: np.dtype(np.uint8)} if allow_bytes else WIRE_DTYPES
    if type(name) is not str or name not in dtypes:
        raise _bad(f"{field}.dtype must be one of {sorted(dtypes)}")
    shape = obj.get("shape")
    if type(shape) is not list or not 1 <= len(shape) <= MAX_TENSOR_RANK:
        raise _bad(f"{field}.shape must be an array of 1..{MAX_TENSOR_RANK} dimensions")
    if rank is not None and len(shape) != rank:
        raise _bad(f"{field} must have rank {rank}, not {len(shape)}")
    count = 1
    for dim in shape:
        if type(dim) is not int or not 0 <= dim <= U32_MAX:
            raise _bad(f"{field}.shape holds {dim!r}, not a uint32")
        count *= dim
    data = obj.get("data")
    if type(data) is not bytes:
        raise _bad(f"{field}.data is not bin")
    dtype = dtypes[name]
    if len(data) != count * dtype.itemsize:
        raise _bad(f"{field}.data has {len(data)} bytes; shape {shape} of {name} needs "
                   f"{count * dtype.itemsize}")
    if name == BYTES_DTYPE:
        return np.frombuffer(data, dtype=np.uint8).reshape(shape)
    if _LITTLE:
        array = np.frombuffer(data, dtype=dtype)
    else:  # pragma: no cover - big-endian hosts only
        array = np.frombuffer(data, dtype=_BITS[name][0]).astype("=u" + str(dtype.itemsize)).view(dtype)
    check_finite(array, name, field)
    return array.reshape(shape)
